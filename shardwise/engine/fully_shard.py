"""``fully_shard``: validate the arguments, build the parameter groups, attach the hooks.

``fully_shard`` is the recipe; its steps live in ``construct``. Units are
built deepest first, one at a time (materializing meta parameters just
before), so the unsharded model never has to exist all at once; the
scheduling itself lives in ``sharded_state``.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Iterator, Mapping

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .collectives import Collectives, StreamSet
from .rank_consistency import check_rank_consistency
from .construct import (
    GroupBuilder,
    Ownership,
    build_plans,
    build_units,
    check_bucket_size,
    check_module,
    check_options,
    check_parameters,
    move_buffers,
    register_hooks,
    resolve_units,
)
from .device import device_for
from .fully_shard_options import FullyShardOptions, UnitSpec
from .graph_safe import check_graph_safe
from .sharded_state import ShardedState
from .offload import OffloadPolicy, choose_offloaded
from .placements import AxisPlacements
from .precision import MixedPrecisionPolicy

__all__ = ["fully_shard", "ShardedModule", "ShardedState"]

_STATE_ATTR = "_shardwise_state"


class ShardedModule(nn.Module):
    """Methods ``fully_shard`` adds to the class of the module it wraps (torch's ``FSDPModule``'s role).

    ``isinstance(model, shardwise.ShardedModule)`` holds for a wrapped model; the
    faces' per-model operations are in ``shardwise.engine.model_ops``.
    """

    @property
    def sharded_state(self) -> ShardedState:
        """The engine's state of this model (units, parameter groups, plan); for the faces and tests."""
        return getattr(self, _STATE_ATTR)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate grads without finalizing them: no communication on axes where they stay Partial.

        Wrap every micro-batch's backward but the last; the last (outside the
        context) reduces the accumulated gradients and installs ``.grad``.
        """
        state = self.sharded_state
        previous, state.sync_grads = state.sync_grads, False
        try:
            yield
        finally:
            state.sync_grads = previous

    def set_requires_gradient_sync(self, requires_sync: bool) -> None:
        """torch's FSDPModule method: ``False`` accumulates like ``no_sync()`` until set back to ``True``."""
        self.sharded_state.sync_grads = requires_sync

    def unshard(self) -> None:
        """Gather every unit now and point the modules at the full parameters (e.g. to inspect
        them); ``reshard()`` undoes it, and so does each unit's next forward."""
        for unit in self.sharded_state.all_units:
            unit.unshard()

    def reshard(self) -> None:
        """Free what ``unshard()`` gathered: each unit back to its sharded parameters."""
        for unit in self.sharded_state.all_units:
            unit.reshard()

    def zero_grad_buffer(self) -> None:
        """Drop every gradient, including micro-batches accumulated under ``no_sync`` and not finalized."""
        for group in self.sharded_state.groups:
            group.discard_grads()

    def mark_weights_modified(self) -> None:
        """Tell the engine the main weights changed outside an optimizer step (refreshed at next forward)."""
        self.sharded_state.mark_weights_modified()

    def resident_bytes(self) -> dict[str, int]:
        """Device bytes held by the engine's buffers on this rank, by buffer kind."""
        total: dict[str, int] = {}
        for g in self.sharded_state.groups:
            for k, v in g.resident_bytes().items():
                total[k] = total.get(k, 0) + v
        return total


def fully_shard(
    module: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    placements: Mapping[str, AxisPlacements] | str | int | None = None,
    strategy: str | int | None = None,
    outer_dp_sharding_strategy: str | None = None,
    unit_modules: Iterable[UnitSpec] | UnitSpec | None = None,
    mixed_precision: MixedPrecisionPolicy | None = None,
    init_fn: Callable[[nn.Module, torch.device], None] | None = None,
    reshard_after_forward: bool = True,
    prefetch: bool = True,
    tp_axis: str = "tp",
    expert_mesh: DeviceMesh | None = None,
    expert_placements: Mapping[str, AxisPlacements] | None = None,
    ep_axis: str = "ep",
    gradient_reduction: str = "mean",
    bucket_size: int | None = None,
    plan_fn: Callable[[str, nn.Parameter], str] | None = None,
    offload_policy: OffloadPolicy | None = None,
    collectives: Collectives | None = None,
    graph_safe: bool = False,
) -> nn.Module:
    """Shard ``module``'s parameters, gradients and optimizer state over ``mesh``.

    ``placements`` maps each data-parallel mesh axis to an ``AxisPlacements``;
    ``strategy`` (Megatron-FSDP names or ZeRO 0-3) and
    ``outer_dp_sharding_strategy`` (``no_shard`` = HSDP, ``optim`` = HFSDP) are
    the named shortcut. ``unit_modules`` (classes or instances) are gathered and
    freed one at a time; the root owns every other parameter. ``init_fn(module,
    device)`` materializes meta parameters one unit at a time before sharding.
    With an ``expert_mesh``, ``plan_fn(fqn, param)`` returns ``"expert"`` for a
    parameter sharded over it (its ``ep_axis`` split along dim 0), ``"local_expert"`` for
    one sharded over it that is each EP rank's own tensor (its DTensors leave ``ep_axis``
    out), and ``"dense"`` for one sharded over ``mesh``; a ``tp_axis`` on ``expert_mesh``
    is expert tensor parallelism; by default a parameter marked
    ``allreduce=False`` (Megatron's mark for experts) is an expert.
    ``offload_policy`` keeps the main weights, optimizer state and finished
    grads of some or all units in host memory (the optimizer steps on the CPU).
    ``collectives`` (a ``shardwise.Collectives``) replaces how buffers travel
    between placements (gather, reduce-scatter, all-reduce). Parameters marked
    for an FP8 gather (``shardwise.convert_to_fp8``) form groups of their own
    that gather e4m3 bytes (``shardwise.engine.quantized_gather``). ``graph_safe=True`` keeps every
    engine buffer allocated at one address from step to step and the step free of host
    synchronisation, so ``shardwise.capture_step`` can capture it in a CUDA graph
    (memory: the gathered weights and the gradient buffers stay allocated, so units keep their weights from
    forward to backward as with ``reshard_after_forward=False``; CPU offload, MoE routing and expert
    parallelism are refused, see ``shardwise.engine.graph_safe``).
    Returns ``module`` itself, whose parameters are now DTensors.
    """
    options = FullyShardOptions(
        mesh=mesh, placements=placements, strategy=strategy, outer_dp_sharding_strategy=outer_dp_sharding_strategy,
        unit_modules=unit_modules, mixed_precision=mixed_precision, init_fn=init_fn,
        reshard_after_forward=reshard_after_forward, prefetch=prefetch, tp_axis=tp_axis, expert_mesh=expert_mesh,
        expert_placements=expert_placements, ep_axis=ep_axis, gradient_reduction=gradient_reduction,
        bucket_size=bucket_size, plan_fn=plan_fn, offload_policy=offload_policy, collectives=collectives,
        graph_safe=graph_safe,
    )
    policy = check_module(module, mixed_precision, _STATE_ATTR)
    check_rank_consistency(module, options)  # one small collective; ranks that disagree fail here, never hang later
    plan_fn = check_options(options)
    plan, expert_plan = build_plans(options)
    check_bucket_size(bucket_size)
    check_graph_safe(module, graph_safe, offload_policy, expert_mesh)
    unit_list = resolve_units(module, unit_modules)
    check_parameters(module, init_fn)

    # Checked on every rank; now shard, deepest unit first (meta parameters materialized just before).
    device = device_for(plan.mesh)
    streams = StreamSet(device, graph_safe=graph_safe)
    ownership = Ownership(module, unit_list)
    builder = GroupBuilder(
        ownership, plan, expert_plan, policy, device, streams, init_fn, plan_fn, tp_axis, ep_axis, bucket_size,
        offloaded=choose_offloaded(offload_policy, ownership.sizes()),
        pin_memory=offload_policy is None or offload_policy.pin_memory, collectives=collectives,
    )
    # Graph-safe mode holds every gathered buffer at rest anyway: a reshard after forward would free nothing and
    # only make backward gather the same weights again.
    units, root_unit = build_units(module, unit_list, builder.build_groups, reshard_after_forward and not graph_safe)
    move_buffers(module, device)
    state = ShardedState(root_unit, units, plan, streams, prefetch)
    setattr(module, _STATE_ATTR, state)
    register_hooks(module, state, units)
    cls = module.__class__
    module.__class__ = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
    return module
