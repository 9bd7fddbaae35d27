"""``parallelize_module(model, tp_mesh, plan)`` then ``fully_shard(module, mesh=dp_mesh)``: FSDP2's 2-D / 3-D flow.

torchtitan's and torch's own 2-D recipe: tensor parallelism first makes parameters DTensors on the TP
submesh (``world_mesh["tp"]``), then ``fully_shard`` gets the data-parallel submesh (``world_mesh["dp"]``,
or ``world_mesh["dp_replicate", "dp_shard"]`` for HSDP). FSDP2 shards each such parameter's TP-local tensor
over the DP mesh and hands out DTensors on the two meshes concatenated (``DeviceMesh._concatenate``:
``("dp", "tp")``, ``("dp_replicate", "dp_shard", "tp")``), placements ``(Shard(0) or _StridedShard(0, k),
<TP placement>)`` (``Replicate()`` first under HSDP).

That is the full-SPMD-mesh case (``spmd_mesh.py``) with the parameters on one of its dims instead of all of
them: this module reads ``(dp_mesh, the parameters' TP mesh)`` as an :class:`SpmdMesh` over the concatenated
mesh (shard dim the DP mesh's last, replicate dim its first under HSDP) whose parameters sit on the TP
submesh. Forward reads each gathered parameter as the DTensor it came as (the TP plan's hooks redistribute
with that spec), its gradient is made local as FSDP2 does (redistributed to the parameter's TP placement),
and the sharded parameters, gradients and optimizer state carry FSDP2's concatenated mesh and placements.
"""

from __future__ import annotations

from typing import Iterable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .spmd_mesh import SpmdMesh

__all__ = ["read_tp_submesh"]


def _tp_mesh(dp_mesh: DeviceMesh, params: Iterable[tuple[str, nn.Parameter]]) -> DeviceMesh | None:
    """The one mesh, other than ``dp_mesh``, that the DTensor parameters sit on (``None``: there are none)."""
    found: dict[DeviceMesh, str] = {}
    for fqn, p in params:
        if isinstance(p, DTensor) and p.device_mesh != dp_mesh:
            found.setdefault(p.device_mesh, fqn)
    if len(found) > 1:
        named = "; ".join(f"{fqn!r} on {mesh}" for mesh, fqn in found.items())
        raise NotImplementedError(
            f"fully_shard: this call's DTensor parameters sit on {len(found)} different meshes ({named}); "
            "shardwise takes one tensor-parallel mesh per call (fully_shard the modules of each mesh apart)")
    return next(iter(found), None)


def read_tp_submesh(mesh: DeviceMesh | None, params: Iterable[tuple[str, nn.Parameter]],
                    **mesh_options) -> SpmdMesh | None:
    """FSDP2's reading of DTensor parameters on a TP submesh beside ``mesh`` (the DP submesh), as an
    :class:`SpmdMesh` whose parameters sit on that TP mesh; ``None`` where no parameter is such a DTensor.
    ``params``: the (fqn, parameter) this call shards (not those earlier calls took, nor the ignored ones).
    ``mesh_options``: shardwise's own mesh arguments, which FSDP2's meaning replaces (refused when given). An int
    ``reshard_after_forward`` is read later as for any mesh: the shard size is ``True``, 1 is ``False``, a smaller
    group is refused beside a model-parallel dim (FSDP2 refuses it for DTensor parameters at the first forward)."""
    params = list(params)
    if mesh is None:
        for fqn, p in params:
            if isinstance(p, DTensor):
                raise ValueError(
                    f"fully_shard(mesh=None): parameter {fqn!r} is a DTensor on {p.device_mesh} (tensor parallel); "
                    "pass mesh= the data-parallel submesh of the same world mesh (e.g. world_mesh['dp'])")
        return None
    tp_mesh = _tp_mesh(mesh, params)
    if tp_mesh is None:
        return None
    if tp_mesh.device_type != mesh.device_type:  # FSDP2's words
        raise ValueError(f"Requires DTensor to have mesh of the same type as the FSDP mesh but got "
                         f"{tp_mesh.device_type} for DTensor and {mesh.device_type} for FSDP (fully_shard(mesh="
                         f"{mesh}) over DTensor parameters on {tp_mesh})")
    given = [name for name, value in mesh_options.items() if value is not None]
    if given:
        raise ValueError(f"fully_shard(mesh=dp_mesh) over DTensor parameters on the tensor-parallel mesh {tp_mesh} "
                         f"takes FSDP2's meaning of the DP mesh (1-D: FSDP, 2-D: HSDP); do not pass "
                         f"{', '.join(given)} with it")
    if mesh.ndim not in (1, 2) or mesh.mesh_dim_names is None or tp_mesh.mesh_dim_names is None:
        raise ValueError(f"fully_shard(mesh={mesh}) over DTensor parameters on {tp_mesh}: both meshes must be named "
                         "submeshes of one world mesh (e.g. world_mesh['dp'] and world_mesh['tp']), the DP mesh "
                         "1-D (FSDP) or 2-D (HSDP: replicate, shard)")
    if tp_mesh.ndim != 1:
        raise NotImplementedError(
            f"fully_shard: DTensor parameters on the {tp_mesh.ndim}-D mesh {tp_mesh}; shardwise takes a 1-D "
            "tensor-parallel mesh beside the data-parallel one")
    try:
        spmd_mesh = DeviceMesh._concatenate([mesh, tp_mesh])  # FSDP2's own mesh of the sharded parameters
    except RuntimeError as e:
        raise ValueError(f"fully_shard(mesh={mesh}): the DTensor parameters' mesh {tp_mesh} and mesh= are not "
                         f"disjoint submeshes of one world mesh ({e})") from e
    names = mesh.mesh_dim_names
    return SpmdMesh(spmd_mesh, shard=(names[-1],), replicate=tuple(names[:-1]), param_mesh=tp_mesh, dp_mesh=mesh)
