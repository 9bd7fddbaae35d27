"""Named starting points for ``shardwise train --preset NAME``.

Each preset is a flat dict of field names from :class:`shardwise.models.GPTConfig`
and :class:`shardwise.app.train.TrainConfig`; anything not listed keeps the dataclass
default, and every field can still be overridden by ``--config`` or a flag.

* ``tiny``: byte-level model for CPU (2 processes on 2 cores, a few minutes).
* ``tiny-moe`` / ``tiny-hybrid``: the same size with MoE / Mamba layers mixed in.
* ``small``: ~20M parameters, byte-level; a GPU minute, or a long CPU run.
* ``1b``: 0.89B parameters (dim 2048, 16 layers, GQA 16/8, vocab 32000), seq 4096, GPU.
* ``8b``: the Llama-3-8B shape (dim 4096, 32 layers, GQA 32/8, ffn 14336,
  vocab 128256), seq 4096, activation checkpointing, GPU.

The byte-level corpus only uses ids below 256; larger vocabularies still train
(unused rows) and keep the model's shape and FLOPs those of the real model.
"""

from __future__ import annotations

__all__ = ["PRESETS"]

_TINY = dict(
    vocab_size=256, dim=128, n_layers=4, n_heads=4, n_kv_heads=2,
    seq_len=128, micro_batch_size=8, grad_accum=1, steps=300, lr=2e-3, warmup_steps=30,
    weight_decay=0.0,
)

PRESETS: dict[str, dict] = {
    "tiny": _TINY,
    "tiny-moe": {**_TINY, "layer_pattern": "AE", "moe_num_experts": 4, "moe_top_k": 2,
                 "moe_ffn_hidden": 192},
    "tiny-hybrid": {**_TINY, "layer_pattern": "AMAE", "moe_num_experts": 4, "moe_top_k": 2,
                    "moe_ffn_hidden": 192, "mamba_head_dim": 32, "mamba_chunk_size": 32},
    "small": dict(
        vocab_size=256, dim=512, n_layers=8, n_heads=8, n_kv_heads=4,
        seq_len=512, micro_batch_size=8, steps=1000, lr=1e-3, warmup_steps=100,
    ),
    "1b": dict(
        vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_hidden=5632,
        rope_theta=10000.0, seq_len=4096, micro_batch_size=2, steps=100, lr=3e-4,
        warmup_steps=20, precision="bf16",
    ),
    "8b": dict(
        vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_hidden=14336,
        rope_theta=500000.0, seq_len=4096, micro_batch_size=1, steps=50, lr=3e-4,
        warmup_steps=10, precision="bf16", activation_checkpointing=True,
    ),
}
