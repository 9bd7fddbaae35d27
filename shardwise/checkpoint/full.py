"""The in-job full (unsharded) optimizer state of a sharded model (the model's: ``shardwise.full_state_dict``).

A collective on torch's own tools: each DTensor of the optimizer's state is
gathered with ``full_tensor()``, one tensor at a time, so a rank holds at most
one full tensor beyond what it returns. With ``rank0_only`` (default
``False``, as ``shardwise.full_state_dict``) the other ranks return an empty dict.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..engine.state_dict import gathered
from ..engine.model_ops import sharded_state
from .dcp_state import _optimizer_params

__all__ = ["gather_full_optimizer_state"]


def _keep(rank0_only: bool) -> bool:
    return not rank0_only or not dist.is_initialized() or dist.get_rank() == 0


@torch.no_grad()
def gather_full_optimizer_state(model: nn.Module, optimizer, *, rank0_only: bool = False) -> dict[str, dict[str, Any]]:
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
