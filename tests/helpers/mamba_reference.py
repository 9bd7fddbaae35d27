"""The Mamba recurrence step by step: the reference ``shardwise.models.mamba.chunked_scan`` is compared against."""

from __future__ import annotations

import torch


def sequential_scan(x, dt, A, B, C):
    """Reference recurrence. x [b,t,h,p], dt [b,t,h], A [h], B and C [b,t,n] -> y [b,t,h,p]."""
    b, t, h, p = x.shape
    state = x.new_zeros(b, h, p, B.shape[-1])
    ys = []
    for i in range(t):
        decay = torch.exp(dt[:, i] * A)[:, :, None, None]
        inject = (dt[:, i, :, None] * x[:, i])[..., None] * B[:, i, None, None, :]
        state = decay * state + inject
        ys.append(torch.einsum("bhpn,bn->bhp", state, C[:, i]))
    return torch.stack(ys, dim=1)
