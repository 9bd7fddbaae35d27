"""The engine's public API for the faces: what Megatron, checkpoints and Hugging Face may touch.

A face drives a model that :func:`shardwise.fully_shard` wrapped through these
functions and the methods ``fully_shard`` adds to the model (``no_sync``,
``zero_grad_buffer``, ``mark_weights_modified``, ...). It never reads a
parameter group's buffers or the hooks' bookkeeping itself, so the engine can
change those without breaking a face: what :func:`sharded_state` returns is an
opaque handle to a face, whose questions about it (the plan, the groups'
parameters, where gradients are handed out) are the functions here.
``tests/test_layering.py`` holds the faces to that.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from .mesh import ShardingPlan
from .sharded_module import STATE_ATTR as _STATE_ATTR
from .step_controller import StepController, WindowEnd

__all__ = [
    "StepController",
    "sharded_state",
    "is_sharded",
    "sharding_plan",
    "parameter_groups",
    "set_grad_attribute",
    "hand_out_unused_grads",
    "add_grad_alias",
    "wait_for_reductions",
    "install_grads",
    "install_graph_safe_grads",
    "zero_grads_in_place",
    "finish_grad_accumulation",
    "split_backward_input",
    "compute_parameters",
    "reduce_weight_grads",
    "refresh_model_weights",
    "broadcast_from_first_replica",
    "load_full_state_dict",
    "shard_like",
]


def sharded_state(model: nn.Module) -> StepController:
    """The engine's state of a model ``fully_shard`` wrapped: its units, parameter groups and plan.

    The one way to it: ``ValueError`` naming the model's type when ``model`` is
    not the module ``fully_shard`` returned (a face's wrapper passes its ``.module``).
    """
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not sharded by shardwise.fully_shard")
    return state


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is a module ``fully_shard`` wrapped (so :func:`sharded_state` answers)."""
    return getattr(model, _STATE_ATTR, None) is not None


def sharding_plan(model: nn.Module) -> ShardingPlan:
    """The model's data-parallel plan (its mesh, and the placements on each axis) as ``fully_shard`` resolved it
    for the parameters no expert mesh holds: what a checkpoint describes the model by."""
    return sharded_state(model).plan


def parameter_groups(model: nn.Module) -> list[tuple[tuple[nn.Parameter, ...], torch.dtype]]:
    """``(parameters, compute dtype)`` of each parameter group, in the engine's order (units, then the root).

    The parameters are the model's (the sharded main-weight DTensors an optimizer steps), each in one group;
    the dtype is the one forward computes in. What Megatron's optimizer lists as ``parameter_groups``.
    """
    return [(tuple(g.sharded_params), g.compute_dtype) for g in sharded_state(model).groups]


def set_grad_attribute(model: nn.Module, name: str) -> None:
    """Hand each finished main grad out as ``param.<name>`` instead of ``param.grad``.

    ``"grad"`` (the default) is a copy cast to the main weights' dtype where the main grads have another, as
    Megatron-FSDP casts; any other name gets the main grads uncast, in their own dtype (Megatron's
    precision-aware optimizer reads ``.decoupled_grad``), and ``.grad`` stays ``None``.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"set_grad_attribute: name={name!r} is not an attribute name (e.g. 'decoupled_grad')")
    for group in sharded_state(model).groups:
        group.grad_attr = name


def hand_out_unused_grads(model: nn.Module) -> None:
    """Give every trainable parameter of a reduced group its gradient, zeros where no rank used it (a face whose
    optimizer reads every parameter's slot of a gradient buffer), instead of FSDP2's ``None``."""
    for group in sharded_state(model).groups:
        group.window.presence.install_all = True


def add_grad_alias(model: nn.Module, name: str) -> None:
    """Declare ``name`` an attribute of the gathered compute parameters that aliases their ``.grad``.

    The engine drops it with ``.grad`` once it has read the gradient, so no full gradient outlives its
    reduction (Megatron's fused wgrad kernels keep ``.main_grad`` pointing at what they wrote).
    """
    if not isinstance(name, str) or not name.isidentifier() or name == "grad":
        raise ValueError(f"add_grad_alias: name={name!r} is not an attribute name other than 'grad' "
                         "(e.g. 'main_grad')")
    for group in sharded_state(model).groups:
        if name not in group.grad_aliases:
            group.grad_aliases = group.grad_aliases + (name,)


def wait_for_reductions(model: nn.Module) -> None:
    """Wait for every gradient reduction still in flight.

    Backward already waits for its reductions when it ends; a schedule with an
    explicit finish step (Megatron's ``finish_grad_sync``, ``stop_communication``)
    calls this so it does not depend on that. A group with a
    :class:`~shardwise.BackwardOptimizer` steps as its reduction lands, as in backward.
    """
    sharded_state(model)._land_in_flight()


def install_grads(model: nn.Module) -> None:
    """Expose every finalized gradient as its parameter's ``.grad`` (a DTensor on the gradient buffer).

    The last backward of a step does this; calling it again changes nothing. For
    a schedule whose finish step promises that ``.grad`` is in place.
    """
    for unit in sharded_state(model).all_units:
        unit.install_grads()


def install_graph_safe_grads(model: nn.Module) -> None:
    """Graph-safe mode: point every trainable parameter's ``.grad`` at its gradient buffer again.

    A replayed graph writes the step's gradients into the same buffers every time but runs no
    Python, so the ``.grad`` DTensors a ``zero_grad()`` dropped are not set again. A face whose
    own code replays the graph (Megatron-LM's full-iteration graph) calls this after the replay,
    before the optimizer reads ``.grad``; ``shardwise.capture_step`` does the same for its replays.
    Groups that have not reduced yet are left alone.
    """
    for group in sharded_state(model).groups:
        group.install_graph_safe_grads()


def zero_grads_in_place(model: nn.Module) -> None:
    """Start a step by zeroing every gradient where it is: the kept gradient buffers and the ``.grad`` (or
    ``.decoupled_grad``) tensors handed out stay installed, and the step's reductions add onto the zeros.

    For a face whose training loop replays a captured graph it does not drive (Megatron-LM's
    full-iteration graph): the optimizer step after a replay reads ``.grad`` with no Python run in
    between, so those tensors must be the ones the captured step wrote. Needs ``graph_safe=True``
    (its gradient buffers are kept from step to step).
    """
    state = sharded_state(model)
    if not state.graph_safe:
        raise ValueError(f"zero_grads_in_place: {type(model).__name__} was wrapped with graph_safe=False; its "
                         "gradient buffers are freed with .grad, use model.zero_grad_buffer() instead")
    for group in state.groups:
        group.zero_grads_in_place()


def finish_grad_accumulation(model: nn.Module) -> None:
    """Reduce the gradients accumulated under ``model.no_sync()`` now, and install them as ``.grad``.

    A loop whose last micro-batch runs outside ``no_sync`` never needs this: that
    backward reduces. A schedule that cannot single out a last backward (a pipeline
    stage's backwards come from ``torch.distributed.pipelining``) runs all of them
    inside ``no_sync`` and calls this once after the last: each group's window is
    finalized as the last backward would have (the one reduction of the step where
    the placements keep gradients Partial), waited on, and installed. Groups with
    nothing accumulated do nothing. A collective over the model's data-parallel
    axes: every rank of the mesh calls it.
    """
    sharded_state(model).end_window(WindowEnd.ACCUMULATION)


@contextlib.contextmanager
def split_backward_input(model: nn.Module):
    """Inside: a backward to the inputs only (a zero-bubble schedule's input pass), whose weight
    gradients a later pass computes; no unit reduces (there is nothing yet), each still frees its weights."""
    state = sharded_state(model)
    previous, state.defer_reduction = state.defer_reduction, True
    try:
        yield
    finally:
        state.defer_reduction = previous


def compute_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The gathered compute parameters autograd sees in forward (trainable ones; the same objects every
    step, their storage freed at rest): where a weight pass's gradients must go."""
    return [p for g in sharded_state(model).groups if g.requires_grad for p in g.unsharded_params]


def reduce_weight_grads(model: nn.Module) -> None:
    """After a weight pass wrote ``.grad`` on :func:`compute_parameters`: reduce them as a backward's end
    would (into the open window under ``no_sync``). A collective over the model's data-parallel axes."""
    sharded_state(model).end_window(WindowEnd.WEIGHT_PASS)


def refresh_model_weights(model: nn.Module) -> None:
    """Rebuild the compute weights from main weights that changed (an optimizer step), now.

    Where the optimizer state is sharded but the parameters are not (ZeRO-1/2,
    HFSDP's outer axis) this is the all-gather of the updated shards. The engine
    does the same at the next forward; a face calls it to start that work earlier
    (Megatron's ``start_param_sync``). Groups whose weights did not change do nothing.
    """
    for group in sharded_state(model).groups:
        group.refresh_model_weights()


@torch.no_grad()
def broadcast_from_first_replica(model: nn.Module, axes: Optional[Iterable[str]] = None) -> None:
    """Make every data-parallel replica hold the first replica's main weights.

    For a model initialized differently on each rank (Megatron's
    ``broadcast_params``). On each data-parallel axis (those named in ``axes``;
    all by default) where a group's main weights are replicated, the axis's first
    rank broadcasts them; an axis that shards them has nothing to agree on.
    Expert groups use their own (expert) mesh, so expert-parallel ranks keep their
    own experts. The compute weights are rebuilt at the next forward. A
    collective: every rank calls it.
    """
    state = sharded_state(model)
    wanted = None if axes is None else ([axes] if isinstance(axes, str) else list(axes))
    if wanted is not None:
        known = {name for group in state.groups for name in group.plan.placements} | set(state.plan.placements)
        unknown = [a for a in wanted if a not in known]
        if unknown:
            raise ValueError(f"axes {unknown} are not data-parallel axes of the model; it has {sorted(known)}")
    for group in state.groups:
        plan = group.plan
        for name, placement in plan.placements.items():
            axis = plan.axes[name]
            if (wanted is None or name in wanted) and axis.size > 1 and isinstance(placement.optimizer, Replicate):
                group.broadcast_main_weights(axis)
    state.mark_weights_modified()
    if state.weight_watch is not None:  # the replicas agree now: nothing to say at the first forward
        state.weight_watch.forget_differing()


def shard_like(param: DTensor, full: torch.Tensor) -> DTensor:
    """This rank's piece of the global tensor ``full``, laid out like the sharded ``param`` (no communication)."""
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"cannot load a tensor of shape {tuple(full.shape)} into a parameter of shape {tuple(param.shape)}")
    value = full.detach().to(device=param.to_local().device, dtype=param.dtype)
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)


def load_full_state_dict(model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True):
    """``model.load_state_dict`` for values that are the model's DTensors or full (unsharded) tensors.

    Each full tensor of a parameter is cut to this rank's piece locally (no
    communication), so every rank may load the same full checkpoint; the compute
    weights are rebuilt at the next forward. Returns what ``load_state_dict`` returns.
    """
    sharded_state(model)
    params = dict(model.named_parameters(remove_duplicate=False))  # tied aliases too
    converted = {}
    for key, value in state_dict.items():
        param = params.get(key)
        if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = shard_like(param, value)
        converted[key] = value
    return model.load_state_dict(converted, strict=strict)
