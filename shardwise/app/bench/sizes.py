"""Model sizes the benchmark trains, and a memory estimate for the unsharded baseline.

Every size is a Llama-style :class:`shardwise.models.GPT` (RMSNorm, RoPE, GQA,
SwiGLU, untied embedding and output) with a sequence length, a micro-batch and
default step counts. ``0.9b`` and ``8b`` take their shapes from the ``1b`` and
``8b`` presets of :mod:`shardwise.app.presets`, so ``shardwise train`` and
``shardwise bench`` train the same models.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ...models import GPTConfig
from ..presets import PRESETS

__all__ = ["BenchSize", "SIZES", "model_config", "ddp_bytes_estimate"]

_MODEL_FIELDS = {f.name for f in fields(GPTConfig)}


def _shape(preset: str) -> dict:
    return {k: v for k, v in PRESETS[preset].items() if k in _MODEL_FIELDS}


@dataclass(frozen=True)
class BenchSize:
    name: str
    model: dict = field(repr=False)  # GPTConfig fields
    seq_len: int
    micro_batch: int
    steps: int = 10
    warmup: int = 3
    device: str = "cuda"  # where the size is meant to run ("cpu" for tiny)

    @property
    def activation_checkpointing(self) -> bool:
        return bool(self.model.get("activation_checkpointing", False))


SIZES: dict[str, BenchSize] = {
    "tiny": BenchSize(
        "tiny", dict(vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384),
        seq_len=128, micro_batch=4, steps=10, warmup=3, device="cpu"),
    "0.9b": BenchSize(
        "0.9b", {**_shape("1b"), "activation_checkpointing": False}, seq_len=4096, micro_batch=2),
    "2.8b": BenchSize(
        "2.8b", dict(vocab_size=32000, dim=3072, n_layers=26, n_heads=24, n_kv_heads=8, ffn_hidden=8192,
                     rope_theta=10000.0, activation_checkpointing=True),
        seq_len=4096, micro_batch=1),
    "8b": BenchSize(
        "8b", {**_shape("8b"), "activation_checkpointing": True}, seq_len=4096, micro_batch=1),
    # Larger members of the 8B family, for CPU offload (--offload): 14.5B and 20.3B parameters.
    "14b": BenchSize(
        "14b", {**_shape("8b"), "dim": 5120, "n_layers": 48, "n_heads": 40, "ffn_hidden": 13824,
                "activation_checkpointing": True}, seq_len=4096, micro_batch=1),
    "20b": BenchSize(
        "20b", {**_shape("8b"), "dim": 6144, "n_layers": 48, "n_heads": 48, "ffn_hidden": 16384,
                "activation_checkpointing": True}, seq_len=4096, micro_batch=1),
}


def model_config(size: BenchSize) -> GPTConfig:
    """The size's model config, with RoPE tables exactly as long as its sequences."""
    return GPTConfig(**{**size.model, "max_seq_len": size.seq_len})


def ddp_bytes_estimate(config: GPTConfig, n_params: int, seq_len: int, micro_batch: int) -> int:
    """Rough peak bytes of DDP + autocast + AdamW on one GPU, to skip it where it cannot fit.

    fp32 weights, gradients (bucket views) and two Adam moments are 16 bytes per
    parameter; autocast caches a bf16 copy of each weight during forward (2 more).
    Activations: about 56 bytes per token per unit of width per layer without
    recompute (bf16 matmul inputs, fp32 norms and residuals, SwiGLU), or the fp32
    layer inputs plus one layer's worth with it; the logits cost 10 bytes per
    vocabulary entry per token (bf16 logits, fp32 copy, fp32 gradient).
    """
    tokens = seq_len * micro_batch
    per_layer = 56 * tokens * config.dim
    if config.activation_checkpointing:
        activations = config.n_layers * 4 * tokens * config.dim + per_layer
    else:
        activations = config.n_layers * per_layer
    return 18 * n_params + activations + 10 * tokens * config.vocab_size
