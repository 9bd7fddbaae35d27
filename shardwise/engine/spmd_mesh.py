"""``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)``: FSDP2's full SPMD mesh, read onto the engine's mesh.

With ``dp_mesh_dims`` (torch's ``DataParallelMeshDims(shard=..., replicate=...)``, or any object with
``.shard`` / ``.replicate``), ``mesh`` is the whole SPMD mesh (data-parallel dims, TP, ...) and every
parameter is already a DTensor on it, ``Replicate()`` on the data-parallel dims (``distribute_module``,
torchtitan's SPMD backends). The engine already shards TP slices over a mesh with a model-parallel axis,
so this module only translates:

- the mesh: the ``shard`` dims (several are flattened into one, as FSDP2 does) become the engine's sharded
  axis, the ``replicate`` dims its HSDP replicate axis, the one other dim of more than one rank its
  model-parallel axis (``tp_axis``); the same process groups (flattened ones are torch's, cached by name);
- the parameters: each DTensor is taken as its local tensor, marked as a TP slice along the dim its
  ``Shard`` placement names, and remembers its spec (:class:`SpmdParam`), so that
  - the gathered parameters forward reads are DTensors with that spec again (the model's DTensor code runs);
  - their gradients are made local the way FSDP2 does (``Partial`` on non-data-parallel dims redistributed to
    the parameter's placement first, data-parallel dims left to the engine's reduction);
  - the sharded parameters, gradients and optimizer state are DTensors with FSDP2's spec: the SPMD mesh
    (data-parallel shard dims flattened into one where there are several), ``Shard(d)`` on the shard dim (``d``
    from ``shard_placement_fn``, 0 by default; ``_StridedShard(d, split_factor)`` where a later dim also splits
    dim ``d``: the same local rows as the engine's chunk of the TP slice), the parameter's own placements
    elsewhere.

``tp_submesh.py`` uses the same reading for FSDP2's 2-D recipe, parameters DTensors on a TP submesh and
``fully_shard(mesh=<the DP submesh>)``: the SPMD mesh is the two concatenated and ``param_mesh`` the TP
submesh (the parameters' placements there, ``Replicate()`` on the DP dims); plain parameters beside them are
sharded over the DP mesh alone (``dp_mesh``), as FSDP2 shards them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from .placements import OUTER_STRATEGY_PLACEMENTS, STRATEGY_PLACEMENTS, AxisPlacements

__all__ = ["SPMD_PARAM_ATTR", "SpmdMesh", "SpmdParam", "read_spmd_mesh", "spmd_param_of"]

SPMD_PARAM_ATTR = "_shardwise_spmd"  # on the local parameter taken from a DTensor: its SpmdParam


def _names(value, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"dp_mesh_dims.{field}={value!r} must be a mesh dim name, a tuple of them or None")


def _flattened(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """One 1-D mesh over ``names`` (itself for one name; torch's flattened dim, cached by name, for several)."""
    return mesh[names[0]] if len(names) == 1 else mesh[names]._flatten("_".join(names))


@dataclass(frozen=True)
class SpmdParam:
    """One parameter's DTensor faces under an SPMD mesh: ``compute`` (the spec it came with: forward's gathered
    parameter; ``None`` for a plain tensor beside TP DTensors, read as it is) and the sharded one (FSDP2's spec of
    the sharded parameter, its gradient and optimizer state: :meth:`sharded_face`)."""

    compute: DTensorSpec | None
    spmd: "SpmdMesh"
    placements: tuple[Placement, ...]  # the parameter's own, per dim of ``spmd.mesh``
    data_parallel_dims: frozenset[int]  # indices into ``compute.mesh``
    # ``shard_placement_fn``'s answer for the parameter as the model gave it (FSDP2 asks with the DTensor itself,
    # which the engine replaces by its local tensor; a function may test placements or identity)
    shard_placement: Any = None

    def global_shape(self, local: torch.Size) -> torch.Size:
        """The parameter's global shape (a TP split may be uneven): its DTensor's, or a plain tensor's own."""
        return torch.Size(local) if self.compute is None else self.compute.shape

    def sharded_face(self, shard_dim: int) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """FSDP2's mesh and placements of the sharded parameter, split along ``shard_dim`` over the data-parallel
        dims: the SPMD mesh's face, or a plain tensor's data-parallel mesh."""
        if self.compute is None:
            return self.spmd.data_parallel_face(shard_dim)
        return self.spmd.face_mesh(), self.spmd.sharded_placements(self.placements, shard_dim)

    def compute_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (the gathered TP-local parameter) as the DTensor the model was written for."""
        if self.compute is None:
            return local
        meta = self.compute.tensor_meta
        spec = DTensorSpec(self.compute.mesh, self.compute.placements,
                           tensor_meta=TensorMeta(meta.shape, meta.stride, local.dtype))
        return DTensor(local, spec, requires_grad=False)

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The gradient of the gathered parameter as the local tensor the engine reduces: FSDP2's reading,
        ``Partial`` left on data-parallel dims (the engine reduces over them), elsewhere redistributed to the
        parameter's placement (a TP-replicated weight's partial sums over ``tp`` added up)."""
        if not isinstance(grad, DTensor):
            return grad
        target = tuple(g if i in self.data_parallel_dims else p
                       for i, (g, p) in enumerate(zip(grad.placements, self.compute.placements)))
        if target != tuple(grad.placements):
            grad = grad.redistribute(placements=target)
        return grad._local_tensor


def spmd_param_of(param: torch.Tensor) -> SpmdParam | None:
    return getattr(param, SPMD_PARAM_ATTR, None)


class SpmdMesh:
    """The engine's reading of ``(mesh, dp_mesh_dims)``: ``engine_mesh`` / ``placements`` / ``tp_axis`` for
    ``fully_shard``'s plan, and :meth:`take_parameters` for the module's DTensor parameters."""

    def __init__(self, mesh: DeviceMesh, shard: tuple[str, ...], replicate: tuple[str, ...],
                 param_mesh: DeviceMesh | None = None, dp_mesh: DeviceMesh | None = None):
        names = list(mesh.mesh_dim_names)
        self.mesh, self.shard, self.replicate = mesh, shard, replicate
        # The mesh the parameters come on: ``mesh`` itself, or (``tp_submesh.py``) its non-data-parallel dims
        # alone, a TP submesh, where they are DTensors before ``fully_shard`` sees the data-parallel mesh
        # (``dp_mesh``: the plain tensors beside them are sharded over it alone, as FSDP2 shards them).
        self.param_mesh = mesh if param_mesh is None else param_mesh
        self.dp_mesh = dp_mesh
        data = set(shard) | set(replicate)
        others = [n for n in names if n not in data and mesh.size(names.index(n)) > 1]
        if len(others) > 1:
            raise NotImplementedError(
                f"fully_shard(dp_mesh_dims=...): the SPMD mesh {names} has {len(others)} non-data-parallel dims of "
                f"more than one rank ({others}); shardwise shards over one model-parallel dim (tensor parallelism) "
                "beside the data-parallel ones")
        for group in (shard, replicate):
            positions = [names.index(n) for n in group]
            if len(positions) > 1 and positions != list(range(positions[0], positions[0] + len(positions))):
                raise ValueError(f"dp_mesh_dims names {list(group)}, which are not adjacent in mesh order {names}: "
                                 "the dims flattened into one must be consecutive, outer first")
        self.tp_axis = others[0] if others else None
        engine_axes: list[tuple[str, DeviceMesh, AxisPlacements | None]] = []
        if replicate:
            engine_axes.append(("_".join(replicate), _flattened(mesh, replicate), OUTER_STRATEGY_PLACEMENTS["no_shard"]))
        if shard:
            engine_axes.append(("_".join(shard), _flattened(mesh, shard), STRATEGY_PLACEMENTS["optim_grads_params"]))
        if self.tp_axis is not None:
            engine_axes.append((self.tp_axis, mesh[self.tp_axis], None))
        self.placements = {name: p for name, _, p in engine_axes if p is not None}
        self._replicate_mesh = engine_axes[0][1] if replicate else None
        self._shard_mesh = engine_axes[1 if replicate else 0][1] if shard else None
        # The engine's mesh: the same ranks, dims in the order (replicate, shard, tp) over the same groups.
        order = [names.index(n) for n in replicate + shard] + \
                [i for i, n in enumerate(names) if n not in data]
        table = mesh.mesh.permute(order).reshape([m.size() for _, m, _ in engine_axes])
        groups = [m.get_group() for _, m, _ in engine_axes]
        self.engine_mesh = DeviceMesh.from_group(
            groups if len(groups) > 1 else groups[0], mesh.device_type, mesh=table,
            mesh_dim_names=tuple(name for name, _, _ in engine_axes))
        self._sharded_mesh: DeviceMesh | None = None

    # ------------------------------------------------------------------ the sharded DTensor face
    def face_mesh(self) -> DeviceMesh:
        """FSDP2's mesh of the sharded parameters: the SPMD mesh itself with one shard dim; with several, the
        mesh with them flattened into one dim (and, under HSDP, the replicate dims moved just before it)."""
        if len(self.shard) <= 1:
            return self.mesh
        if self._sharded_mesh is None:
            names = list(self.mesh.mesh_dim_names)
            hsdp = bool(self.replicate)
            first = names.index(self.shard[0])
            kept_before = [n for n in names[:first] if not (hsdp and n in self.replicate)]
            kept_after = [n for n in names[first + len(self.shard):] if not (hsdp and n in self.replicate)]
            merged = (list(self.replicate) if hsdp else []) + list(self.shard)
            order = kept_before + merged + kept_after
            shape = [self.mesh.size(names.index(n)) for n in kept_before]
            shape += ([self._replicate_mesh.size()] if hsdp else []) + [self._shard_mesh.size()]
            shape += [self.mesh.size(names.index(n)) for n in kept_after]
            table = self.mesh.mesh.permute([names.index(n) for n in order]).reshape(shape)
            face_names = kept_before + (["_".join(self.replicate)] if hsdp else []) + ["_".join(self.shard)] + kept_after
            groups = [self.mesh.get_group(n) for n in kept_before]
            groups += ([self._replicate_mesh.get_group()] if hsdp else []) + [self._shard_mesh.get_group()]
            groups += [self.mesh.get_group(n) for n in kept_after]
            self._sharded_mesh = DeviceMesh.from_group(groups, self.mesh.device_type, mesh=table,
                                                       mesh_dim_names=tuple(face_names))
        return self._sharded_mesh

    def data_parallel_face(self, shard_dim: int) -> tuple[DeviceMesh, tuple[Placement, ...]]:
        """FSDP2's face of a plain tensor beside TP DTensors: the data-parallel mesh, ``Shard(shard_dim)`` on its
        shard dim (``Replicate()`` before it under HSDP)."""
        return self.dp_mesh, (Replicate(),) * (self.dp_mesh.ndim - 1) + (Shard(shard_dim),)

    def sharded_placements(self, placements: tuple[Placement, ...], shard_dim: int = 0) -> tuple[Placement, ...]:
        """FSDP2's placements of the sharded parameter, from the parameter's own (``placements``, per SPMD dim),
        split along ``shard_dim`` over the shard dims."""
        names = list(self.mesh.mesh_dim_names)
        out = list(placements)
        for name in self.shard:
            i = names.index(name)
            later = [self.mesh.size(j) for j in range(i + 1, len(names))
                     if isinstance(placements[j], (Shard, _StridedShard)) and placements[j].dim == shard_dim]
            split = math.prod(later)
            out[i] = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
        if len(self.shard) <= 1:
            return tuple(out)
        first = names.index(self.shard[0])
        hsdp = bool(self.replicate)
        face = []
        for i, name in enumerate(names):
            if name in self.shard[1:] or (hsdp and name in self.replicate):
                continue
            if i == first:
                face += ([Replicate()] if hsdp else []) + [out[i]]
            else:
                face.append(out[i])
        return tuple(face)

    # ------------------------------------------------------------------ the parameters
    def take_parameters(self, modules: list[nn.Module], skip: set[int],
                        shard_placement_fn: Callable | None = None) -> None:
        """Replace each DTensor parameter of ``modules`` (but those in ``skip``: sharded by an earlier call, or
        ignored) by its local tensor, marked as a TP slice where it is one, carrying its :class:`SpmdParam` (with
        ``shard_placement_fn``'s answer for the parameter as given).
        Refuses, by name, a plain tensor, a DTensor on another mesh, and placements FSDP2 refuses too."""
        names = list(self.mesh.mesh_dim_names)
        data_dims = frozenset(names.index(n) for n in self.shard + self.replicate)
        taken: dict[int, nn.Parameter] = {}
        for root in modules:
            for fqn, p in root.named_parameters(remove_duplicate=True):
                if id(p) in skip or id(p) in taken:
                    continue
                answer = None if shard_placement_fn is None else shard_placement_fn(p)
                taken[id(p)] = self._take(fqn, p, data_dims, answer)
        for root in modules:
            for module in root.modules():
                for attr, p in list(module._parameters.items()):
                    if p is not None and id(p) in taken:
                        module._parameters[attr] = taken[id(p)]

    def _take(self, fqn: str, p: nn.Parameter, data_dims: frozenset[int], answer=None) -> nn.Parameter:
        names = list(self.mesh.mesh_dim_names)
        if not isinstance(p, DTensor) and self.dp_mesh is not None:  # beside TP DTensors: sharded over DP alone
            setattr(p, SPMD_PARAM_ATTR, SpmdParam(None, self, (), frozenset(), answer))
            return p
        if not isinstance(p, DTensor):
            raise ValueError(f"fully_shard(dp_mesh_dims=...): parameter {fqn!r} is a plain tensor; with dp_mesh_dims "
                             "every parameter must be a DTensor on the full SPMD mesh (e.g. via distribute_module)")
        if p.device_mesh != self.param_mesh:
            raise ValueError(f"fully_shard: parameter {fqn!r} is a DTensor on mesh {p.device_mesh}, not on "
                             f"{self.param_mesh} (the mesh passed to fully_shard with dp_mesh_dims, or the "
                             "tensor-parallel mesh of the call's other DTensor parameters)")
        placements = self._spmd_placements(p)
        for i in data_dims:
            if not isinstance(placements[i], Replicate):
                raise ValueError(f"fully_shard(dp_mesh_dims=...): parameter {fqn!r} has {placements[i]} on the "
                                 f"data-parallel dim {names[i]!r}; it must be Replicate() there")
        local = nn.Parameter(p.to_local(), requires_grad=p.requires_grad)
        for i, placement in enumerate(placements):
            if i in data_dims or self.mesh.size(i) == 1 or isinstance(placement, Replicate):
                continue
            if isinstance(placement, Partial) or type(placement) is not Shard:
                raise NotImplementedError(
                    f"fully_shard: parameter {fqn!r} has {placement} on mesh dim {names[i]!r}; shardwise takes "
                    "Replicate() or Shard(d) there")
            local.tensor_model_parallel = True
            local.partition_dim = placement.dim
        # the data-parallel dims of the parameter's own mesh (none on a TP submesh): its gradient keeps them
        own_data_dims = data_dims if self.param_mesh is self.mesh else frozenset()
        setattr(local, SPMD_PARAM_ATTR, SpmdParam(p._spec, self, placements, own_data_dims, answer))
        for key, value in vars(p).items():  # the model's own annotations
            if not key.startswith("_"):
                setattr(local, key, value)
        return local

    def _spmd_placements(self, p: DTensor) -> tuple[Placement, ...]:
        """``p``'s placements per dim of the SPMD mesh: its own, or on a TP submesh those of its dims with
        ``Replicate()`` on the others (the data-parallel ones)."""
        if self.param_mesh is self.mesh:
            return tuple(p.placements)
        own = dict(zip(self.param_mesh.mesh_dim_names, p.placements))
        return tuple(own.get(name, Replicate()) for name in self.mesh.mesh_dim_names)


def read_spmd_mesh(mesh: DeviceMesh | None, dp_mesh_dims, reshard_after_forward, **mesh_options) -> SpmdMesh:
    """``(mesh, dp_mesh_dims)`` checked with FSDP2's rules and read as an :class:`SpmdMesh`; ``mesh_options``
    are shardwise's own mesh arguments, which ``dp_mesh_dims`` replaces (refused when given)."""
    given = [name for name, value in mesh_options.items() if value is not None]
    if given:
        raise ValueError(f"fully_shard(dp_mesh_dims=...) takes FSDP2's meaning of the SPMD mesh (ZeRO-3 over the "
                         f"shard dims, HSDP over the replicate dims); do not pass {', '.join(given)} with it")
    if not (hasattr(dp_mesh_dims, "shard") and hasattr(dp_mesh_dims, "replicate")):
        raise TypeError(f"dp_mesh_dims={dp_mesh_dims!r} must be a torch.distributed.fsdp.DataParallelMeshDims "
                        "(an object with .shard and .replicate)")
    shard, replicate = _names(dp_mesh_dims.shard, "shard"), _names(dp_mesh_dims.replicate, "replicate")
    if not shard and not replicate:
        raise ValueError(f"dp_mesh_dims={dp_mesh_dims!r}: at least one of shard or replicate must be set")
    if mesh is None or not isinstance(mesh, DeviceMesh):
        raise ValueError(f"fully_shard(dp_mesh_dims=...) needs mesh= the full SPMD DeviceMesh, got {mesh!r}")
    if mesh.mesh_dim_names is None:
        raise ValueError("fully_shard(dp_mesh_dims=...): the mesh must have mesh_dim_names")
    for name in shard + replicate:
        if name not in mesh.mesh_dim_names:
            raise ValueError(f"dp_mesh_dims names mesh dim {name!r}, which is not in mesh.mesh_dim_names "
                             f"{mesh.mesh_dim_names}")
    if set(shard) & set(replicate):
        raise ValueError(f"dp_mesh_dims names {sorted(set(shard) & set(replicate))} as both shard and replicate")
    if shard and isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(  # as FSDP2: a smaller post-forward group is not offered on an SPMD mesh
            f"reshard_after_forward={reshard_after_forward} (an int) is not supported with an SPMD mesh "
            "(dp_mesh_dims), as in torch's FSDP2; pass True, False or None")
    return SpmdMesh(mesh, shard, replicate)
