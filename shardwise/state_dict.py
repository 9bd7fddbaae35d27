"""Full (unsharded) values of a sharded model's state, for export and tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .engine import sharded_state

__all__ = ["full_state_dict", "full_tensor_dict", "gathered"]


def gathered(value: DTensor, cpu: bool = True, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``value.full_tensor()`` as a tensor of its own (on one rank the full tensor is the local one)."""
    full = value.full_tensor().detach()
    local = value._local_tensor
    out = full.to(dtype or full.dtype)
    out = out.cpu() if cpu else out
    if out.untyped_storage().data_ptr() == local.untyped_storage().data_ptr() and out.numel():
        out = out.clone()
    return out


def full_tensor_dict(state: dict, cpu: bool = True, same: dict | None = None) -> dict:
    """``state`` with every DTensor replaced by its full tensor (a collective per DTensor).

    ``same`` maps keys to an identity (e.g. the parameter's id): keys with the
    same identity (tied parameters) are gathered once.
    """
    out, done = {}, {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            ident = (same or {}).get(key, key)
            if ident not in done:
                done[ident] = gathered(value, cpu)
            out[key] = done[ident]
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().cpu() if cpu else value.detach()
        else:
            out[key] = value
    return out


def full_state_dict(model: nn.Module, rank0_only: bool = False, cpu: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded value gathered into a plain tensor.

    Same keys as ``nn.Module.state_dict()`` (tied aliases and persistent
    buffers included). A collective: every rank must call it. With
    ``rank0_only`` the other ranks get an empty dict (they still take part).
    """
    sharded_state(model)  # refuses a model fully_shard did not wrap
    with torch.no_grad():
        same = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
        out = full_tensor_dict(model.state_dict(), cpu=cpu, same=same)
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return out
