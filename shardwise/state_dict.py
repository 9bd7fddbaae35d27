"""Full (unsharded) views of a sharded model's weights, for export and tests."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["full_state_dict", "gather_model_parallel", "full_group_weights"]


def gather_model_parallel(tensor: torch.Tensor, dims: dict, plan) -> torch.Tensor:
    """Concatenate the tensor- or expert-parallel slices of a parameter along their dims (a collective)."""
    for axis_name, dim in dims.items():
        axis = plan.model_parallel[axis_name]
        pieces = [torch.empty_like(tensor) for _ in range(axis.size)]
        dist.all_gather(pieces, tensor.contiguous(), group=axis.group)
        tensor = torch.cat(pieces, dim=dim)
    return tensor


def full_group_weights(group) -> dict[str, torch.Tensor]:
    """One group's parameters as global tensors: gathered over data- and model-parallel axes."""
    return {
        fqn: gather_model_parallel(tensor, group.refs[i].model_parallel_dims, group.plan)
        for i, (fqn, tensor) in enumerate(group.full_main_weights().items())
    }


def full_state_dict(model: nn.Module, rank0_only: bool = False, cpu: bool = True) -> dict[str, torch.Tensor]:
    """Gather every parameter (main weights) and buffer into plain tensors.

    A collective: every rank must call it. With ``rank0_only`` the other ranks
    get an empty dict (they still take part in the gathers).
    """
    state = getattr(model, "_shardwise_state", None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not sharded by shardwise.fully_shard")
    out: dict[str, torch.Tensor] = {}
    for group in state.groups:
        for fqn, tensor in full_group_weights(group).items():
            out[fqn] = tensor.cpu() if cpu else tensor
    for name, buf in model.named_buffers():
        out[name] = buf.detach().cpu() if cpu else buf.detach()
    if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
        return {}
    return out
