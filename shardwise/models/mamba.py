"""Selective state-space layer (Mamba-2 style) with a chunked scan in pure PyTorch.

Per head h with scalar decay ``A_h < 0``, input-dependent step ``dt`` and shared
``B_t, C_t`` (state size N), the recurrence over time is

    state_t = exp(dt_t A_h) * state_{t-1} + dt_t * x_t B_t^T     ([head_dim, N])
    y_t     = state_t C_t + D_h x_t

``chunked_scan`` computes it in chunks of L steps: inside a chunk with masked
cumulative decays (matmuls, parallel over time), across chunks with a short
sequential loop over chunk-end states (``tests/helpers/mamba_reference.py`` holds
the plain step-by-step loop the tests compare it against).

The layer: ``x + out_proj(scan(silu(conv(x_in))) * silu(z))`` after an RMSNorm,
with a causal depthwise conv over the SSM inputs. It has no MLP of its own
(hybrid stacks interleave it with "A"/"E" layers) and is replicated, not split,
under tensor parallelism.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .norm_rope import RMSNorm
from .tensor_parallel import Linear, scaled_init_std

__all__ = ["MambaLayer", "chunked_scan"]


def chunked_scan(x, dt, A, B, C, chunk: int):
    """The recurrence of the module docstring, ``chunk`` time steps at a time."""
    b, t, h, p = x.shape
    pad = (-t) % chunk  # dt = 0 on padding: no decay, no input
    if pad:
        x, dt, B, C = (F.pad(v, (0, 0) * (v.dim() - 2) + (0, pad)) for v in (x, dt, B, C))
    nc = x.shape[1] // chunk
    x, dt = x.view(b, nc, chunk, h, p), dt.view(b, nc, chunk, h)
    B, C = B.view(b, nc, chunk, -1), C.view(b, nc, chunk, -1)

    a_cum = (dt * A).cumsum(dim=2)  # [b,c,L,h] log decay from chunk start
    x_dt = x * dt[..., None]
    # inside each chunk: y_t += sum_{s<=t} (C_t . B_s) exp(a_cum_t - a_cum_s) dt_s x_s
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    seg = a_cum[:, :, :, None, :] - a_cum[:, :, None, :, :]  # [b,c,t,s,h]
    decay = torch.exp(seg.masked_fill(~causal[:, :, None], float("-inf")))
    scores = torch.einsum("bctn,bcsn->bcts", C, B)
    y = torch.einsum("bcts,bctsh,bcshp->bcthp", scores, decay, x_dt)
    # state each chunk leaves behind, then carried across chunks in order
    to_end = torch.exp(a_cum[:, :, -1:, :] - a_cum)
    chunk_states = torch.einsum("bcsn,bcsh,bcshp->bchpn", B, to_end, x_dt)
    chunk_decay = torch.exp(a_cum[:, :, -1, :])  # [b,c,h]
    state, starts = torch.zeros_like(chunk_states[:, 0]), []
    for c in range(nc):
        starts.append(state)
        state = chunk_decay[:, c, :, None, None] * state + chunk_states[:, c]
    starts = torch.stack(starts, dim=1)  # [b,c,h,p,n]
    y = y + torch.einsum("bctn,bcth,bchpn->bcthp", C, torch.exp(a_cum), starts)
    return y.reshape(b, nc * chunk, h, p)[:, :t]


class MambaLayer(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.d_inner = config.mamba_expand * config.dim
        self.d_state, self.chunk = config.mamba_d_state, config.mamba_chunk_size
        self.n_heads = self.d_inner // config.mamba_head_dim
        conv_ch = self.d_inner + 2 * self.d_state  # x, B, C go through the conv
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.in_proj = Linear(config.dim, self.d_inner + conv_ch + self.n_heads,
                              init_std=config.init_std)  # z, (x, B, C), dt
        self.conv_weight = nn.Parameter(torch.empty(conv_ch, 1, config.mamba_d_conv))
        self.conv_bias = nn.Parameter(torch.empty(conv_ch))
        self.dt_bias = nn.Parameter(torch.empty(self.n_heads))
        self.A_log = nn.Parameter(torch.empty(self.n_heads))
        self.D = nn.Parameter(torch.empty(self.n_heads))
        self.out_proj = Linear(self.d_inner, config.dim,
                               init_std=scaled_init_std(config.init_std, config.n_layers))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        bound = 1.0 / math.sqrt(self.conv_weight.shape[-1])
        self.conv_weight.uniform_(-bound, bound)
        self.conv_bias.zero_()
        dt = torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        self.D.fill_(1.0)

    def forward(self, x, cos=None, sin=None):
        b, t, _ = x.shape
        z, xbc, dt = self.in_proj(self.norm(x)).split(
            [self.d_inner, self.d_inner + 2 * self.d_state, self.n_heads], dim=-1)
        xbc = F.conv1d(xbc.transpose(1, 2), self.conv_weight, self.conv_bias,
                       padding=self.conv_weight.shape[-1] - 1, groups=xbc.shape[-1])
        xbc = F.silu(xbc[..., :t].transpose(1, 2))
        xs, B, C = xbc.float().split([self.d_inner, self.d_state, self.d_state], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        xs = xs.view(b, t, self.n_heads, -1)
        y = chunked_scan(xs, dt, -torch.exp(self.A_log.float()), B, C, self.chunk)
        y = (y + self.D.float()[:, None] * xs).reshape(b, t, self.d_inner).to(x.dtype)
        return x + self.out_proj(y * F.silu(z))
