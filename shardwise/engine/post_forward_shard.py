"""``reshard_after_forward=k`` (an int): after forward a unit keeps its weights sharded over ``k`` ranks.

FSDP2's meaning: ``k`` is a non-trivial divisor of the shard dim's size ``S``; the data-parallel ranks are cut
into groups of ``k`` consecutive ones (the data-parallel mesh viewed as ``(-1, k)``: inside one replica under
HSDP), and between forward and backward each rank keeps the ``1/k`` of the unit's gathered weights that is
its part in its group. Backward then all-gathers over those ``k`` ranks only (a smaller, e.g. intra-node,
collective) instead of over all ``S``; memory between the two is ``1/k`` of the unit's weights, not ``1/S``.

In the engine's layout the gathered weights of a parameter are ``S`` slots of its level-1 pieces, padding at
the end only, so its gathered region cut into ``k`` equal runs of ``S / k`` slots is exactly what a gather of
those runs over the ``k``-rank group rebuilds: the smaller group is a sub-axis of the shard axis, the kept
part a slot of that sub-axis, and the regather writes straight into the gathered slots (no copy-out).

Between forward and backward the modules hold FSDP2's post-forward parameters: DTensors on the ``(S x R / k,
k)`` mesh, ``(Replicate(), Shard(0))``, each viewing this rank's kept rows, where ``torch.chunk`` over ``k``
gives those rows (always when the rows divide by ``S``); a parameter whose kept run is not that chunk (uneven
rows) shows its sharded parameter instead, so no DTensor handed out lies about its rows.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .distributed_buffer import BufferState
from .layout import chunk_size
from .mesh import AxisGroup, ShardingPlan
from .param_group import ModuleParams, ParamGroup, WeightState

__all__ = ["PostForwardShard", "resolve_reshard_after_forward", "is_group_size"]



def is_group_size(value) -> bool:
    """An int ``reshard_after_forward`` (``True`` / ``False`` are ints to Python, not group sizes)."""
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_reshard_after_forward(value, plan: ShardingPlan, expert_plan: ShardingPlan | None = None):
    """``value`` with FSDP2's reading of an int: a divisor of the shard size ``S`` (else refused), ``1`` is
    ``False`` (with FSDP2's warning), ``S`` is ``True``; other values pass unchanged. An int needs FSDP2's
    meshes (one sharded data-parallel axis, the mesh's last, no model-parallel axis): others are refused."""
    if not is_group_size(value):
        return value
    shard = plan.param_axes[-1] if plan.param_axes else None
    size = shard.size if shard is not None else 1
    if value < 1 or value > size or size % value:
        raise ValueError(f"reshard_after_forward={value} (an int: the number of ranks to reshard to after forward) "
                         f"must be a divisor of the shard mesh dim's size {size}")
    if value == 1:
        warnings.warn("reshard_after_forward=1 (int) means resharding parameters to world size 1, instead of "
                      "reshard_after_forward=True (bool): taken as False, as FSDP2 does", stacklevel=3)
        return False
    if value == size:
        return True
    names = list(plan.mesh_axes)
    if plan.model_parallel or expert_plan is not None or len(plan.param_axes) != 1 or shard.name != names[-1]:
        raise NotImplementedError(
            f"reshard_after_forward={value} (an int) is built for FSDP2's meshes: parameters sharded over one "
            f"data-parallel axis, the mesh's last, with no model-parallel axis; this mesh has axes {names} and "
            f"shards parameters over {[a.name for a in plan.param_axes]}"
            + (" (and an expert mesh)" if expert_plan is not None else ""))
    return value


def _post_forward_mesh(plan: ShardingPlan, k: int) -> DeviceMesh:
    """FSDP2's post-forward mesh: the data-parallel ranks viewed as ``(-1, k)`` (made on every rank, once per
    mesh: kept on the plan's mesh object, so a new world, whose meshes are new objects, never meets the groups
    of one that was destroyed)."""
    made = plan.mesh.__dict__.setdefault("_shardwise_post_forward_meshes", {})
    if k not in made:
        made[k] = DeviceMesh(plan.mesh.device_type, plan.mesh.mesh.reshape(-1, k))
    return made[k]


class PostForwardShard:
    """One unit's post-forward shard: :meth:`keep` at forward's end, :meth:`restore` before the next use."""

    def __init__(self, groups: list[ParamGroup], plan: ShardingPlan, k: int):
        self.groups = list(groups)
        self.k = k
        self.mesh = _post_forward_mesh(plan, k)
        group = self.mesh.get_group(1)
        self.axis = AxisGroup(f"{plan.param_axes[0].name}/{k}", group, k, dist.get_rank(group),
                              dist.get_backend(group) == "nccl")
        self._kept: list[tuple[ParamGroup, torch.Tensor, list]] | None = None  # (group, kept flat, params)

    @property
    def holds(self) -> bool:
        return self._kept is not None

    def kept_bytes(self) -> int:
        return sum(flat.numel() * flat.element_size() for _, flat, _ in self._kept or ())

    # --------------------------------------------------------------- regions
    def _regions(self, group: ParamGroup, unsharded: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Each parameter's gathered region of the unsharded slots (those with rows on the shard axis)."""
        views = group.layouts[0].views(unsharded)
        return [(i, views[i][: p.gathered_numel(1)]) for i, p in enumerate(group.params) if p.piece_numel(1)]

    def keep(self) -> None:
        """Forward's end: keep this rank's ``1/k`` of each group's gathered weights, free the rest, and point
        the modules at the post-forward parameters."""
        kept = []
        for group in self.groups:
            if group.persistent_unsharded or group.weight_state is not WeightState.UNSHARDED:
                group.reshard()  # nothing gathered to keep a part of
                continue
            if group.extensions is not None:  # the hooks' outputs are theirs to cut: resharded fully (FSDP2 refuses)
                group.reshard()
                continue
            regions = self._regions(group, group.unsharded)
            parts = [region.view(self.k, -1)[self.axis.index] for _, region in regions]
            flat = group.levels.new(sum(p.numel() for p in parts), group.unsharded.dtype)
            pieces = list(flat.split([p.numel() for p in parts])) if parts else []
            if parts:
                torch._foreach_copy_(pieces, parts)
            group.reshard()  # frees the gathered storage, the sharded parameters back in
            params = [self._post_forward_param(group, i, piece) for (i, _), piece in zip(regions, pieces)]
            kept.append((group, flat, pieces))
            self._register(group, [i for i, _ in regions], params)
        self._kept = kept

    def _post_forward_param(self, group: ParamGroup, i: int, piece: torch.Tensor) -> nn.Parameter:
        """Parameter ``i``'s post-forward face over ``piece`` (its kept run): FSDP2's DTensor where the run
        is ``torch.chunk``'s piece, else the sharded parameter."""
        sharded = group.params[i]
        rows, row = sharded.rows, sharded.row_numel
        run_rows = piece.numel() // max(row, 1)
        start = self.axis.index * run_rows
        chunk = chunk_size(rows, self.k)
        real = max(0, min(rows, start + run_rows) - start)
        if row == 0 or start != self.axis.index * chunk or real != max(0, min(rows, start + chunk) - start):
            return group.sharded_params[i]
        local = piece[: real * row].view((real,) + tuple(sharded.shape[1:]))
        meta = TensorMeta(sharded.global_shape, torch.empty(sharded.global_shape, device="meta").stride(), local.dtype)
        spec = DTensorSpec(self.mesh, (Replicate(), Shard(0)), tensor_meta=meta)
        return nn.Parameter(DTensor(local, spec, requires_grad=False), requires_grad=group.requires_grad)

    def _register(self, group: ParamGroup, indices: list[int], params: list[nn.Parameter]) -> None:
        for i, param in zip(indices, params):
            for module, attr in group.refs[i].holders:
                module._parameters[attr] = param
        group.module_params = ModuleParams.POST_FORWARD

    # --------------------------------------------------------------- back to gathered, or dropped
    def restore(self) -> None:
        """Gather the kept parts over the ``k`` ranks back into each group's unsharded slots (backward, or a
        forward before any backward), one collective per group; the modules get the unsharded parameters."""
        kept, self._kept = self._kept, None
        for group, _flat, pieces in kept or ():
            buffer = group.unsharded_buffer
            buffer.alloc()
            regions = self._regions(group, buffer.flat)
            with torch.autograd._unsafe_preserve_version_counter(buffer.flat):  # forward saved these weights
                group.levels.collectives.gather([r for _, r in regions], pieces, self.axis)
            buffer.state = BufferState.HOLDS
            group.weight_state = WeightState.UNSHARDED
            group.use_unsharded()

    def drop(self) -> None:
        """Forget the kept parts (a full reshard); the modules get the sharded parameters back."""
        kept, self._kept = self._kept, None
        for group, _, _ in kept or ():
            group.use_sharded()
