"""Configuration of the reference models: one dataclass, every field documented.

The layer pattern picks the kind of each layer, one letter per layer:

    A  attention + SwiGLU MLP          (TransformerLayer)
    E  attention + mixture of experts  (MoETransformerLayer)
    M  selective state-space mixer     (MambaLayer)

An empty pattern means all "A". A pattern shorter than ``n_layers`` is repeated
(``n_layers`` must be a multiple of its length), so "AE" with 8 layers is
"AEAEAEAE" and "AAMAE" with 5 layers is used as written.

``tp_group`` / ``ep_group`` / ``cp_group`` are runtime process groups, not configuration: they
are left out of :meth:`GPTConfig.to_dict` and of the command line.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["GPTConfig", "LAYER_KINDS"]

LAYER_KINDS = {"A": "attention", "E": "moe", "M": "mamba"}
_RUNTIME_FIELDS = ("tp_group", "ep_group", "cp_group")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class GPTConfig:
    vocab_size: int = field(default=256, metadata=_help("vocabulary size (256 = bytes)"))
    dim: int = field(default=256, metadata=_help("model (residual stream) width"))
    n_layers: int = field(default=4, metadata=_help("number of layers"))
    n_heads: int = field(default=4, metadata=_help("attention query heads"))
    n_kv_heads: int = field(default=0, metadata=_help("key/value heads (0 = n_heads); GQA when fewer"))
    ffn_hidden: int = field(default=0, metadata=_help("SwiGLU hidden width (0 = ~8/3 dim, multiple of 64)"))
    max_seq_len: int = field(default=2048, metadata=_help("longest sequence RoPE tables cover"))
    rope_theta: float = field(default=10000.0, metadata=_help("RoPE base frequency"))
    norm_eps: float = field(default=1e-5, metadata=_help("RMSNorm epsilon"))
    tie_embeddings: bool = field(default=False, metadata=_help("output head reuses the embedding weight"))
    dropout: float = field(default=0.0, metadata=_help("dropout on attention and residual branches"))
    init_std: float = field(default=0.02, metadata=_help("std of the normal weight init"))
    layer_pattern: str = field(default="", metadata=_help("layer kinds, A=attention E=MoE M=Mamba (tiled)"))
    activation_checkpointing: bool = field(default=False, metadata=_help("recompute each layer in backward"))
    # mixture of experts (layers "E")
    moe_num_experts: int = field(default=8, metadata=_help("experts per MoE layer"))
    moe_top_k: int = field(default=2, metadata=_help("experts each token is routed to"))
    moe_ffn_hidden: int = field(default=0, metadata=_help("expert hidden width (0 = ffn_hidden)"))
    moe_aux_loss_coef: float = field(default=0.01, metadata=_help("weight of the load-balancing loss"))
    # selective state space (layers "M")
    mamba_d_state: int = field(default=16, metadata=_help("SSM state size per head"))
    mamba_d_conv: int = field(default=4, metadata=_help("causal depthwise conv width"))
    mamba_expand: int = field(default=2, metadata=_help("inner width = expand * dim"))
    mamba_head_dim: int = field(default=32, metadata=_help("channels per SSM head"))
    mamba_chunk_size: int = field(default=64, metadata=_help("chunk length of the chunked scan"))
    # runtime process groups (not serialized)
    tp_group: Any = field(default=None, repr=False, compare=False)
    ep_group: Any = field(default=None, repr=False, compare=False)
    cp_group: Any = field(default=None, repr=False, compare=False)  # context parallel: models/context_parallel.py

    def __post_init__(self):
        if self.n_kv_heads == 0:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden == 0:
            self.ffn_hidden = 64 * ((8 * self.dim // 3 + 63) // 64)
        if self.moe_ffn_hidden == 0:
            self.moe_ffn_hidden = self.ffn_hidden

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def layer_kinds(self) -> str:
        """The pattern expanded to one letter per layer."""
        pattern = self.layer_pattern or "A"
        return pattern * (self.n_layers // len(pattern))

    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending field."""
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r}: {why}")

        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "max_seq_len"):
            need(getattr(self, name) > 0, name, "must be positive")
        need(self.dim % self.n_heads == 0, "dim", f"must be divisible by n_heads={self.n_heads}")
        need(self.head_dim % 2 == 0, "n_heads", f"head dim {self.head_dim} must be even for RoPE")
        need(self.n_heads % self.n_kv_heads == 0, "n_kv_heads", f"must divide n_heads={self.n_heads}")
        need(0.0 <= self.dropout < 1.0, "dropout", "must be in [0, 1)")
        bad = sorted(set(self.layer_pattern) - set(LAYER_KINDS))
        need(not bad, "layer_pattern", f"unknown letters {bad}; use {LAYER_KINDS}")
        need(self.n_layers % max(1, len(self.layer_pattern)) == 0, "layer_pattern",
             f"n_layers={self.n_layers} must be a multiple of the pattern length")
        if "E" in self.layer_kinds:
            need(self.moe_num_experts > 0, "moe_num_experts", "must be positive")
            need(0 < self.moe_top_k <= self.moe_num_experts, "moe_top_k",
                 f"must be in [1, moe_num_experts={self.moe_num_experts}]")
        if "M" in self.layer_kinds:
            inner = self.mamba_expand * self.dim
            need(inner % self.mamba_head_dim == 0, "mamba_head_dim",
                 f"must divide mamba_expand*dim={inner}")
            need(self.mamba_chunk_size > 0, "mamba_chunk_size", "must be positive")

    def to_dict(self) -> dict:
        """JSON-ready fields (runtime process groups left out)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _RUNTIME_FIELDS}

    @classmethod
    def cli_fields(cls):
        """Fields the command line may set."""
        return [f for f in fields(cls) if f.name not in _RUNTIME_FIELDS]
