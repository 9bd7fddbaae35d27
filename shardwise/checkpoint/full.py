"""In-job full (unsharded) state dicts of a sharded model and its optimizer.

Both are collectives on torch's own tools: the values of
``get_model_state_dict`` and of the optimizer's state are gathered with each
DTensor's ``full_tensor()``, one tensor at a time, so a rank holds at most one
full tensor beyond what it returns. With ``rank0_only`` the other ranks
return an empty dict.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..state_dict import gathered
from ..engine import sharded_state
from .dcp_state import _optimizer_params, model_tensors

__all__ = ["gather_full_state_dict", "gather_full_optimizer_state"]


def _keep(rank0_only: bool) -> bool:
    return not rank0_only or not dist.is_initialized() or dist.get_rank() == 0


@torch.no_grad()
def gather_full_state_dict(model: nn.Module, *, rank0_only: bool = True, dtype: torch.dtype | None = None,
                           include_tied: bool = True) -> dict[str, torch.Tensor]:
    """Every key of ``model.state_dict()`` as a plain CPU tensor (parameters as fp32 main weights, or ``dtype``).

    Tied parameters appear under every name, as in ``nn.Module.state_dict()``;
    with ``include_tied=False`` once, under their first name (Hugging Face's form).
    """
    keep = _keep(rank0_only)
    tensors, aliases = model_tensors(model)  # torch's get_model_state_dict, each tensor once
    out: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if isinstance(value, DTensor):
            full = gathered(value, cpu=True, dtype=dtype)
        else:
            full = value.detach().cpu().clone() if keep else None
        if keep:
            out[key] = full
        del full
    if not keep:
        return {}
    if include_tied:
        for alias, canonical in aliases.items():
            out[alias] = out[canonical]
    return out


@torch.no_grad()
def gather_full_optimizer_state(model: nn.Module, optimizer, *, rank0_only: bool = True) -> dict[str, dict[str, Any]]:
    """``{fqn: {state key: value}}`` with sharded state (``exp_avg``...) gathered to full CPU tensors."""
    keep = _keep(rank0_only)
    sharded_state(model)
    out: dict[str, dict[str, Any]] = {}
    for _, pairs in _optimizer_params(model, optimizer):
        for fqn, param in pairs:
            for key, value in optimizer.state.get(param, {}).items():  # the same keys on every rank of the mesh
                if isinstance(value, DTensor):
                    value = gathered(value)
                if keep:
                    out.setdefault(fqn, {})[key] = (
                        value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value)
    return out if keep else {}
