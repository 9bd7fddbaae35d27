"""Megatron-FSDP's per-parameter checkpoint attributes, for Megatron-LM's ``fsdp_dtensor`` code.

Megatron-FSDP gives every parameter it hands out two attributes that Megatron-LM's
checkpoint code reads (``fsdp_dtensor_checkpoint.py``: ``handle_swiglu_in_state_dict``
under ``--swiglu``, ``handle_gdn_in_state_dict`` in 0.19):

- ``megatron_fsdp_slice``: this rank's elements of the parameter as a flat range of the
  per-model-parallel-rank weight (the weight one TP rank holds, flattened);
- ``megatron_fsdp_dist_index``: its ``FSDPDistributedIndex``, from which the code takes
  the tensor-parallel mesh and, through ``make_fsdp_dtensor``, the data-parallel mesh
  and placements of the ``_w`` / ``_v`` halves it cuts out of the local shard.

shardwise's pieces are ``torch.chunk`` rows, level after level (docs/design.md), so
the slice is a row range times the row size, and the meshes are the parameter's own
DTensor mesh's process groups rearranged into Megatron-FSDP's order
(``outer_fsdp_dp``, ``dp_cp``, ``tp``; no new group but one single-rank group for an
axis of one rank, as Megatron's adapter makes for a missing TP group). Everything is read
from the parameter's DTensor (its mesh, placements and shape), so dense, HSDP/HFSDP,
TP and expert parameters are answered alike, however the engine meshes them.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..engine.layout import chunk_range
from .meshes import EP_AXIS, TP_AXIS
from .process_groups import cached_group

__all__ = ["FSDPDistributedIndex", "attach_checkpoint_attributes", "megatron_fsdp_slice",
           "MEGATRON_TP_ATTRIBUTES", "tensor_parallel_attributes"]

# Megatron-FSDP's names for the axes (its adapter's ``_init_dist_index``)
OUTER, SHARD, TP = "outer_fsdp_dp", "dp_cp", "tp"
MODEL_PARALLEL_AXES = (TP_AXIS, EP_AXIS)

# the tensor-parallel attributes Megatron-FSDP carries from a module's parameter to the one it hands out
MEGATRON_TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "_mcore_tp",
                          "_tp_duplicated", "_tp_partition_dim")

_OWN_GROUPS: dict = {}


def _own_group(backend: str) -> dist.ProcessGroup:
    """A process group of this rank alone (made once per backend, by this rank only)."""
    return cached_group(_OWN_GROUPS, backend, lambda: dist.new_group([dist.get_rank()], backend=backend,
                                                                      use_local_synchronization=True))


def _roles(param: DTensor) -> tuple[list[int], list[int], Optional[int], list[int]]:
    """(model-parallel dims, sharded data-parallel dims in nesting order, the replicated data-parallel
    dim if any, every data-parallel dim) of the parameter's DTensor mesh."""
    names = param.device_mesh.mesh_dim_names
    if names is None:
        raise ValueError(f"megatron_fsdp_dist_index: the parameter's mesh {param.device_mesh} has no dim names")
    model = [i for i, n in enumerate(names) if n in MODEL_PARALLEL_AXES]
    data = [i for i in range(len(names)) if i not in model]
    sharded = [i for i in data if isinstance(param.placements[i], Shard)]
    replicated = [i for i in data if isinstance(param.placements[i], Replicate)]
    if any(param.placements[i] != Shard(0) for i in sharded) or len(sharded) + len(replicated) != len(data):
        raise ValueError(f"megatron_fsdp_dist_index: data-parallel placements {param.placements} on {names}; "
                         "expected Shard(0) or Replicate on each")
    if len(data) > 2 or len(replicated) > 1 or (len(replicated) == 1 and len(sharded) > 1):
        raise ValueError(f"megatron_fsdp_dist_index: data-parallel axes {[names[i] for i in data]} with "
                         f"placements {param.placements} have no Megatron-FSDP counterpart")
    return model, sharded, (replicated[0] if replicated else None), data


def megatron_fsdp_slice(param: DTensor) -> slice:
    """This rank's elements of ``param`` as a flat range of its per-model-parallel-rank weight.

    The model-parallel axes (``tp``, ``ep``) cut the global tensor first; the sharded
    data-parallel axes then cut dim 0 of that piece, in the mesh's (nesting) order.
    """
    mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate()
    model, sharded, _, _ = _roles(param)
    shape = list(param.shape)
    for i in model:
        placement = param.placements[i]
        if isinstance(placement, Shard):
            start, stop = chunk_range(shape[placement.dim], mesh.size(i), coordinate[i])
            shape[placement.dim] = stop - start
    first, rows = 0, shape[0] if shape else 1
    for i in sharded:
        start, stop = chunk_range(rows, mesh.size(i), coordinate[i])
        first, rows = first + start, stop - start
    row = math.prod(shape[1:])
    local = param.to_local()
    if local.numel() != rows * row:
        raise ValueError(f"megatron_fsdp_slice: the local shard has {local.numel()} elements, the layout "
                         f"{param.placements} on {mesh.mesh_dim_names} gives {rows} rows of {row}")
    return slice(first * row, (first + rows) * row)


class FSDPDistributedIndex:
    """Megatron-FSDP's ``FSDPDistributedIndex`` for one of shardwise's parameter layouts.

    Answers what Megatron-Core 0.16 and 0.19 read of it: ``device_mesh`` /
    ``expt_device_mesh`` (``[outer_fsdp_dp,] dp_cp, tp``), the dim names, ``use_hybrid_fsdp``,
    ``hsdp_outer_dp_shard``, the groups (``fsdp_group``, ``outer_fsdp_group``,
    ``hybrid_fsdp_group``, the expert ones and the all-gather ones, ``None`` as in Megatron
    without a separate all-gather group), ``mesh_library``, ``get_submesh``, ``get_dp_group``,
    ``get_fsdp_group``, ``get_outer_fsdp_group``, ``get_root_mesh`` and
    ``get_logical_hybrid_fsdp_rank``. ``is_expert_parallel`` selects nothing: the layout
    is the parameter's own, dense or expert. Meshes are built at first use (a checkpoint).
    """

    def __init__(self, param: DTensor):
        model, sharded, replicated, data = _roles(param)
        self._param_mesh, self._model_dims = param.device_mesh, model
        self._tp_dim_index = next((i for i in model if param.device_mesh.mesh_dim_names[i] == TP_AXIS), None)
        # inner: the first sharded axis; outer: the second one (HFSDP), else the replicated one (HSDP, and
        # no_shard, whose inner axis is then this rank alone: each rank holds the whole tensor)
        self._shard_dim_index = sharded[0] if sharded else None
        self._outer_dim_index = sharded[1] if len(sharded) == 2 else replicated
        self.dp_shard_dim, self.tp_dim = SHARD, TP
        self.dp_outer_dim = OUTER if self._outer_dim_index is not None else None
        self.use_hybrid_fsdp = self.dp_outer_dim is not None
        self.hsdp_outer_dp_shard = len(sharded) == 2
        self.fsdp_group_ag = self.expt_fsdp_group_ag = None
        self._mesh: Optional[DeviceMesh] = None
        self._library: Optional[dict] = None

    # ------------------------------------------------------------ the meshes
    def _build(self) -> DeviceMesh:
        """The mesh ``[outer_fsdp_dp,] dp_cp, tp`` from the parameter mesh's groups (one rank: a group of its own)."""
        if self._mesh is not None:
            return self._mesh
        mesh, coordinate = self._param_mesh, self._param_mesh.get_coordinate()
        backend = dist.get_backend(mesh.get_group(0))
        own = None
        dims, groups, names = [], [], []
        for index, name in ((self._outer_dim_index, OUTER), (self._shard_dim_index, SHARD), (self._tp_dim_index, TP)):
            if index is None and name == OUTER:
                continue
            dims.append(index)
            names.append(name)
            if index is None:
                own = _own_group(backend) if own is None else own
                groups.append(own)
            else:
                groups.append(mesh.get_group(index))
        ranks = mesh.mesh
        # keep this rank's coordinate on the axes the index has no dim for (``ep``), then order the rest
        kept = [i for i in dims if i is not None]
        ranks = ranks[tuple(slice(None) if i in kept else coordinate[i] for i in range(mesh.ndim))]
        ranks = ranks.permute([sorted(kept).index(i) for i in kept]) if kept else ranks
        shape = [ranks.shape[kept.index(i)] if i is not None else 1 for i in dims]
        table = ranks.reshape(shape)
        self._mesh = DeviceMesh.from_group(groups, mesh.device_type, mesh=table, mesh_dim_names=tuple(names))
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._build()

    @property
    def expt_device_mesh(self) -> DeviceMesh:
        return self._build()

    @property
    def mesh_library(self) -> dict:
        """Megatron-FSDP's table of registered submeshes, keyed ``(*dim names, is_expert_parallel)``."""
        if self._library is None:
            mesh, names = self._build(), self._build().mesh_dim_names
            patterns = [(TP,), (OUTER, SHARD, TP), (SHARD, TP), (OUTER, SHARD), (SHARD,)]
            self._library = {(*p, expert): mesh[p] for p in patterns if set(p) <= set(names)
                             for expert in (False, True)}
        return self._library

    def get_submesh(self, mesh_dim_names: str | Sequence[str], is_expert_parallel: bool = False) -> DeviceMesh:
        """A registered submesh by name(s), as Megatron-FSDP's (``ValueError`` for one it has not)."""
        names = (mesh_dim_names,) if isinstance(mesh_dim_names, str) or mesh_dim_names is None else mesh_dim_names
        found = self.mesh_library.get((*names, is_expert_parallel))
        if found is None:
            raise ValueError(f"[FSDPDistributedIndex][get_submesh] No submesh with mesh_dim_names={tuple(names)}, "
                             f"is_expert_parallel={is_expert_parallel} has been registered with Megatron-FSDP.\n"
                             f"DeviceMesh: {self._build()}")
        return found

    # ------------------------------------------------------------ the groups
    @property
    def fsdp_group(self) -> dist.ProcessGroup:
        return self._build()[SHARD].get_group()

    expt_fsdp_group = fsdp_group

    @property
    def outer_fsdp_group(self) -> Optional[dist.ProcessGroup]:
        return self._build()[OUTER].get_group() if self.use_hybrid_fsdp else None

    expt_outer_fsdp_group = outer_fsdp_group

    @property
    def hybrid_fsdp_group(self) -> Optional[dist.ProcessGroup]:
        """The outer and inner axes as one group (torch's flattened mesh dimension)."""
        return self._build()[OUTER, SHARD]._flatten().get_group() if self.use_hybrid_fsdp else None

    hybrid_fsdp_expt_group = hybrid_fsdp_group

    def get_dp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup:
        return self.hybrid_fsdp_group if self.use_hybrid_fsdp else self.fsdp_group

    def get_fsdp_group(self, is_expert_parallel: bool = False,
                       independent_all_gather: bool = False) -> Optional[dist.ProcessGroup]:
        return self.fsdp_group_ag if independent_all_gather else self.fsdp_group

    def get_outer_fsdp_group(self, is_expert_parallel: bool = False) -> Optional[dist.ProcessGroup]:
        return self.outer_fsdp_group

    def get_root_mesh(self, is_expert_parallel: bool = False) -> DeviceMesh:
        return self._build()

    def get_logical_hybrid_fsdp_rank(self, is_expert_parallel: bool = False) -> int:
        """This rank's index in the full-shard hybrid group, inner axis major (``(inner, outer)`` order)."""
        if not self.hsdp_outer_dp_shard:
            raise AssertionError("get_logical_hybrid_fsdp_rank is only valid when full-shard hybrid FSDP is enabled.")
        mesh = self._build()
        outer, inner = mesh[OUTER].get_local_rank(), mesh[SHARD].get_local_rank()
        return inner * mesh.size(0) + outer


def tensor_parallel_attributes(module: nn.Module) -> dict[str, dict]:
    """Per parameter name, the Megatron tensor-parallel attributes it carries (read before sharding)."""
    return {name: {a: getattr(p, a) for a in MEGATRON_TP_ATTRIBUTES if hasattr(p, a)}
            for name, p in module.named_parameters()}


def attach_checkpoint_attributes(module: nn.Module, attributes: Optional[dict[str, dict]] = None) -> None:
    """Give every sharded parameter of ``module`` Megatron-FSDP's checkpoint attributes.

    ``attributes`` (from :func:`tensor_parallel_attributes` before sharding) are put back on
    the new parameters, as Megatron-FSDP's ``reset_attribute`` does; one index is shared by
    the parameters of one layout (mesh and placements).
    """
    indexes: dict = {}
    for name, param in module.named_parameters():
        for attr, value in (attributes or {}).get(name, {}).items():
            setattr(param, attr, value)
        if not isinstance(param, DTensor):
            continue
        key = (id(param.device_mesh), tuple(param.placements))
        if key not in indexes:
            indexes[key] = FSDPDistributedIndex(param)
        param.megatron_fsdp_slice = megatron_fsdp_slice(param)
        param.megatron_fsdp_dist_index = indexes[key]
