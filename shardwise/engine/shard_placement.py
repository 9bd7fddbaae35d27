"""``shard_placement_fn``'s answer for one parameter, read with FSDP2's meaning: the dim its data-parallel axes split.

FSDP2 accepts ``None`` (dim 0), ``Shard(d)`` for any dim of the parameter (negative
dims counted from the end; a dim other than 0 split evenly, checked where the
axes are known: ``sharded_param``), and a ``ShardPlacementResult`` (a placement
plus the mesh to shard over). shardwise takes a ``ShardPlacementResult`` over the
call's own mesh as its placement; a per-parameter mesh is the engine's expert
mesh, given as ``fully_shard(..., expert_mesh=..., plan_fn=...)``.
"""

from __future__ import annotations

from torch.distributed.tensor import Shard

from .quantized_gather import gather_mark
from .sharded_param import ParamRef

__all__ = ["InvalidShardDim", "shard_dim_of"]


class InvalidShardDim(ValueError, AssertionError):
    """A ``Shard(d)`` for a dim the parameter does not have: a ``ValueError``, and the ``AssertionError`` FSDP2
    raises there, so code written against either catches it."""


def shard_dim_of(ref: ParamRef, answer, mesh) -> int:
    """The dim (``>= 0``) ``answer`` (``shard_placement_fn(ref.param)``) shards ``ref`` along; ``mesh`` is the
    call's ``mesh`` argument (``None``: the default one)."""
    placement = _placement_over_own_mesh(ref, answer, mesh)
    if placement is None:
        return 0
    if type(placement) is not Shard:  # (a _StridedShard is not a placement FSDP2 takes either)
        raise ValueError(f"shard_placement_fn returned {answer!r} for parameter {ref.fqn!r}: expected None, "
                         "Shard(dim) or a ShardPlacementResult, as FSDP2's fully_shard")
    ndim = ref.param.dim()
    dim = placement.dim + ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < ndim:
        raise InvalidShardDim(f"shard_placement_fn returned {answer!r} for parameter {ref.fqn!r} of shape "
                              f"{tuple(ref.param.shape)}: it has no dim {placement.dim} (Shard dim {placement.dim} "
                              f"is invalid for {ndim}D tensor)")
    if dim and gather_mark(ref.param) is not None:
        raise NotImplementedError(
            f"shard_placement_fn returned {answer!r} for parameter {ref.fqn!r}, which is marked for the FP8 weight "
            "all-gather: the FP8 gather is built for dim 0 only; return Shard(0) or None for it, or convert with "
            "shardwise.engine.fp8.convert_to_fp8(..., all_gather=False)")
    return dim


def _placement_over_own_mesh(ref: ParamRef, answer, mesh):
    """``answer``'s placement: itself, or a ``ShardPlacementResult``'s where its mesh is the call's own."""
    if answer is None or isinstance(answer, Shard):
        return answer
    mesh_info = getattr(answer, "mesh_info", None)
    if mesh_info is None or not hasattr(answer, "placement"):
        return answer  # refused by the caller as neither
    own = mesh is not None and mesh_info.mesh == mesh and _is_default_for(mesh_info, mesh)
    if not own:
        raise NotImplementedError(
            f"shard_placement_fn returned a ShardPlacementResult for parameter {ref.fqn!r} over mesh "
            f"{mesh_info.mesh!r}, not fully_shard's mesh: a per-parameter mesh is not taken through "
            "shard_placement_fn. Give experts their mesh with fully_shard(..., expert_mesh=..., plan_fn=...) "
            "(plan_fn answering 'local_expert' for a tensor of this expert-parallel rank's own, sharded over its "
            "expert-data-parallel ranks as FSDP2 shards it over that mesh), and return the placement alone "
            "(Shard(d) or None) from shard_placement_fn")
    return answer.placement


def _is_default_for(mesh_info, mesh) -> bool:
    """Whether ``mesh_info`` is what FSDP2 makes of ``mesh`` itself: shard over its last dim, replicate over
    the first of two."""
    shard = getattr(mesh_info, "shard_mesh_dim", None)
    replicate = getattr(mesh_info, "replicate_mesh_dim", None)
    return shard == mesh.ndim - 1 and replicate == (0 if mesh.ndim == 2 else None)
