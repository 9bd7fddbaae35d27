"""RMSNorm and rotary position embeddings (RoPE)."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RMSNorm", "rope_tables", "apply_rope"]


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in fp32 and returned in the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, device=None):
    """cos and sin tables, each ``[seq_len, head_dim // 2]`` in fp32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate ``x`` (``[batch, seq, heads, head_dim]``): first half pairs with second half."""
    seq = x.shape[1]
    cos, sin = cos[:seq, None, :], sin[:seq, None, :]  # broadcast over batch and heads
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.to(x.dtype)
