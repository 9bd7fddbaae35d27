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
    "check_group_layout",
    "group_layout_problem",
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


def cached_group(cache: dict, key, make) -> ProcessGroup:
    """``cache[key]``, made by ``make()`` the first time it is asked for under the current default process
    group. A module-level cache outlives the groups it holds: after ``destroy_process_group()`` and a new
    ``init_process_group()`` its groups are dead, so a new default group empties it. Every rank sees the same
    default group, so every rank remakes the same groups in the same order (``new_group`` is collective)."""
    world = dist.group.WORLD
    if cache.get(_DEFAULT_GROUP) is not world:
        cache.clear()
        cache[_DEFAULT_GROUP] = world
    if key not in cache:
        cache[key] = make()
    return cache[key]


_DEFAULT_GROUP = object()  # cached_group's key for the default group its cache was filled under


def _group_for(ranks: list[int], backend: Optional[str]) -> ProcessGroup:
    if len(ranks) == dist.get_world_size() and backend is None:
        return dist.group.WORLD
    return cached_group(_GROUP_CACHE, (backend, tuple(ranks)), lambda: dist.new_group(ranks, backend=backend))


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


# ------------------------------------------------------------ layout checks
_LAYOUT_ORDER = ("tp", "pp", "cp", "dp", "dp_cp", "intra_dp_cp", "inter_dist_opt", "ep", "expt_tp", "expt_dp",
                 "intra_expt_dp")


def _ranks_or_none(group) -> Optional[list[int]]:
    if group is None:
        return None
    try:
        return dist.get_process_group_ranks(group)
    except Exception:  # noqa: BLE001 - a handle this rank is not a member of
        return []


def group_layout_problem(gathered: list[dict], hybrid: bool) -> Optional[str]:
    """The first problem of the groups every rank holds (``gathered[r][name]``: rank lists or None).

    Pure: every rank evaluates the same gathered list, so all find the same
    problem. Checked, in order: each group contains its rank and every member
    holds the same group (the groups partition the ranks); ``dp_cp`` covers
    ``world / (tp x pp)`` ranks (``dp`` ``world / (tp x cp x pp)``) and meets
    ``tp`` only at the rank itself; with ``hybrid`` (``num_distributed_optimizer_instances
    > 1``) ``intra_dp_cp`` x ``inter_dist_opt`` cut ``dp_cp`` into replicas of one
    size, with an outer group of at least 2 ranks; with expert parallelism,
    ``expt_dp`` x ``ep`` x ``expt_tp`` x ``pp`` covers the world.
    """
    world = len(gathered)

    def ranks(r: int, name: str) -> list[int]:
        value = gathered[r].get(name)
        return [r] if value is None else value

    def n(r: int, name: str) -> int:
        return len(ranks(r, name))

    given = [name for name in _LAYOUT_ORDER if any(g.get(name) is not None for g in gathered)]
    for name in given:
        for r in range(world):
            mine = ranks(r, name)
            if r not in mine:
                return f"pg_collection.{name} is {mine} on rank {r}, which does not contain rank {r}"
            for s in mine:
                if not 0 <= s < world:
                    return f"pg_collection.{name} is {mine} on rank {r}: rank {s} is outside the world of {world}"
                if ranks(s, name) != mine:
                    return (
                        f"pg_collection.{name} is {mine} on rank {r} but {ranks(s, name)} on rank {s}: every "
                        "member of a group must hold the same group"
                    )
    for r in range(world):
        tp, pp, cp = n(r, "tp"), n(r, "pp"), n(r, "cp")
        need = world // (tp * pp) if world % (tp * pp) == 0 else None
        if n(r, "dp_cp") != need:
            return (
                f"pg_collection.dp_cp has {n(r, 'dp_cp')} rank(s) {ranks(r, 'dp_cp')} on rank {r}, but a world of "
                f"{world} ranks with tp={tp} x pp={pp} needs {need if need else f'world / {tp * pp}'} data-parallel "
                "ranks per group: ranks outside it would train separate, diverging replicas"
            )
        if "dp" in given and n(r, "dp") * cp != need:
            return (
                f"pg_collection.dp has {n(r, 'dp')} rank(s) {ranks(r, 'dp')} on rank {r}, but a world of {world} "
                f"ranks with tp={tp} x cp={cp} x pp={pp} needs {need // cp if need and need % cp == 0 else '?'}"
            )
        shared = sorted(set(ranks(r, "tp")) & set(ranks(r, "dp_cp")))
        if shared != [r]:
            return (
                f"pg_collection.tp {ranks(r, 'tp')} and pg_collection.dp_cp {ranks(r, 'dp_cp')} share ranks "
                f"{shared} on rank {r}: tensor-parallel peers cannot also be data-parallel peers"
            )
    if hybrid:
        for name in ("intra_dp_cp", "inter_dist_opt"):
            missing = [r for r, g in enumerate(gathered) if g.get(name) is None]
            if missing:
                return (
                    f"num_distributed_optimizer_instances > 1 needs pg_collection.{name} (the "
                    f"{'inner' if name == 'intra_dp_cp' else 'outer'} data-parallel group), missing on ranks {missing}"
                )
        for r in range(world):
            dp, inner, outer = ranks(r, "dp_cp"), ranks(r, "intra_dp_cp"), ranks(r, "inter_dist_opt")
            for name, group in (("intra_dp_cp", inner), ("inter_dist_opt", outer)):
                if not set(group) <= set(dp):
                    return f"pg_collection.{name} {group} on rank {r} is not inside its pg_collection.dp_cp {dp}"
            if len(outer) < 2:
                hint = " (are intra_dp_cp and inter_dist_opt swapped?)" if len(inner) > 1 else ""
                return (
                    f"pg_collection.inter_dist_opt has {len(outer)} rank {outer} on rank {r}: "
                    "num_distributed_optimizer_instances > 1 needs an outer group with one rank per optimizer "
                    f"instance, and pg_collection.intra_dp_cp {inner} the ranks of one instance{hint}"
                )
            if len(outer) * len(inner) != len(dp) or sorted(set(outer) & set(inner)) != [r]:
                return (
                    f"pg_collection.intra_dp_cp {inner} x pg_collection.inter_dist_opt {outer} on rank {r} do not cut "
                    f"pg_collection.dp_cp {dp} into {len(outer)} replicas of {len(inner)} ranks: they must meet only "
                    "at the rank itself and cover the data-parallel group together"
                )
            if len(outer) != n(0, "inter_dist_opt"):
                return (
                    f"pg_collection.inter_dist_opt has {n(0, 'inter_dist_opt')} ranks on rank 0 but {len(outer)} "
                    f"on rank {r}: every rank needs the same number of optimizer instances"
                )
    if any(n(r, "ep") > 1 for r in range(world)):
        for r in range(world):
            ep, etp, edp, pp = n(r, "ep"), n(r, "expt_tp"), n(r, "expt_dp"), n(r, "pp")
            if edp * ep * etp * pp != world:
                return (
                    f"pg_collection.expt_dp has {edp} rank(s) {ranks(r, 'expt_dp')} on rank {r}, but a world of "
                    f"{world} ranks with ep={ep} x expt_tp={etp} x pp={pp} needs "
                    f"{world // (ep * etp * pp) if world % (ep * etp * pp) == 0 else f'world / {ep * etp * pp}'}"
                )
            shared = sorted(set(ranks(r, "ep")) & set(ranks(r, "expt_dp")))
            if shared != [r]:
                return (
                    f"pg_collection.ep {ranks(r, 'ep')} and pg_collection.expt_dp {ranks(r, 'expt_dp')} share ranks "
                    f"{shared} on rank {r}: expert-parallel peers cannot also be expert data-parallel peers"
                )
    return None


def check_group_layout(pg_collection, hybrid: bool = False) -> None:
    """Check that the collection's groups tile the world as Megatron's groups do, on every rank at once.

    One ``all_gather_object`` over the default group of each rank's group rank
    lists, then :func:`group_layout_problem` on what every rank gathered:
    ``ValueError`` naming the group and the ranks, raised by every rank alike
    (no rank goes on into a collective the others never reach). Every rank must call it.
    """
    mine = {name: _ranks_or_none(getattr(pg_collection, name, None)) for name in _LAYOUT_ORDER}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    problem = group_layout_problem(gathered, hybrid)
    if problem is not None:
        raise ValueError(problem)
