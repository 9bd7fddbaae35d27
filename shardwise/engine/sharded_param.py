"""One sharded parameter: its rows at every level, its slots, its DTensor face.

This is the one place that knows which rows of a parameter a rank holds. The
group asks it for slot sizes (to pack its flat buffers), for the views a
collective reads and writes, and for the DTensors it hands out; the state-dict
and checkpoint code only ever see those DTensors, which torch's own tools
understand.

A parameter sharded along a dim ``d > 0`` (``shard_placement_fn`` returning
``Shard(d)``, FSDP2's meaning, split evenly) has "rows" along dim ``d``: its
piece at every level is ``torch.chunk`` along ``d``, stored contiguous in the
parameter's own layout, so its DTensors' local tensors are FSDP2's, stride for
stride. Such a piece is not a slice of its parent's flat storage: ``W``
contiguous pieces gathered one after the other are ``W`` blocks, which the
parent interleaves along ``d``. A transition over an axis of more than one
rank therefore moves through a temporary: ``unblock`` after a gather (FSDP2's
copy-out), ``block`` before a reduce-scatter (its copy-in), one copy each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .layout import RowPiece, nested_chunks, row_numel, slot_rows
from .mesh import ShardingPlan
from .owner_layout import owner_mesh
from .spmd_mesh import spmd_param_of

__all__ = ["ParamRef", "ShardedParam"]


@dataclass
class ParamRef:
    """A parameter and every (module, attribute) that holds it (more than one when tied).

    ``model_parallel_dims`` maps a model-parallel mesh axis (``tp``, ``ep``) to
    the dimension along which the local parameter is one slice of the global
    tensor; the DTensors then describe the global tensor. ``local_axes`` are
    model-parallel axes over which each rank holds a tensor of its own (a
    Megatron-Core local expert over ``ep``): its DTensors' mesh leaves them out.
    """

    fqn: str
    param: nn.Parameter
    holders: list[tuple[nn.Module, str]]
    model_parallel_dims: dict[str, int] = field(default_factory=dict)
    local_axes: list[str] = field(default_factory=list)
    shard_dim: int = 0  # the dim the data-parallel axes split (shard_placement_fn's Shard(d)), >= 0
    owner: int | None = None  # whole on this coordinate of the shard axis (shard_placement_fn's Owned()), or None


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


class ShardedParam:
    """The rows of one (model-parallel-local) parameter this rank holds at each level.

    Levels follow the plan's optimizer axes: level 0 is the whole local
    parameter, level ``len(plan.opt_axes)`` the optimizer shard.
    """

    def __init__(self, ref: ParamRef, plan: ShardingPlan):
        self.ref = ref
        self.fqn = ref.fqn
        self.shape = torch.Size(ref.param.shape)
        self.shard_dim = ref.shard_dim
        # Pieces along dim d (blocked in a gather) only where an axis really splits it: else every level is the
        # whole parameter, which dim-0 rows describe as well.
        self.blocked = self.shard_dim != 0 and any(a.size > 1 for a in plan.opt_axes)
        if self.blocked:
            _check_even(ref.fqn, self.shape, self.shard_dim, plan)
        self.row_dim = self.shard_dim if self.blocked else 0
        self.rows = self.shape[self.row_dim]
        # elements before and after dim d: one "row" is `outer` runs of `inner` elements
        self._outer, self._inner = math.prod(self.shape[: self.row_dim]), math.prod(self.shape[self.row_dim + 1 :])
        self.row_numel = self._outer * self._inner if self.blocked else row_numel(self.shape)
        self.owner = ref.owner
        self.numel_whole = math.prod(self.shape)
        if self.owner is None:
            self.pieces: list[RowPiece] = nested_chunks(self.rows, [(a.size, a.index) for a in plan.opt_axes])
        else:  # whole on the owner, nothing elsewhere (owner_layout)
            axis = _check_owned(ref, plan)
            self.mine = axis.index == self.owner
            self.pieces = [RowPiece(axis.size, axis.index, self.rows, 0, self.rows if self.mine else 0)]
        self.spmd = spmd_param_of(ref.param)  # taken from a DTensor on an SPMD mesh or a TP submesh: its faces
        if self.owner is not None:
            self.global_shape = plan.global_shape(self.shape, ref.model_parallel_dims)
            # torch.chunk rows over the data-parallel mesh: what state dicts hold (``owner_state``)
            self.rows_mesh, self.rows_placements = plan.dtensor_spec(ref.model_parallel_dims, ref.local_axes, 0)
            self.owner_rank = dist.get_global_rank(axis.group, self.owner)
            self.mesh, self.placements = owner_mesh(self.rows_mesh.device_type, self.owner_rank), [Replicate()]
            self.axis = self.sum_group = axis  # its ranks' local tensors together are the matrix (clipping)
        elif self.spmd is None:
            self.global_shape = plan.global_shape(self.shape, ref.model_parallel_dims)
            self.mesh, self.placements = plan.dtensor_spec(ref.model_parallel_dims, ref.local_axes, self.shard_dim)
        else:  # the DTensor's own global shape (a TP split may be uneven) and FSDP2's face
            self.global_shape = self.spmd.global_shape(self.shape)
            self.mesh, self.placements = self.spmd.sharded_face(self.shard_dim)
        self._specs: dict[torch.dtype, DTensorSpec] = {}  # the DTensor face per dtype (dtensor)

    @property
    def levels(self) -> int:
        return len(self.pieces)

    def slot_numel(self, level: int) -> int:
        if self.owner is not None:  # level 0 whole; level 1 whole on the owner, empty elsewhere
            return self.real_rows(level)[1] * self.row_numel
        return slot_rows(self.rows, self.pieces, level) * self.row_numel

    def real_rows(self, level: int) -> tuple[int, int]:
        """(first row, row count) of this rank's piece at ``level``."""
        if level == 0:
            return 0, self.rows
        piece = self.pieces[level - 1]
        return piece.start, piece.rows

    def piece_numel(self, level: int) -> int:
        """Elements one rank sends into a gather from ``level`` (its padded piece)."""
        return self.pieces[level - 1].chunk * self.row_numel

    def gathered_numel(self, level: int) -> int:
        """Elements a gather from ``level`` writes into the slot of ``level - 1``."""
        piece = self.pieces[level - 1]
        return piece.count * piece.chunk * self.row_numel

    def own_piece(self, parent_slot: torch.Tensor, level: int) -> torch.Tensor:
        """Where this rank's piece of ``level`` sits inside the gathered slot of ``level - 1``."""
        piece = self.pieces[level - 1]
        if self.owner is not None:
            return parent_slot[: piece.rows * self.row_numel]
        size = piece.chunk * self.row_numel
        return parent_slot[piece.index * size : (piece.index + 1) * size]

    def local(self, slot: torch.Tensor, level: int) -> torch.Tensor:
        """The real rows of a slot of ``level``, shaped like the parameter (contiguous)."""
        rows = self.real_rows(level)[1]
        if not rows and self.owner is not None:  # torch's DTensor face off the owner: a 1-D empty tensor
            return slot[:0]
        shape = list(self.shape)
        shape[self.row_dim] = rows
        return slot[: rows * self.row_numel].view(shape)

    def _blocks(self, level: int) -> tuple[tuple[int, int, int, int], tuple[int, int, int, int]]:
        """The gathered region of ``level - 1``'s slot as (outer, W, chunk, inner), interleaved along dim d,
        and the same elements as W blocks one after the other, (W, outer, chunk, inner)."""
        piece = self.pieces[level - 1]
        return ((self._outer, piece.count, piece.chunk, self._inner),
                (piece.count, self._outer, piece.chunk, self._inner))

    def unblock(self, blocks: torch.Tensor, parent_slot: torch.Tensor, level: int) -> None:
        """After a gather from ``level`` into ``blocks`` (the W pieces one after the other): the parent's piece
        in its own layout, in ``parent_slot``."""
        interleaved, blocked = self._blocks(level)
        numel = math.prod(blocked)
        parent_slot[:numel].view(interleaved).copy_(blocks[:numel].view(blocked).transpose(0, 1))

    def block(self, parent_slot: torch.Tensor, blocks: torch.Tensor, level: int) -> None:
        """Before a reduce-scatter to ``level``: the parent's piece as the W pieces one after the other."""
        interleaved, blocked = self._blocks(level)
        numel = math.prod(blocked)
        blocks[:numel].view(blocked).copy_(parent_slot[:numel].view(interleaved).transpose(0, 1))

    def compute_tensor(self, local: torch.Tensor) -> torch.Tensor:
        """What forward reads over the gathered ``local``: itself, or under an SPMD mesh the DTensor the model's
        own code was written for."""
        return local if self.spmd is None else self.spmd.compute_tensor(local)

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The gathered parameter's gradient as the local tensor the engine reduces."""
        return grad if self.spmd is None else self.spmd.local_grad(grad)

    def dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (this rank's optimizer-level rows) as a DTensor of the global parameter.

        Built straight from a spec made once per dtype: ``DTensor.from_local`` costs
        about a hundred times more on the host (an autograd function, the spec rebuilt),
        and every step hands out one gradient DTensor per parameter. ``local`` stays
        where it is (a host one, offloaded main weights, is not copied to the mesh's
        device) and carries no autograd history, as none of the tensors given here do.
        """
        spec = self._specs.get(local.dtype)
        if spec is None:
            meta = TensorMeta(self.global_shape, _contiguous_stride(self.global_shape), local.dtype)
            spec = self._specs[local.dtype] = DTensorSpec(self.mesh, tuple(self.placements), tensor_meta=meta)
        return DTensor(local, spec, requires_grad=False)

    def shard_of(self, full: torch.Tensor, level: int | None = None) -> torch.Tensor:
        """This rank's rows of a model-parallel-local full value (no communication)."""
        first, rows = self.real_rows(self.levels if level is None else level)
        if not rows and self.owner is not None:
            return full.reshape(-1)[:0]
        return full.narrow(self.row_dim, first, rows)


def _check_even(fqn: str, shape: torch.Size, dim: int, plan: ShardingPlan) -> None:
    """FSDP2's rule for a dim other than 0: the axes split it evenly (no padding to move with it). Placements
    beyond FSDP2's (parameters replicated while optimizer state is sharded: ZeRO-1/2, HFSDP) keep dim 0."""
    pieces = math.prod(a.size for a in plan.opt_axes)
    if shape[dim] % pieces:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: "  # FSDP2's words first
            f"shard_placement_fn returned Shard({dim}) for parameter {fqn!r} of shape {tuple(shape)}: dim {dim} "
            f"({shape[dim]}) does not split evenly over the {pieces} ranks that shard it; as FSDP2, shardwise "
            "shards a dim other than 0 evenly only. Return Shard(0) or None for it, or a dim divisible by "
            f"{pieces}")
    if len(plan.param_axes) != len(plan.opt_axes):
        raise NotImplementedError(
            f"shard_placement_fn returned Shard({dim}) for parameter {fqn!r}, whose parameters are replicated over "
            f"axes {[a.name for a in plan.opt_axes[len(plan.param_axes):]]} that shard its optimizer state "
            "(strategy optim / optim_grads, or HFSDP): Shard(dim > 0) is built for FSDP2's placements, parameters "
            "sharded like their optimizer state (optim_grads_params, HSDP); return Shard(0) or None there")


def _check_owned(ref: ParamRef, plan: ShardingPlan):
    """The shard axis of a parameter laid out whole on an owner: built for one sharded data-parallel axis
    that shards parameters, gradients and optimizer state alike (ZeRO-3; HSDP's inner axis), no
    model parallelism, a 2-D parameter."""
    why = None
    if ref.param.dim() != 2:
        why = f"it has {ref.param.dim()} dims; Owned() lays out 2-D matrices (Muon's) only"
    elif plan.model_parallel or ref.model_parallel_dims or ref.local_axes:
        why = "tensor or expert parallelism is not built with owned matrices"
    elif len(plan.opt_axes) != 1 or len(plan.param_axes) != 1 or len(plan.grad_axes) != 1:
        why = ("its placements shard it over "
               f"{[a.name for a in plan.param_axes]} (parameters), {[a.name for a in plan.grad_axes]} (gradients), "
               f"{[a.name for a in plan.opt_axes]} (optimizer): Owned() is built for one data-parallel axis "
               "sharding all three (strategy optim_grads_params, or HSDP's inner axis)")
    if why:
        raise NotImplementedError(f"shard_placement_fn returned Owned() for parameter {ref.fqn!r}: {why}; return "
                                  "Shard(0) or None for it")
    return plan.opt_axes[0]
