"""Full (unsharded) values of a sharded model's state: ``full_state_dict``, the one in-job full state dict."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .model_ops import sharded_state

__all__ = ["full_state_dict", "gathered"]


def gathered(value: DTensor, cpu: bool = True, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``value.full_tensor()`` as a tensor of its own (on one rank the full tensor is the local one)."""
    full = value.full_tensor().detach()
    local = value._local_tensor
    out = full.to(dtype or full.dtype)
    out = out.cpu() if cpu else out
    if out.untyped_storage().data_ptr() == local.untyped_storage().data_ptr() and out.numel():
        out = out.clone()
    return out


def full_state_dict(model: nn.Module, rank0_only: bool = False, cpu: bool = True, *,
                    dtype: torch.dtype | None = None, include_tied: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with every sharded value gathered into a plain tensor: the one full state dict.

    Same keys as ``nn.Module.state_dict()`` (tied aliases and persistent buffers included; with
    ``include_tied=False`` a tied parameter appears once, under its first name, as Hugging Face saves
    it). Parameters come as the fp32 main weights, or cast to ``dtype``. A collective: every rank must
    call it; tensors are gathered one at a time. ``rank0_only`` (default ``False``, as torch's
    ``FullStateDictConfig``): the other ranks take part but keep nothing and get an empty dict.
    """
    sharded_state(model)  # refuses a model fully_shard did not wrap
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    first: dict[int, str] = {}  # a tied parameter's first name
    named = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        named[name] = first.setdefault(id(param), name)
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        state = model.state_dict()
        for key, value in state.items():
            canonical = named.get(key, key)
            if canonical != key:  # an alias of a parameter already (or about to be) gathered
                continue
            if isinstance(value, DTensor):
                full = gathered(value, cpu, dtype)
            elif isinstance(value, torch.Tensor):
                full = value.detach().cpu().clone() if cpu else value.detach()
            else:
                full = value
            if keep:
                out[key] = full
            del full
    if not keep:
        return {}
    if include_tied:
        return {key: out[named.get(key, key)] for key in state}
    return out
