"""Megatron's process groups: ``ProcessGroupCollection`` and a builder from parallel sizes.

Ranks are laid out as Megatron-Core lays them out by default (order
``tp-cp-ep-dp-pp``, fastest-varying first):

* dense parameters: ``rank = tp + TP * (cp + CP * (dp + DP * pp))``;
* expert parameters: ``rank = etp + ETP * (ep + EP * (edp + EDP * pp))``.

``dp_cp`` is every rank of one pipeline stage with the same TP rank (the
data-parallel domain including context parallelism). With
``num_distributed_optimizer_instances = n > 1`` that domain is cut into ``n``
contiguous pieces: ``intra_dp_cp`` is this rank's piece (the inner, sharding
axis of a hybrid mesh) and ``inter_dist_opt`` the ranks at the same position in
every piece (the outer axis). ``expt_dp`` / ``intra_expt_dp`` do the same for
the expert-data-parallel domain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.distributed as dist

__all__ = [
    "ProcessGroupCollection",
    "build_process_groups",
    "rank_layout",
    "group_size",
    "group_rank",
    "group_ranks",
]

ProcessGroup = dist.ProcessGroup


def group_size(group: Optional[ProcessGroup]) -> int:
    """Size of ``group``; 1 for ``None`` (a dimension that is not used)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Optional[ProcessGroup]) -> int:
    """This rank's index in ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def group_ranks(group: Optional[ProcessGroup]) -> list[int]:
    """Global ranks of ``group`` in group order (``[this rank]`` for ``None``)."""
    return [dist.get_rank()] if group is None else dist.get_process_group_ranks(group)


@dataclass
class ProcessGroupCollection:
    """The process groups one rank belongs to, by Megatron's names (``None`` = not used).

    dp: data parallel (without context parallel); dp_cp: data x context parallel,
    the domain FSDP shards over; intra_dp_cp / inter_dist_opt: the inner and outer
    pieces of dp_cp when the optimizer has several instances (hybrid sharding);
    tp, pp, cp: tensor, pipeline, context parallel; ep, expt_tp, expt_dp,
    intra_expt_dp: expert parallel, expert tensor parallel, expert data parallel
    and its inner piece.
    """

    dp: Optional[ProcessGroup] = None
    dp_cp: Optional[ProcessGroup] = None
    intra_dp_cp: Optional[ProcessGroup] = None
    inter_dist_opt: Optional[ProcessGroup] = None
    tp: Optional[ProcessGroup] = None
    pp: Optional[ProcessGroup] = None
    cp: Optional[ProcessGroup] = None
    ep: Optional[ProcessGroup] = None
    expt_tp: Optional[ProcessGroup] = None
    expt_dp: Optional[ProcessGroup] = None
    intra_expt_dp: Optional[ProcessGroup] = None

    @classmethod
    def build(cls, world_size: Optional[int] = None, **sizes) -> "ProcessGroupCollection":
        """Same as :func:`build_process_groups`."""
        return build_process_groups(world_size, **sizes)

    def sizes(self) -> dict[str, int]:
        """Size of every group (1 where the group is ``None``)."""
        return {f.name: group_size(getattr(self, f.name)) for f in fields(self)}


def _split(ranks: list[int], pieces: int) -> tuple[list[list[int]], list[list[int]]]:
    """Contiguous pieces of ``ranks`` and the strided groups across them."""
    size = len(ranks) // pieces
    inner = [ranks[i * size : (i + 1) * size] for i in range(pieces)]
    outer = [ranks[j::size] for j in range(size)]
    return inner, outer


def _along(table: torch.Tensor, dims: tuple[int, ...]) -> list[list[int]]:
    """Rank lists that vary along ``dims`` of ``table`` (the others fixed), each ascending."""
    rest = [d for d in range(table.dim()) if d not in dims]
    moved = table.permute(*rest, *dims).reshape(-1, math.prod(table.shape[d] for d in dims))
    return [sorted(row.tolist()) for row in moved]


def rank_layout(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    num_distributed_optimizer_instances: int = 1,
) -> dict[str, list[list[int]]]:
    """Every group of every kind as lists of global ranks (pure arithmetic, no communication)."""
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    instances = num_distributed_optimizer_instances
    for name, value in (
        ("tensor_model_parallel_size", tp),
        ("pipeline_model_parallel_size", pp),
        ("context_parallel_size", cp),
        ("expert_model_parallel_size", ep),
        ("expert_tensor_parallel_size", etp),
        ("num_distributed_optimizer_instances", instances),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if world_size % (tp * cp * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by tensor_model_parallel_size={tp} x "
            f"context_parallel_size={cp} x pipeline_model_parallel_size={pp}"
        )
    if world_size % (etp * ep * pp):
        raise ValueError(
            f"world size {world_size} is not divisible by expert_tensor_parallel_size={etp} x "
            f"expert_model_parallel_size={ep} x pipeline_model_parallel_size={pp}"
        )
    dp = world_size // (tp * cp * pp)
    edp = world_size // (etp * ep * pp)
    if (dp * cp) % instances:
        raise ValueError(
            f"num_distributed_optimizer_instances={instances} must divide the data x context "
            f"parallel size {dp * cp}"
        )
    if edp % instances:
        raise ValueError(
            f"num_distributed_optimizer_instances={instances} must divide the expert data "
            f"parallel size {edp}"
        )
    ranks = torch.arange(world_size)
    dense = ranks.reshape(pp, dp, cp, tp)  # slowest first
    expert = ranks.reshape(pp, edp, ep, etp)
    layout = {
        "tp": _along(dense, (3,)),
        "cp": _along(dense, (2,)),
        "dp": _along(dense, (1,)),
        "dp_cp": _along(dense, (1, 2)),
        "pp": _along(dense, (0,)),
        "ep": _along(expert, (2,)),
        "expt_tp": _along(expert, (3,)),
        "expt_dp": _along(expert, (1,)),
    }
    layout["intra_dp_cp"], layout["inter_dist_opt"] = [], []
    for group in layout["dp_cp"]:
        inner, outer = _split(group, instances)
        layout["intra_dp_cp"] += inner
        layout["inter_dist_opt"] += outer
    layout["intra_expt_dp"] = [p for g in layout["expt_dp"] for p in _split(g, instances)[0]]
    return layout


# Groups made by build_process_groups, by (backend, ranks): every rank makes the same
# calls in the same order, so reusing a group keeps them in step and saves a rendezvous.
_GROUP_CACHE: dict[tuple, ProcessGroup] = {}


def _group_for(ranks: list[int], backend: Optional[str]) -> ProcessGroup:
    if len(ranks) == dist.get_world_size() and backend is None:
        return dist.group.WORLD
    key = (backend, tuple(ranks))
    group = _GROUP_CACHE.get(key)
    if group is None:
        group = _GROUP_CACHE[key] = dist.new_group(ranks, backend=backend)
    return group


def build_process_groups(
    world_size: Optional[int] = None,
    *,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: Optional[int] = None,
    num_distributed_optimizer_instances: int = 1,
    backend: Optional[str] = None,
) -> ProcessGroupCollection:
    """Create (or reuse) every group for these sizes and return this rank's.

    A collective over the default group: every rank must call it with the same
    arguments. ``world_size`` defaults to (and must equal) the default group's size.
    """
    if not dist.is_initialized():
        raise RuntimeError("build_process_groups needs an initialized default process group")
    actual = dist.get_world_size()
    if world_size is None:
        world_size = actual
    if world_size != actual:
        raise ValueError(f"world_size={world_size} does not match the default process group's size {actual}")
    layout = rank_layout(
        world_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        num_distributed_optimizer_instances=num_distributed_optimizer_instances,
    )
    me = dist.get_rank()
    mine = {}
    for kind, groups in layout.items():
        for ranks in groups:
            group = _group_for(ranks, backend)
            if me in ranks:
                mine[kind] = group
    return ProcessGroupCollection(**mine)
