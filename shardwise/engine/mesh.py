"""Data-parallel meshes and the sharding plan derived from mesh + placements.

The plan turns per-axis placements into the three ordered lists of axes the
engine walks: the axes the model weights are sharded over, the axes gradients
are reduce-scattered over on every micro-batch, and the axes the optimizer
state is sharded over. Shards nest in that order (parameter axes are the most
significant digits of a shard index), so every buffer's local shard contains
the finer shards below it and one collective per axis moves between them.
"""

from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from .device import device_for
from .placements import AxisPlacements

__all__ = [
    "default_fsdp2_mesh",
    "mesh_axis_names",
    "named_mesh",
    "AxisGroup",
    "ShardingPlan",
    "build_dp_mesh",
    "build_expert_mesh",
    "fold_context_parallel",
    "default_device_type",
    "check_mesh_ranks_and_group_ranks_are_consistent",
    "DENSE",
    "EXPERT",
    "LOCAL_EXPERT",
    "EXPERT_CHOICES",
    "PLAN_CHOICES",
    "experts_by_mark",
]


def default_device_type() -> str:
    """The device type of the default process group's backend (``device_for()``: ``cuda`` for NCCL,
    ``cpu`` for gloo even on a CUDA host; with no process group, ``cuda`` where CUDA is available)."""
    return device_for().type


def build_dp_mesh(
    outer: int | None = None,
    device_type: str | None = None,
    inner_axis: str = "dp_shard",
    outer_axis: str = "dp_outer",
    tp: int = 1,
    tp_axis: str = "tp",
    cp: int = 1,
    cp_axis: str = "cp",
) -> DeviceMesh:
    """A mesh over all ranks: (``dp_outer``,) ``dp_shard`` (, ``cp``) (, ``tp``).

    ``outer`` adds the hybrid-sharding outer axis; ``tp`` > 1 adds a
    tensor-parallel axis, innermost, so TP groups are consecutive ranks;
    ``cp`` > 1 adds a context-parallel axis just outside it (Megatron's
    ``tp-cp-dp`` order). ``fully_shard`` folds ``cp`` into ``dp_shard``
    (:func:`fold_context_parallel`): parameters are sharded over both.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_dp_mesh needs an initialized default process group")
    world = dist.get_world_size()
    device_type = device_type or default_device_type()
    if tp < 1 or world % tp:
        raise ValueError(f"tp={tp} must be a positive divisor of the world size {world}")
    if cp < 1 or (world // tp) % cp:
        raise ValueError(f"cp={cp} must be a positive divisor of world size / tp = {world // tp}")
    dp = world // (tp * cp)
    if outer is not None and (outer < 1 or dp % outer):
        raise ValueError(f"outer={outer} must be a positive divisor of the data-parallel size {dp}")
    shape, names = [], []
    if outer is not None:
        shape.append(outer)
        names.append(outer_axis)
    shape.append(dp // (outer or 1))
    names.append(inner_axis)
    for size, axis in ((cp, cp_axis), (tp, tp_axis)):
        if size > 1:
            shape.append(size)
            names.append(axis)
    return init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))


def default_fsdp2_mesh() -> DeviceMesh:
    """FSDP2's mesh when ``fully_shard`` is given none: every rank on one unnamed axis (the default group)."""
    if not dist.is_initialized():
        raise RuntimeError("fully_shard without a mesh needs an initialized default process group")
    return init_device_mesh(default_device_type(), (dist.get_world_size(),))


def fold_context_parallel(mesh: DeviceMesh, cp_axis: str = "cp", inner_axis: str = "dp_shard") -> DeviceMesh:
    """``mesh`` with its ``inner_axis`` and ``cp_axis`` (adjacent, ``cp`` inside) replaced by one
    flattened axis ``f"{inner_axis}_{cp_axis}"`` (Megatron's ``dp_cp`` group), other axes kept.

    CP ranks hold different tokens of the same sequences, so their gradients sum as data
    parallelism's do, and parameters shard over both at once: one collective per unit over the
    flattened group, not one per axis. A mesh without ``cp_axis`` is returned as it is.
    """
    names = list(mesh.mesh_dim_names or ())
    if cp_axis not in names:
        return mesh
    if inner_axis not in names or names.index(cp_axis) != names.index(inner_axis) + 1:
        raise ValueError(f"a mesh with a context-parallel axis {cp_axis!r} needs {inner_axis!r} just outside it "
                         f"(shardwise.build_dp_mesh(cp=...)); mesh axes are {names}")
    folded_name = f"{inner_axis}_{cp_axis}"
    folded = mesh[inner_axis, cp_axis]._flatten(folded_name)  # torch caches it by name: one group
    i = names.index(inner_axis)
    order = names[:i] + [folded_name] + names[i + 2:]
    if len(order) == 1:
        return folded
    groups = [folded.get_group() if n == folded_name else mesh.get_group(n) for n in order]
    shape = [mesh.size(names.index(n)) for n in names[:i]] + [folded.size()] + \
            [mesh.size(names.index(n)) for n in names[i + 2:]]
    return DeviceMesh.from_group(groups, mesh.device_type, mesh=mesh.mesh.reshape(shape),
                                 mesh_dim_names=tuple(order))


def mesh_axis_names(mesh: DeviceMesh) -> tuple[str, ...]:
    """The names ``fully_shard`` reads ``mesh``'s axes by: its own, else FSDP2's reading of an unnamed mesh,
    1-D ``("dp_shard",)``, 2-D ``("dp_replicate", "dp_shard")`` (replicate, then shard). The build
    (:func:`named_mesh`) and the rank-consistency check both read a mesh through it."""
    if mesh.mesh_dim_names is not None:
        return tuple(mesh.mesh_dim_names)
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: an unnamed mesh must be 1-D "
                         f"(FSDP) or 2-D (HSDP), this one is {mesh.ndim}-D; name its axes (mesh_dim_names) to say "
                         "which are data-parallel")
    return ("dp_shard",) if mesh.ndim == 1 else ("dp_replicate", "dp_shard")


def named_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` itself when its axes have names, else the same process groups under the names
    :func:`mesh_axis_names` reads them by."""
    if mesh.mesh_dim_names is not None:
        return mesh
    names = mesh_axis_names(mesh)
    groups = [mesh.get_group(i) for i in range(mesh.ndim)]
    return DeviceMesh.from_group(groups if mesh.ndim > 1 else groups[0], mesh.device_type, mesh=mesh.mesh,
                                 mesh_dim_names=names)


def build_expert_mesh(ep: int, device_type: str | None = None, inner_axis: str = "dp_shard", ep_axis: str = "ep") -> DeviceMesh:
    """The (``dp_shard``, ``ep``) mesh for expert parameters: EP groups are consecutive ranks,
    and experts are sharded over the ranks holding the same experts.

    Megatron-Core's expert order ``[expert-dp, ep, etp]`` with expert TP 1, so next to
    ``build_dp_mesh(tp=...)`` (TP groups consecutive too) it is the layout of TP with EP:
    with ``ep == tp`` each EP group is a TP group."""
    if not dist.is_initialized():
        raise RuntimeError("build_expert_mesh needs an initialized default process group")
    world = dist.get_world_size()
    if ep < 1 or world % ep:
        raise ValueError(f"ep={ep} must be a positive divisor of the world size {world}")
    return init_device_mesh(device_type or default_device_type(), (world // ep, ep), mesh_dim_names=(inner_axis, ep_axis))


def check_mesh_ranks_and_group_ranks_are_consistent(
    mesh_ranks: Sequence[int], group_ranks: Sequence[int]
) -> None:
    """Raise unless a mesh axis spans exactly the ranks of the process group meant for it."""
    if sorted(mesh_ranks) != sorted(group_ranks) or list(mesh_ranks) != list(group_ranks):
        raise ValueError(
            f"mesh ranks {list(mesh_ranks)} do not match process group ranks {list(group_ranks)}"
        )


@dataclass(frozen=True)
class AxisGroup:
    """One data-parallel mesh axis as this rank sees it."""

    name: str
    group: dist.ProcessGroup
    size: int
    index: int  # this rank's coordinate on the axis
    averages_natively: bool  # NCCL has ReduceOp.AVG; gloo sums and we divide
    # FSDP2's HSDP (``hsdp_division``): on the shard axis, the size of the replicas whose all-reduce follows its
    # reduce-scatter; on a replica axis, the shard axis's size. A 16-bit mean splits its division over both.
    replicas: int = 1
    scattered_over: int = 0


def hsdp_division(axes: dict[str, AxisGroup], placements: Mapping[str, AxisPlacements]) -> dict[str, AxisGroup]:
    """FSDP2's HSDP (one axis shards gradients and optimizer state, the others hold Partial gradients and a
    replicated optimizer): a gradient's mean is over all of them at once, so a 16-bit reduction divides by
    FSDP2's split of the whole product (``_get_gradient_divide_factors``: before the reduce-scatter, and after
    the replicas' all-reduce), not once per axis. The axes, marked for the collectives where that applies."""
    shard = [n for n, p in placements.items() if isinstance(p.gradient, Shard) and isinstance(p.optimizer, Shard)]
    replicas = [n for n, p in placements.items() if isinstance(p.gradient, Partial) and isinstance(p.optimizer,
                                                                                                   Replicate)]
    if len(shard) != 1 or len(shard) + len(replicas) != len(placements) or not replicas:
        return axes
    size = math.prod(axes[n].size for n in replicas)
    marked = dict(axes)
    marked[shard[0]] = dataclasses.replace(axes[shard[0]], replicas=size)
    for n in replicas:
        marked[n] = dataclasses.replace(axes[n], scattered_over=axes[shard[0]].size)
    return marked


class ShardingPlan:
    """Which axes shard which buffer, for one mesh and one set of placements."""

    def __init__(
        self,
        mesh: DeviceMesh,
        placements: Mapping[str, AxisPlacements],
        model_parallel_axes: Sequence[str] = (),
        grad_scale: float = 1.0,
        face_mesh: DeviceMesh | None = None,
    ):
        names = mesh.mesh_dim_names
        if names is None:
            raise ValueError("mesh must have mesh_dim_names so placements can name its axes")
        for axis in placements:
            if axis not in names:
                raise ValueError(
                    f"placements names mesh axis {axis!r}, which the mesh does not have; "
                    f"mesh axes are {list(names)}"
                )
        extra = [n for n in names if n not in placements and n not in model_parallel_axes]
        if extra:
            raise ValueError(
                f"mesh axes {extra} are neither data-parallel (named in placements: "
                f"{list(placements)}) nor model-parallel (tp_axis/ep_axis: {list(model_parallel_axes)})"
            )
        self.mesh = mesh
        self.mesh_axes = list(names)
        self.model_parallel = {
            n: AxisGroup(n, mesh.get_group(n), mesh.size(i), mesh.get_local_rank(n), False)
            for i, n in enumerate(names)
            if n in model_parallel_axes
        }
        self.grad_scale = grad_scale
        self.placements = {n: placements[n] for n in names if n in placements}  # mesh order
        self.axes = {  # data-parallel axes only
            n: AxisGroup(
                n,
                mesh.get_group(n),
                mesh.size(i),
                mesh.get_local_rank(n),
                dist.get_backend(mesh.get_group(n)) == "nccl",
            )
            for i, n in enumerate(names)
            if n in placements
        }

        self.axes = hsdp_division(self.axes, self.placements)

        def sharded(kind: str) -> list[AxisGroup]:
            return [self.axes[n] for n, p in self.placements.items() if isinstance(getattr(p, kind), Shard)]

        param_axes = sharded("parameter")
        grad_axes = param_axes + [a for a in sharded("gradient") if a not in param_axes]
        opt_axes = grad_axes + [a for a in sharded("optimizer") if a not in grad_axes]
        self.param_axes: list[AxisGroup] = param_axes
        self.grad_axes: list[AxisGroup] = grad_axes
        self.opt_axes: list[AxisGroup] = opt_axes
        # Axes all-reduced when a step's gradients are finalized (Partial gradients, Replicate optimizer).
        self.finalize_allreduce_axes = [
            self.axes[n] for n, p in self.placements.items()
            if isinstance(p.gradient, Partial) and isinstance(p.optimizer, Replicate)
        ]
        self.opt_axis_names = [a.name for a in opt_axes]
        # The user's unnamed mesh (FSDP2's default one when none was given), ``mesh`` being it with FSDP2's
        # reading as names: the DTensors' mesh where the axes keep their order, so they compare equal to FSDP2's.
        self.face_mesh = face_mesh
        self._dt_mesh: DeviceMesh | None = None
        self._local_meshes: dict[frozenset, DeviceMesh] = {}
        self.dp_size = math.prod(a.size for a in self.axes.values())

    def dtensor_spec(
        self, model_parallel_dims: Mapping[str, int] = {}, local_axes: Sequence[str] = (), shard_dim: int = 0
    ) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """The mesh and placements of a parameter's DTensors (its optimizer placement).

        DTensor applies ``Shard`` placements left to right, each one splitting
        what the previous left. Our pieces are model-parallel slices first, then
        ``torch.chunk`` over the optimizer axes in their nesting order, so the
        DTensor's mesh lists its axes in that order: model-parallel, replicated,
        then sharded data-parallel axes. It is the given mesh when that is its
        order already, else the same process groups in the new order.
        ``local_axes`` are model-parallel axes over which each rank holds a tensor
        of its own (not a slice of one global tensor): they are left out of the
        mesh, which then spans only the ranks that share this rank's tensor.
        ``shard_dim`` is the dim the data-parallel axes split (``shard_placement_fn``'s
        ``Shard(d)``; dim 0 otherwise).
        """
        mesh = self._dtensor_mesh(frozenset(local_axes))
        out = []
        for name in (self.mesh_axes if mesh is self.face_mesh else mesh.mesh_dim_names):
            if name in model_parallel_dims:
                out.append(Shard(model_parallel_dims[name]))
            elif name in self.opt_axis_names:
                out.append(Shard(shard_dim))
            else:
                out.append(Replicate())
        return mesh, tuple(out)

    def _dtensor_mesh(self, without: frozenset = frozenset()) -> DeviceMesh:
        if without:
            return self._local_mesh(without)
        if self._dt_mesh is None:
            names = list(self.mesh_axes)
            sharded = set(self.opt_axis_names)
            order = [n for n in names if n not in sharded] + self.opt_axis_names
            trivial = {n for n in names if self.mesh.size(names.index(n)) == 1}
            if [n for n in order if n not in trivial] == [n for n in names if n not in trivial]:
                # A size-1 axis splits nothing, so its position is free; keeping the given mesh also
                # avoids torch 2.11's failure to slice a regrouped mesh with a size-1 axis in it.
                self._dt_mesh = self.face_mesh if self.face_mesh is not None else self.mesh
            else:
                perm = [names.index(n) for n in order]
                self._dt_mesh = DeviceMesh.from_group(
                    [self.mesh.get_group(n) for n in order],
                    self.mesh.device_type,
                    mesh=self.mesh.mesh.permute(perm).contiguous(),
                    mesh_dim_names=tuple(order),
                )
        return self._dt_mesh

    def _local_mesh(self, without: frozenset) -> DeviceMesh:
        """The DTensor mesh without the axes in ``without``: this rank's row of the mesh across them (the
        same process groups as the full mesh's other axes), its axes in the DTensor order."""
        unknown = sorted(without - set(self.model_parallel))
        if unknown:
            raise ValueError(f"local axes {unknown} are not model-parallel axes of this mesh ({list(self.model_parallel)})")
        mesh = self._local_meshes.get(without)
        if mesh is None:
            names = list(self.mesh_axes)
            table, coordinate = self.mesh.mesh, self.mesh.get_coordinate()
            for i in reversed(range(len(names))):
                if names[i] in without:
                    table = table.select(i, coordinate[i])
            kept = [n for n in names if n not in without]
            sharded = set(self.opt_axis_names)
            order = [n for n in kept if n not in sharded] + [n for n in self.opt_axis_names if n in kept]
            table = table.permute([kept.index(n) for n in order]).contiguous()
            groups = [self.mesh.get_group(n) for n in order]
            mesh = self._local_meshes[without] = DeviceMesh.from_group(
                groups if len(groups) > 1 else groups[0], self.mesh.device_type, mesh=table,
                mesh_dim_names=tuple(order),
            )
        return mesh

    def global_shape(self, local: torch.Size, model_parallel_dims: Mapping[str, int]) -> torch.Size:
        shape = list(local)
        for name, dim in model_parallel_dims.items():
            shape[dim] *= self.model_parallel[name].size
        return torch.Size(shape)


# --------------------------------------------- which plan a parameter is sharded by
DENSE = "dense"
"""``plan_fn``'s answer for a parameter sharded over ``fully_shard``'s ``mesh``."""
EXPERT = "expert"
"""``plan_fn``'s answer for a parameter sharded over ``fully_shard``'s ``expert_mesh``: one EP rank's slice of
the experts stacked along dim 0 (its DTensor's global tensor holds every EP rank's experts)."""
LOCAL_EXPERT = "local_expert"
"""``plan_fn``'s answer for an expert parameter sharded over ``fully_shard``'s ``expert_mesh`` that is this EP
rank's own tensor, not a slice of a stacked one (Megatron-Core's ``local_experts.<i>``: a different expert on
each EP rank): its DTensors leave the ``ep_axis`` out of their mesh, so each is that one tensor sharded over
the expert-data-parallel ranks, as Megatron-FSDP hands out its experts."""
EXPERT_CHOICES = (EXPERT, LOCAL_EXPERT)
PLAN_CHOICES = (DENSE, EXPERT, LOCAL_EXPERT)


def experts_by_mark(fqn: str, param: torch.Tensor) -> str:
    """``fully_shard``'s default ``plan_fn``: :data:`EXPERT` for a parameter marked ``allreduce=False``.

    That is Megatron's mark for expert weights (their gradients are reduced over
    the expert-data-parallel ranks only), which shardwise's models set on their
    experts too; the name plays no part. Everything else is :data:`DENSE`.
    """
    return EXPERT if getattr(param, "allreduce", True) is False else DENSE
