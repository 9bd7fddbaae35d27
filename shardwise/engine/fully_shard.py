"""``fully_shard``: torch FSDP2's call, on shardwise's engine.

``fully_shard(module)`` makes ``module`` (or a list of modules) one unit: its
parameters not yet taken by an earlier call are sharded now, into DTensors.
A later call on an ancestor takes in the units below it, so calling it on each
block and then on the model (FSDP2's idiom, any number of levels) builds one
sharded model whose root is the last call's module. The recipe is here; its
steps live in ``construct``, the scheduling in ``step_controller``, the unit
methods in ``sharded_module``. ``unit_modules=[...]`` is the one-call
shortcut: those modules become units in the same call, deepest first.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .collectives import Collectives, StreamSet
from .arguments import (
    build_plans,
    check_bucket_size,
    check_call,
    check_fsdp2_mesh,
    fsdp2_face,
    check_modules,
    check_options,
    check_parameters,
    resolve_offload,
    resolve_policy,
    resolve_reshard,
    resolve_spmd_mesh,
    take_spmd_parameters,
)
from .construct import (
    GroupBuilder, Ownership, adopt_units, attach_post_forward_shards, build_units, move_buffers, register_hooks,
    start_checks, taken_modules, unit_settings,
)
from .device import device_for
from .fully_shard_options import FullyShardOptions, UnitSpec
from .graph_safe import check_graph_safe
from .offload import choose_offloaded
from .placements import AxisPlacements
from .rank_consistency import check_rank_consistency
from .resolution import resolve_units
from .sharded_module import ShardedModule, make_fsdp_modules
from .step_controller import StepController
from .torch_fsdp_state import state as torch_state
from .weight_origin import resolve_check_mode

__all__ = ["fully_shard", "ShardedModule", "StepController"]

_STREAMS: dict[tuple, StreamSet] = {}  # one set of side streams per device: every unit's gathers queue on it


def _shared_streams(device: torch.device, graph_safe: bool) -> StreamSet:
    """The process's ``StreamSet`` for ``device`` and mode, made at its first call only."""
    key = (str(device), graph_safe)
    if key not in _STREAMS:
        _STREAMS[key] = StreamSet(device, graph_safe=graph_safe)
    return _STREAMS[key]


def fully_shard(
    module: nn.Module | list[nn.Module],
    mesh: DeviceMesh | None = None,
    *,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: Any = None,
    offload_policy: Any = None,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: Any = None,
    placements: Mapping[str, AxisPlacements] | str | int | None = None,
    strategy: str | int | None = None,
    outer_dp_sharding_strategy: str | None = None,
    unit_modules: Iterable[UnitSpec] | UnitSpec | None = None,
    mixed_precision: Any = None,
    init_fn: Callable[[nn.Module, torch.device], None] | None = None,
    prefetch: bool = True,
    tp_axis: str = "tp",
    expert_mesh: DeviceMesh | None = None,
    expert_placements: Mapping[str, AxisPlacements] | None = None,
    ep_axis: str = "ep",
    gradient_reduction: str = "mean",
    bucket_size: int | None = None,
    plan_fn: Callable[[str, nn.Parameter], str] | None = None,
    collectives: Collectives | None = None,
    graph_safe: bool = False,
    sync_module_states: bool = False,
    check_module_states: bool | str = "warn",
) -> nn.Module | list[nn.Module]:
    """Shard ``module``'s parameters, gradients and optimizer state over ``mesh``; torch FSDP2's signature.

    FSDP2's arguments, with its meaning: ``mesh`` (``None``: all ranks; 1-D shards, 2-D is HSDP: replicate
    over the first axis, shard over the second, whatever their names), ``reshard_after_forward`` (``None``:
    True for a unit, False for the root; an int ``k``: kept sharded over ``k`` ranks until backward),
    ``shard_placement_fn`` (``None`` or ``Shard(d)`` per parameter, a dim > 0 split evenly; a
    ``ShardPlacementResult`` over ``mesh`` itself),
    ``mp_policy`` (torch's ``MixedPrecisionPolicy`` or shardwise's; parameters keep their own dtype),
    ``offload_policy`` (torch's ``OffloadPolicy``/``CPUOffloadPolicy`` or shardwise's, which can offload a
    fraction of the units), ``ignored_params`` (left unsharded and untouched), ``dp_mesh_dims`` (``mesh`` is
    the full SPMD mesh, parameters DTensors on it; torch's ``DataParallelMeshDims`` or any object with
    ``.shard`` / ``.replicate``). A model built on the meta
    device is sharded there: ``model.to_empty(device=...)`` and the model's own initialisation then fill the
    shards. Every unit is a ``torch.distributed.fsdp.FSDPModule`` with its methods.

    shardwise's extensions, of the same call and engine: ``placements`` (per-axis ``AxisPlacements``) or
    ``strategy`` (ZeRO 0-3 / Megatron-FSDP names) with ``outer_dp_sharding_strategy`` (``no_shard`` HSDP,
    ``optim`` HFSDP); ``unit_modules`` (classes or instances made units in this call, deepest first);
    ``init_fn(module, device)`` (materialize meta parameters unit by unit before sharding); ``prefetch``;
    ``tp_axis``; ``expert_mesh`` / ``expert_placements`` / ``ep_axis`` / ``plan_fn(fqn, param)`` ->
    ``"dense"`` | ``"expert"`` (split along dim 0 over ``ep_axis``) | ``"local_expert"`` (each EP rank's own
    tensor: its DTensor leaves ``ep_axis`` out; a ``tp_axis`` on ``expert_mesh`` is expert TP); ``gradient_reduction`` (``"mean"`` or ``"sum"``); ``bucket_size`` (split
    what the root owns); ``collectives`` (replace how buffers travel); ``graph_safe`` (static buffers for
    ``shardwise.capture_step``); ``sync_module_states`` (every rank takes the first rank's weights);
    ``check_module_states``: weights that differ across data-parallel ranks here, or that ``to_empty()``
    leaves uninitialised, and that nothing writes before the first forward get one warning there
    (``"warn"``, the default; FSDP2 is silent), an error on every rank (``"raise"``), or no check and no
    checksums (``"off"`` or ``False``: a caller that syncs them later, as Megatron's ``broadcast_params``).
    Returns ``module``.
    """
    arguments = dict(locals())  # the call's arguments by name: FullyShardOptions' fields are named after them
    modules = check_call(module, unit_modules)
    face = fsdp2_face(placements, strategy, outer_dp_sharding_strategy)
    check_fsdp2_mesh(mesh, dp_mesh_dims, face)  # FSDP2's refusals, where it makes them
    adopted = check_modules(modules)  # torch's units, a module wrapped twice: named before the meshes are read
    spmd, mesh, placements, tp_axis = resolve_spmd_mesh(  # dp_mesh_dims, or TP DTensors: FSDP2's SPMD mesh
        modules, mesh, dp_mesh_dims, reshard_after_forward, placements, strategy, outer_dp_sharding_strategy,
        expert_mesh, tp_axis, ignored_params)
    options = FullyShardOptions.from_call(
        arguments, mesh=mesh, placements=placements, tp_axis=tp_axis,
        mixed_precision=resolve_policy(mp_policy, mixed_precision), offload_policy=resolve_offload(offload_policy),
        ignored_params=None if ignored_params is None else frozenset(ignored_params),
        check_module_states=resolve_check_mode(check_module_states))
    take_spmd_parameters(spmd, modules, options)  # the DTensor parameters as TP slices
    described = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
    differing = check_rank_consistency(described, options)  # one small collective; ranks that disagree fail here
    plan_fn = check_options(options)
    plan, expert_plan = build_plans(options)
    options = resolve_reshard(options, plan, expert_plan)  # FSDP2's reading of an int reshard_after_forward
    check_bucket_size(bucket_size)
    check_graph_safe(described, graph_safe, options.offload_policy, expert_mesh)
    unit_list = resolve_units(modules[0], unit_modules)
    check_parameters(described, init_fn, face, options.ignored_params)

    # Checked on every rank; now shard, deepest unit first (meta parameters materialized just before).
    device = device_for(plan.mesh)
    streams = _shared_streams(device, graph_safe)
    ownership = Ownership(modules, unit_list, taken_modules(adopted), {id(p) for p in options.ignored_params or ()})
    builder = GroupBuilder(ownership, plan, expert_plan, options, device, streams, plan_fn,
                           offloaded=choose_offloaded(options.offload_policy, ownership.sizes()))
    new_units, own = build_units(modules, unit_list, builder.build_groups, unit_settings(options))
    own.fsdp2_refusals = face and unit_modules is None  # FSDP2's first-forward refusals (StepController.lazy_init)
    attach_post_forward_shards(new_units + [own], plan, options)  # reshard_after_forward=k
    move_buffers(described, device)
    state = StepController(own, adopt_units(modules, adopted, new_units), plan, streams, prefetch)
    register_hooks(state)
    make_fsdp_modules(state)
    start_checks(state, adopted, described, differing, options)  # the first forward's and the optimizer's
    return module


fully_shard.state = torch_state  # torch's fully_shard carries it (its contract's ``state``): the same answer
