"""In-job full (unsharded) state dicts of a sharded model and its optimizer, gathered group by group.

Both functions are collectives. Each gathers one parameter group at a time,
so a rank other than the receiving one holds at most one group's full buffer
at once; with ``rank0_only`` those ranks return an empty dict.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..buffers import all_gather_chain
from ..group import rows_view
from ..state_dict import full_group_weights, gather_model_parallel
from .dcp_state import _persistent_buffers, _state, tied_aliases

__all__ = ["gather_full_state_dict", "gather_full_optimizer_state"]


def _keep(rank0_only: bool) -> bool:
    return not rank0_only or not dist.is_initialized() or dist.get_rank() == 0


def gather_full_state_dict(model: nn.Module, *, rank0_only: bool = True, dtype: torch.dtype | None = None,
                           include_tied: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (fp32 main weights, or ``dtype``) and persistent buffer as plain CPU tensors.

    Tied parameters appear once under their first name, or under every name with ``include_tied``.
    """
    keep = _keep(rank0_only)
    out: dict[str, torch.Tensor] = {}
    for group in _state(model).groups:
        full = full_group_weights(group)  # collectives over the group's data- and model-parallel axes
        if keep:
            for fqn, tensor in full.items():
                out[fqn] = tensor.to(dtype or tensor.dtype).cpu()
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
    out: dict[str, dict[str, Any]] = {}
    for group in _state(model).groups:
        start, end = group.opt_range
        states = [optimizer.state.get(p, {}) for p in group.sharded_params]
        keys = list(dict.fromkeys(k for s in states for k, v in s.items() if isinstance(v, DTensor)))
        for key in keys:
            dtype = next(s[key].dtype for s in states if key in s)
            local = torch.zeros(end - start, dtype=dtype, device=group.main.device)
            for state, slot in zip(states, group.layout.slots):
                if key in state:
                    rows_view(local, start, slot, slot.rows_in(start, end)).copy_(state[key].to_local())
            full = torch.empty(group.layout.total, dtype=dtype, device=local.device)
            all_gather_chain(full, local, group.plan.opt_axes)
            for i, (fqn, state, slot) in enumerate(zip(group.fqns, states, group.layout.slots)):
                if key in state:  # the same on every rank of a group, so the collective below matches
                    value = gather_model_parallel(
                        full[slot.offset : slot.end].view(slot.shape), group.refs[i].model_parallel_dims, group.plan)
                    if keep:
                        out.setdefault(fqn, {})[key] = value.cpu().clone()
        if keep:
            for fqn, state in zip(group.fqns, states):
                for key, value in state.items():
                    if not isinstance(value, DTensor):
                        out.setdefault(fqn, {})[key] = value.detach().cpu().clone() if isinstance(
                            value, torch.Tensor) else value
    return out if keep else {}
