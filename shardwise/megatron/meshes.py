"""Device meshes built from Megatron's process groups, checked against them.

The adapter never invents a rank layout: it takes the groups the caller made
(``ProcessGroupCollection``), builds the mesh those groups imply, and checks
that every axis of the mesh spans exactly the ranks of the group meant for it.
A mesh whose members are right but whose order is wrong would still reduce
over valid groups while giving shard indices to the wrong ranks, so the checks
compare ordered rank lists.

Layout assumed by the tables (Megatron-Core's default order, fastest first):
``tp``, then ``ep``, then the data-parallel ranks, then anything slower (the
pipeline stages). ``_get_dp_tp_mesh`` / ``_get_hsdp_tp_mesh`` return the rank
table of this rank's (data-parallel x tensor-parallel) domain, and
``_get_edp_ep_mesh`` the (expert data parallel x expert parallel) one.

Axis names are the engine's: data-parallel axes ``dp_outer`` / ``dp_shard``
(``expert_dp`` on the expert mesh), named as in the placements passed to
:func:`shardwise.fully_shard`, and the model-parallel axes ``tp`` and ``ep``
(its ``tp_axis`` / ``ep_axis``).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..engine.rank_consistency import raise_together
from ..engine.mesh import check_mesh_ranks_and_group_ranks_are_consistent as _check_ordered
from ..engine.placements import STRATEGY_PLACEMENTS, AxisPlacements
from .config import SHARDING_STRATEGIES
from .process_groups import check_group_layout, group_ranks, group_size

__all__ = [
    "_DATA_PARALLEL_PLACEMENTS",
    "_check_mesh_ranks_and_group_ranks_are_consistent",
    "_get_dp_tp_mesh",
    "_get_hsdp_tp_mesh",
    "_build_hybrid_dp_mesh",
    "_get_edp_ep_mesh",
    "_get_edp_ep_etp_mesh",
    "_build_dense_mesh",
    "_build_expert_mesh_and_placements",
    "_check_model_groups",
    "INNER_AXIS",
    "OUTER_AXIS",
    "EXPERT_AXIS",
    "TP_AXIS",
    "EP_AXIS",
]

INNER_AXIS, OUTER_AXIS, EXPERT_AXIS = "dp_shard", "dp_outer", "expert_dp"
TP_AXIS, EP_AXIS = "tp", "ep"

# How one mesh axis places the three buffers: the engine's AxisPlacements.

# Per-axis placements of each sharding strategy (ZeRO 0-3). HSDP is `no_shard` on the
# outer axis over `optim_grads_params` inside; HFSDP is `optim` on the outer axis.
_DATA_PARALLEL_PLACEMENTS: dict[str, AxisPlacements] = {
    name: STRATEGY_PLACEMENTS[name] for name in SHARDING_STRATEGIES
}


def _check_mesh_ranks_and_group_ranks_are_consistent(mesh_ranks: Any, group_ranks: Sequence[int]) -> bool:
    """Check that the mesh row holding this rank is exactly ``group_ranks``.

    ``mesh_ranks`` is a table of rows (one per group of that axis), as a nested
    list or a 2-D tensor. Raises ``ValueError`` naming both when this rank is in
    no row, in several, or its row differs from the group. Returns ``True``.
    """
    rows = mesh_ranks.tolist() if isinstance(mesh_ranks, torch.Tensor) else [list(r) for r in mesh_ranks]
    me = dist.get_rank()
    mine = [row for row in rows if me in row]
    if len(mine) != 1:
        raise ValueError(f"rank {me} appears in {len(mine)} rows of the mesh ranks {rows}; expected exactly one")
    _check_ordered(mine[0], list(group_ranks))
    return True


def _rows(table: torch.Tensor, axis: int) -> torch.Tensor:
    """The rank lists along ``axis`` of ``table``, one per row."""
    return table.movedim(axis, -1).reshape(-1, table.shape[axis])


def _check_axis(table: torch.Tensor, axis: int, group, what: str) -> None:
    ranks = group_ranks(group)
    try:
        _check_mesh_ranks_and_group_ranks_are_consistent(_rows(table, axis), ranks)
    except ValueError as err:
        raise ValueError(f"{what}: {err}") from None


def _rank_table(sizes: Sequence[int], names: Sequence[str]) -> torch.Tensor:
    world = dist.get_world_size()
    inner = math.prod(sizes)
    if world % inner:
        detail = " x ".join(f"{n}={s}" for n, s in zip(names, sizes))
        raise ValueError(f"world size {world} is not a multiple of {detail}")
    return torch.arange(world).reshape(world // inner, *sizes)


def _this_ranks_block(table: torch.Tensor) -> torch.Tensor:
    me = dist.get_rank()
    blocks = [block for block in table if (block == me).any()]
    if len(blocks) != 1:
        raise ValueError(f"rank {me} appears in {len(blocks)} blocks of the mesh ranks {table.tolist()}")
    return blocks[0]


def _together(build, *args):
    """``build(*args)`` on every rank; a ``ValueError`` on any rank is raised on every rank.

    The group checks below are local and may fail on some ranks only (groups
    that differ by rank); a rank that passes would then wait forever in the
    next collective for the ranks that stopped. One small exchange each.
    """
    result, error = None, None
    try:
        result = build(*args)
    except ValueError as err:
        error = str(err)
    raise_together(error)
    return result


def _get_dp_tp_mesh(dp_cp_group, tp_group, ep_size: int = 1) -> torch.Tensor:
    """This rank's (data parallel, tensor parallel) rank table, checked against both groups.

    Ranks are laid out ``(rest, dp, ep, tp)`` slowest first; the table is the
    ``dp x tp`` block of this rank's ``(rest, ep)``. A collective over the
    default group: a mismatch on any rank raises on every rank.
    """
    return _together(_dp_tp_table, dp_cp_group, tp_group, ep_size)


def _dp_tp_table(dp_cp_group, tp_group, ep_size: int = 1) -> torch.Tensor:
    dp, tp = group_size(dp_cp_group), group_size(tp_group)
    table = _rank_table((dp, ep_size, tp), ("dp_cp", "ep", "tp")).permute(0, 2, 1, 3)  # rest, ep, dp, tp
    _check_axis(table, 2, dp_cp_group, "data-parallel group")
    _check_axis(table, 3, tp_group, "tensor-parallel group")
    return _this_ranks_block(table.flatten(0, 1))


def _get_hsdp_tp_mesh(outer_fsdp_dp_group, dp_cp_group, tp_group, ep_size: int = 1) -> torch.Tensor:
    """This rank's (outer data parallel, inner data parallel, tensor parallel) rank table.

    Ranks are laid out ``(rest, outer, inner, ep, tp)`` slowest first; each of the
    three groups is checked against its axis. A collective over the default
    group: a mismatch on any rank raises on every rank.
    """
    return _together(_hsdp_tp_table, outer_fsdp_dp_group, dp_cp_group, tp_group, ep_size)


def _hsdp_tp_table(outer_fsdp_dp_group, dp_cp_group, tp_group, ep_size: int = 1) -> torch.Tensor:
    outer, inner, tp = group_size(outer_fsdp_dp_group), group_size(dp_cp_group), group_size(tp_group)
    sizes, names = (outer, inner, ep_size, tp), ("outer_dp", "dp_cp", "ep", "tp")
    table = _rank_table(sizes, names).permute(0, 3, 1, 2, 4)  # rest, ep, outer, inner, tp
    _check_axis(table, 2, outer_fsdp_dp_group, "outer data-parallel group")
    _check_axis(table, 3, dp_cp_group, "inner data-parallel group")
    _check_axis(table, 4, tp_group, "tensor-parallel group")
    return _this_ranks_block(table.flatten(0, 1))


def _get_edp_ep_mesh(expt_dp_group, ep_group, expt_tp_size: int = 1) -> torch.Tensor:
    """This rank's (expert data parallel, expert parallel) rank table, checked against both groups.

    Expert ranks are laid out ``(rest, edp, ep, etp)`` slowest first; the table is
    the ``edp x ep`` block of this rank's ``(rest, etp)``. A collective over the
    default group: a mismatch on any rank raises on every rank.
    """
    return _together(_edp_ep_table, expt_dp_group, ep_group, expt_tp_size)


def _edp_ep_table(expt_dp_group, ep_group, expt_tp_size: int = 1) -> torch.Tensor:
    edp, ep = group_size(expt_dp_group), group_size(ep_group)
    table = _rank_table((edp, ep, expt_tp_size), ("expt_dp", "ep", "expt_tp")).permute(0, 3, 1, 2)  # rest, etp, edp, ep
    _check_axis(table, 2, expt_dp_group, "expert data-parallel group")
    _check_axis(table, 3, ep_group, "expert-parallel group")
    return _this_ranks_block(table.flatten(0, 1))


def _from_groups(groups: Sequence, table: torch.Tensor, names: Sequence[str], device_type: str) -> DeviceMesh:
    """A mesh over ``table`` whose axis ``i`` communicates over ``groups[i]`` (already checked)."""
    return DeviceMesh.from_group(list(groups), device_type, mesh=table.contiguous(), mesh_dim_names=tuple(names))


def _build_dense_mesh(pg_collection, hybrid: bool, device_type: str) -> DeviceMesh:
    """The mesh dense parameters are sharded over.

    ``(dp_shard,)`` over ``dp_cp``, or ``(dp_outer, dp_shard)`` over
    ``inter_dist_opt`` x ``intra_dp_cp`` when ``hybrid`` (built from the groups
    themselves, any layout). With a tensor-parallel group of more than one rank
    a last ``tp`` axis over ``pg_collection.tp`` is added, on the table of
    :func:`_get_dp_tp_mesh` / :func:`_get_hsdp_tp_mesh` (Megatron's rank layout;
    every group is checked against its axis, ``ValueError`` naming both rank
    lists when they differ).

    First, one exchange over the default group checks that the collection's
    groups tile the world (:func:`check_group_layout`): a ``dp_cp`` that does
    not cover ``world / (tp x pp)`` ranks, groups that differ between their
    members, hybrid groups that do not cut ``dp_cp`` into replicas are refused
    on every rank, naming the group.
    """
    tp_group = getattr(pg_collection, "tp", None)
    dp_group = getattr(pg_collection, "dp_cp", None)
    if dp_group is None:
        raise ValueError("pg_collection.dp_cp (the data-parallel group) is needed to build the data-parallel mesh")
    check_group_layout(pg_collection, hybrid)
    tp = group_size(tp_group)
    if hybrid:
        outer = getattr(pg_collection, "inter_dist_opt", None)
        inner = getattr(pg_collection, "intra_dp_cp", None)
        if tp == 1:
            return _build_hybrid_dp_mesh(outer, inner, device_type)
        table = _get_hsdp_tp_mesh(outer, inner, tp_group)
        return _from_groups([outer, inner, tp_group], table, (OUTER_AXIS, INNER_AXIS, TP_AXIS), device_type)
    if tp == 1:
        return DeviceMesh.from_group(dp_group, device_type, mesh_dim_names=(INNER_AXIS,))
    table = _get_dp_tp_mesh(dp_group, tp_group)
    return _from_groups([dp_group, tp_group], table, (INNER_AXIS, TP_AXIS), device_type)


def _build_hybrid_dp_mesh(outer_group, inner_group, device_type: str) -> DeviceMesh:
    """The (``dp_outer``, ``dp_shard``) mesh of a hybrid data-parallel domain.

    The table is built from the groups themselves: this rank's outer group gives
    the first column, each of its members' inner group a row. Every rank's inner
    group must then be its row and its outer group its column, else
    ``ValueError`` naming both lists. A collective over the default group.
    """
    if outer_group is None or inner_group is None:
        raise ValueError(
            "num_distributed_optimizer_instances > 1 needs both the inter_dist_opt (outer) and the "
            "intra_dp_cp (inner) process groups"
        )
    me = dist.get_rank()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (me, group_ranks(inner_group), group_ranks(outer_group)))
    table = _together(_hybrid_table, gathered, me)
    return DeviceMesh.from_group(
        [outer_group, inner_group], device_type, mesh=table, mesh_dim_names=(OUTER_AXIS, INNER_AXIS)
    )


def _hybrid_table(gathered: list, me: int) -> list[list[int]]:
    """The (outer, inner) rank table from every rank's ``(rank, inner ranks, outer ranks)``, checked."""
    inner_of = {rank: inner for rank, inner, _ in gathered}
    outer_of = {rank: outer for rank, _, outer in gathered}
    table = [inner_of[r] for r in outer_of[me]]
    flat = [r for row in table for r in row]
    if len(set(flat)) != len(flat):
        raise ValueError(
            f"hybrid mesh {table} repeats ranks: the intra_dp_cp and inter_dist_opt groups overlap "
            f"beyond this rank (inter_dist_opt group {outer_of[me]})"
        )
    if len({len(row) for row in table}) != 1:
        raise ValueError(
            f"hybrid mesh rows {table} differ in length: the intra_dp_cp groups of the inter_dist_opt "
            f"group {outer_of[me]} are not the same size"
        )
    for row in table:
        for rank in row:
            if inner_of[rank] != row:
                raise ValueError(
                    f"hybrid mesh row {row} does not match the intra_dp_cp group {inner_of[rank]} of rank {rank}"
                )
    for column in map(list, zip(*table)):
        for rank in column:
            if outer_of[rank] != column:
                raise ValueError(
                    f"hybrid mesh column {column} does not match the inter_dist_opt group "
                    f"{outer_of[rank]} of rank {rank}"
                )
    return table


def _get_edp_ep_etp_mesh(expt_dp_group, ep_group, expt_tp_group) -> torch.Tensor:
    """This rank's (expert data parallel, expert parallel, expert tensor parallel) rank table, checked
    against the three groups (Megatron's expert order ``(rest, edp, ep, etp)``, slowest first). A
    collective over the default group: a mismatch on any rank raises on every rank."""
    return _together(_edp_ep_etp_table, expt_dp_group, ep_group, expt_tp_group)


def _edp_ep_etp_table(expt_dp_group, ep_group, expt_tp_group) -> torch.Tensor:
    sizes = (group_size(expt_dp_group), group_size(ep_group), group_size(expt_tp_group))
    table = _rank_table(sizes, ("expt_dp", "ep", "expt_tp"))  # rest, edp, ep, etp
    _check_axis(table, 1, expt_dp_group, "expert data-parallel group")
    _check_axis(table, 2, ep_group, "expert-parallel group")
    _check_axis(table, 3, expt_tp_group, "expert tensor-parallel group")
    return _this_ranks_block(table)


def _build_expert_mesh_and_placements(config, ddp_config, pg_collection, device_type: str, module=None):
    """The ``(expert_dp, ep)`` mesh expert parameters are sharded over (``(expert_dp, ep, tp)`` with
    expert tensor parallelism, its ``tp`` axis over ``pg_collection.expt_tp``) and its placements, or
    ``(None, None)`` when the experts are sharded like the dense parameters.

    Each EP rank holds different experts, so they are replicated (and sharded by
    FSDP) over ``expt_dp`` only, with the expert strategy
    (``expert_data_parallel_sharding_strategy``, else the dense one); ``ep`` is
    the model-parallel axis the engine places expert slices on. Megatron-FSDP's
    expert mesh is ``[expt_dp, expt_tp]``: an expert-TP size other than TP's
    (Megatron-LM's ``--expert-tensor-parallel-size``) needs this mesh even with one
    EP rank. Every group is checked against Megatron's expert rank layout.
    ``module``: without expert parameters there is no expert mesh.
    """
    instances = getattr(ddp_config, "num_distributed_optimizer_instances", 1)
    outer = getattr(pg_collection, "inter_dist_opt", None)
    if isinstance(instances, int) and instances > 1 and group_size(outer) != instances:
        # (_build_dense_mesh checked that every rank's inter_dist_opt has the same size: all ranks raise)
        raise ValueError(
            f"num_distributed_optimizer_instances={instances} needs pg_collection.inter_dist_opt with {instances} "
            f"ranks (one per optimizer instance), got {group_size(outer)} {group_ranks(outer)}: the groups form "
            f"{group_size(outer)} replicas; build them with build_process_groups(num_distributed_optimizer_instances="
            f"{instances})"
        )
    ep_size = max(getattr(config, "expert_model_parallel_size", 1) or 1, group_size(getattr(pg_collection, "ep", None)))
    expt_tp = getattr(pg_collection, "expt_tp", None)
    etp = group_size(expt_tp)
    other_tp = expt_tp is not None and etp != group_size(getattr(pg_collection, "tp", None))
    if ep_size <= 1 and not other_tp:
        return None, None
    if module is not None and not any(".experts." in f".{n}" for n, _ in module.named_parameters()):
        return None, None
    expt_dp = getattr(pg_collection, "expt_dp", None)
    if expt_dp is None:
        raise ValueError(
            f"expert_model_parallel_size={ep_size} needs the expt_dp process group in pg_collection"
        )
    ep_group = getattr(pg_collection, "ep", None)
    if group_size(ep_group) != ep_size or (ep_group is None and ep_size > 1):
        found = None if ep_group is None else group_size(ep_group)
        raise ValueError(f"expert_model_parallel_size={ep_size} needs pg_collection.ep with {ep_size} ranks, got {found}")
    strategy = getattr(ddp_config, "expert_data_parallel_sharding_strategy", None) or getattr(
        ddp_config, "data_parallel_sharding_strategy", "no_shard"
    )
    if strategy not in _DATA_PARALLEL_PLACEMENTS:
        raise ValueError(
            f"expert_data_parallel_sharding_strategy={strategy!r} is not one of {list(_DATA_PARALLEL_PLACEMENTS)}"
        )
    if ep_group is None:  # one EP rank: this rank alone (Megatron's ep group at EP 1), made by every rank
        ep_group = _single_rank_group()
    if etp > 1:
        table = _get_edp_ep_etp_mesh(expt_dp, ep_group, expt_tp)
        mesh = _from_groups([expt_dp, ep_group, expt_tp], table, (EXPERT_AXIS, EP_AXIS, TP_AXIS), device_type)
    else:
        table = _get_edp_ep_mesh(expt_dp, ep_group, etp)
        mesh = _from_groups([expt_dp, ep_group], table, (EXPERT_AXIS, EP_AXIS), device_type)
    return mesh, {EXPERT_AXIS: _DATA_PARALLEL_PLACEMENTS[strategy]}


def _single_rank_group():
    """This rank's own one-rank group (every rank makes every one, as ``new_subgroups`` does)."""
    group, _ = dist.new_subgroups(group_size=1)
    return group


def _group_attr(module: nn.Module, names: Sequence[str]):
    """``(name, value)`` of the first attribute in ``names`` that holds a process group (or None)."""
    for name in names:
        if name in vars(module) or hasattr(type(module), name):
            value = getattr(module, name, None)
            if value is None or isinstance(value, dist.ProcessGroup):
                return name, value
    return None


def _check_model_groups(module: nn.Module, tp_group, ep_group, expert_tp_group=None) -> None:
    """Check that the model was built with the adapter's tensor- and expert-parallel groups.

    A module holding tensor-parallel parameters (``tensor_model_parallel=True``)
    and a ``tp_group`` / ``group`` attribute must use the ranks of the mesh's
    ``tp`` axis (``pg_collection.tp``), or, for an expert's (parameters under
    ``.experts.``), those of ``expert_tp_group`` (``pg_collection.expt_tp``) when
    given; a module with an ``ep_group`` attribute those of the ``ep`` axis.
    ``None`` means a single rank: a model built without TP under
    ``tensor_model_parallel_size=2`` holds whole tensors, which would be read as
    halves. ``ValueError`` names the module and both rank lists.
    """
    checks = []
    for name, sub in module.named_modules():
        own = [(n, p) for n, p in sub._parameters.items() if p is not None]
        if any(getattr(p, "tensor_model_parallel", False) for _, p in own):
            found = _group_attr(sub, ("tp_group", "group"))
            expert = any(".experts." in f".{name}.{n}" for n, _ in own)
            if found is not None and expert and expert_tp_group is not None:
                checks.append((name, found, expert_tp_group, "expert tensor-parallel", "expt_tp"))
            elif found is not None:
                checks.append((name, found, tp_group, "tensor-parallel", "tp"))
        found = _group_attr(sub, ("ep_group",))
        if found is not None:
            checks.append((name, found, ep_group, "expert-parallel", "ep"))
    for name, (attr, model_group), mesh_group, what, field in checks:
        try:
            _check_ordered(group_ranks(mesh_group), group_ranks(model_group))
        except ValueError:
            where = f"module {name!r}" if name else "the root module"
            raise ValueError(
                f"{where} was built with {what} ranks {group_ranks(model_group)} (its {attr!r}), but the "
                f"mesh axis {field!r} (pg_collection.{field}) has ranks {group_ranks(mesh_group)}; build the "
                f"model with the {field} group of the pg_collection passed to the adapter"
            ) from None
