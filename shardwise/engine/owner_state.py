"""State dicts of owned matrices: ``torch.chunk`` rows over the data-parallel mesh (the documented conversion).

An owned matrix (``owner_layout``) is ``Replicate()`` on its owner's one-rank
mesh: true for an optimizer, whose arithmetic then runs on the owner alone, but
a checkpoint written so would name one rank per matrix and load only where
that rank owns it again. So a state dict holds it as FSDP2 holds any
parameter, ``Shard(0)`` over the data-parallel mesh: DCP checkpoints then load
at another world size, into FSDP2 and into a plain model, and ``full_tensor``,
``redistribute`` and torch's state-dict functions read it. Saving sends the
owner's matrix over the shard axis (one broadcast per matrix; each rank keeps
its rows); loading gathers the value to the owner (``full_tensor`` of a
DTensor, the rows of a full tensor). Both run on every rank, in module order,
inside ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .layout import nested_chunks
from .sharded_param import ShardedParam

__all__ = ["to_rows", "from_rows", "state_dict_hooks"]


def to_rows(sp: ShardedParam, value: DTensor) -> DTensor:
    """An owned value (its owner-mesh DTensor) as ``torch.chunk`` rows over the data-parallel mesh."""
    local = value._local_tensor
    full = local if sp.mine else local.new_empty(sp.shape)
    if sp.axis.size > 1:
        dist.broadcast(full, src=sp.owner_rank, group=sp.axis.group)
    piece = nested_chunks(sp.rows, [(sp.axis.size, sp.axis.index)])[0]
    rows = full.narrow(0, piece.start, piece.rows).clone()
    return DTensor.from_local(rows, sp.rows_mesh, sp.rows_placements, run_check=False, shape=sp.shape,
                              stride=full.stride())


def from_rows(sp: ShardedParam, value: torch.Tensor) -> DTensor:
    """A loaded value (a DTensor of any placements, or the full tensor) as the owned parameter's DTensor: the
    whole matrix on its owner, an empty piece elsewhere."""
    if isinstance(value, DTensor) and value.device_mesh == sp.mesh and tuple(value.placements) == tuple(sp.placements):
        return value  # already the owned face (``model_ops.load_full_state_dict``'s ``shard_like``)
    full = value.full_tensor() if isinstance(value, DTensor) else value
    if tuple(full.shape) != tuple(sp.shape):
        raise ValueError(f"state dict value for owned matrix {sp.fqn!r} has shape {tuple(full.shape)}; the "
                         f"parameter's is {tuple(sp.shape)}")
    local = full if sp.mine else full.reshape(-1)[:0]
    return sp.dtensor(local.detach())


def state_dict_hooks(module: torch.nn.Module, owned: dict[str, ShardedParam]) -> list:
    """On ``module``, which holds the owned parameters ``owned`` (attribute name -> its ``ShardedParam``):
    the state-dict post-hook that writes them as rows and the load pre-hook that reads rows back. The handles."""

    def save(_module, state_dict, prefix, _metadata) -> None:
        for attr, sp in owned.items():
            if prefix + attr in state_dict:
                state_dict[prefix + attr] = to_rows(sp, state_dict[prefix + attr])

    def load(_module, state_dict, prefix, *_args) -> None:
        for attr, sp in owned.items():
            if prefix + attr in state_dict:
                state_dict[prefix + attr] = from_rows(sp, state_dict[prefix + attr])

    return [module.register_state_dict_post_hook(save),
            module._register_load_state_dict_pre_hook(load, with_module=True)]
