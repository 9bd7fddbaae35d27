"""In-job full (unsharded) state dicts of a sharded model and its optimizer.

Both functions are collectives built on the DTensors' own ``full_tensor()``:
one parameter is gathered at a time, so a rank holds at most one full
parameter beyond what it returns; with ``rank0_only`` the other ranks return
an empty dict.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..state_dict import gathered
from .dcp_state import _persistent_buffers, _state, sharded_groups, tied_aliases

__all__ = ["gather_full_state_dict", "gather_full_optimizer_state"]


def _keep(rank0_only: bool) -> bool:
    return not rank0_only or not dist.is_initialized() or dist.get_rank() == 0


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, *, rank0_only: bool = True, dtype: torch.dtype | None = None,
                           include_tied: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter (fp32 main weights, or ``dtype``) and persistent buffer as plain CPU tensors.

    Tied parameters appear under every name, as in ``nn.Module.state_dict()``
    (once, under their first name, with ``include_tied=False``).
    """
    keep = _keep(rank0_only)
    out: dict[str, torch.Tensor] = {}
    for info in sharded_groups(model):
        full = gathered(info.param, cpu=True, dtype=dtype)
        if keep:
            out[info.fqn] = full
        del full
    if not keep:
        return {}
    for name, buf in _persistent_buffers(model).items():
        out[name] = buf.detach().cpu().clone()
    if include_tied:
        for alias, canonical in tied_aliases(model).items():
            out[alias] = out[canonical]
    return out


@torch.no_grad()
def gather_full_optimizer_state(model: nn.Module, optimizer, *, rank0_only: bool = True) -> dict[str, dict[str, Any]]:
    """``{fqn: {state key: value}}`` with sharded state (``exp_avg``...) gathered to full CPU tensors."""
    keep = _keep(rank0_only)
    _state(model)
    out: dict[str, dict[str, Any]] = {}
    for info in sharded_groups(model):
        state = optimizer.state.get(info.param, {})
        for key, value in state.items():  # every rank of the parameter's mesh has the same keys
            if isinstance(value, DTensor):
                value = gathered(value)
            if keep:
                out.setdefault(info.fqn, {})[key] = (
                    value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value
                )
    return out if keep else {}
