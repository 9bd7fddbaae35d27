"""Grouped-query causal self-attention with RoPE, split over TP ranks by heads and, with a CP group,
over the sequence (``context_parallel.py``: zig-zag chunks, K/V all-gathered)."""

from __future__ import annotations

from torch import nn

from .config import GPTConfig
from .context_parallel import context_parallel_attention
from .norm_rope import apply_rope
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, group_size, scaled_init_std

__all__ = ["Attention"]


class Attention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        tp, group, std = group_size(config.tp_group), config.tp_group, config.init_std
        if config.n_heads % tp or config.n_kv_heads % tp:
            raise ValueError(
                f"n_heads={config.n_heads} and n_kv_heads={config.n_kv_heads} must be "
                f"divisible by the tensor-parallel size {tp}"
            )
        self.head_dim = config.head_dim
        self.n_heads, self.n_kv_heads = config.n_heads // tp, config.n_kv_heads // tp  # local
        self.dropout = config.dropout
        self.cp_group = config.cp_group
        q_out, kv_out = config.n_heads * self.head_dim, config.n_kv_heads * self.head_dim
        self.wq = ColumnParallelLinear(config.dim, q_out, group=group, init_std=std)
        self.wk = ColumnParallelLinear(config.dim, kv_out, group=group, init_std=std)
        self.wv = ColumnParallelLinear(config.dim, kv_out, group=group, init_std=std)
        self.wo = RowParallelLinear(q_out, config.dim, group=group,
                                    init_std=scaled_init_std(std, config.n_layers))

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = apply_rope(self.wq(x).view(b, t, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, t, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim)
        y = context_parallel_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.cp_group,
            causal=True,
            dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
