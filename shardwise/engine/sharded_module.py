"""``ShardedModule``: what ``fully_shard`` adds to the class of every module it makes a unit.

Like FSDP2, ``fully_shard`` swaps the module's class for a subclass of this
class and the original one, so ``isinstance(m, torch.distributed.fsdp.
FSDPModule)`` holds for every unit and code gated on it (torchtitan's gradient
division switch, its chunked loss, torch's pipeline stage) runs. Every public
``FSDPModule`` method of torch 2.11-2.13 is defined here, with FSDP2's meaning
for the unit it is called on (``recurse=True``: every unit in its subtree),
or refuses by name what the engine does not do. The model-level operations
(``no_sync``, ``zero_grad_buffer``, ...) act on the whole sharded model.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, UnshardHandle

from .process_group_alloc import comm_collectives, refuse_custom
from .step_controller import StepController
from .torch_fsdp_state import TorchStateView
from .torch_fsdp_state import install as install_torch_state_view
from .unit import Unit

__all__ = ["ShardedModule", "STATE_ATTR", "UNIT_ATTR", "make_fsdp_modules", "swap_class"]

STATE_ATTR = "_shardwise_state"  # on every module of every unit: the state of the model it belongs to
UNIT_ATTR = "_shardwise_unit"  # on every module of every unit: its unit


class _Unsharded(UnshardHandle):
    """``unshard(async_op=True)``'s handle: ``wait()`` finishes the gather and installs the full weights."""

    def __init__(self, unit: Unit | None):
        self._unit = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.unshard()
            self._unit = None


def _not_built(method: str, why: str) -> NotImplementedError:
    return NotImplementedError(f"FSDPModule.{method} is not built in shardwise: {why}")


class ShardedModule(FSDPModule):
    """Methods of a sharded unit (torch's ``FSDPModule``'s, for this engine)."""

    # [Sharded<Orig>, ShardedModule, FSDPModule, Orig, ...]: where torch's __new__ finds the original class
    _orig_cls_mro_index: int = 3

    def __deepcopy__(self, memo):
        # A copy would share the engine's buffers and hooks with the original (or fail inside torch's storage
        # copy): say so, with what to do instead (FSDP2 refuses deepcopy too).
        raise TypeError(
            f"copy.deepcopy of a sharded module ({type(self).__name__}, a fully_shard unit) is not supported: its "
            "parameters are views of the engine's shared buffers; copy the model before fully_shard, or build a "
            "new one and load shardwise.full_state_dict(model) (or torch's get_model_state_dict) into it")

    # ---------------------------------------------------------------- the engine's state
    @property
    def sharded_state(self) -> StepController:
        """The engine's state of the model this unit belongs to (units, parameter groups, plan)."""
        return getattr(self, STATE_ATTR)

    @property
    def _unit(self) -> Unit:
        return getattr(self, UNIT_ATTR)

    def _units(self, recurse: bool) -> list[Unit]:
        """This module's unit, and with ``recurse`` every unit whose modules are in its subtree."""
        if not recurse:
            return [self._unit]
        ids = {id(m) for m in self.modules()}
        return [u for u in self.sharded_state.all_units if any(id(m) in ids for m in u.modules)]

    # ---------------------------------------------------------------- FSDP2's methods
    def reshard(self) -> None:
        """Free this unit's gathered weights; the modules hold the sharded parameters again (not recursive)."""
        self._unit.reshard()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this unit's weights and point its modules at them (not recursive). ``async_op=True``
        returns a handle whose ``wait()`` finishes the gather."""
        unit = self._unit
        unit.start_unshard()
        handle = _Unsharded(unit)
        if async_op:
            return handle
        handle.wait()
        return None

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised: forget the step's state and its unreduced gradients."""
        self.sharded_state.reset_iteration_state()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        self.sharded_state.is_last_backward = bool(is_last_backward)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """``False``: gradients accumulate unsharded, with no communication, until set back to ``True``."""
        for unit in self._units(recurse):
            unit.settings.requires_gradient_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """``False`` (HSDP): reduce-scatter, but leave the all-reduce over replicas to a later backward."""
        for unit in self._units(recurse):
            unit.settings.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        if reshard_after_forward and self.sharded_state.graph_safe:
            raise ValueError("a graph-safe model keeps its gathered weights at rest: reshard_after_forward=True "
                             "would free nothing")
        for unit in self._units(recurse):
            unit.settings.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.settings.reshard_after_backward = bool(reshard_after_backward)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these units' weights when this unit's forward starts, instead of the next unit in order."""
        self._unit.settings.forward_prefetch = _units_of(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Gather these units' weights when this unit's backward starts, instead of the previous unit."""
        self._unit.settings.backward_prefetch = _units_of(modules, "set_modules_to_backward_prefetch")

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next forward's gathers wait on ``event`` (recorded after the optimizer step)."""
        self.sharded_state.post_optim_event = event

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Reduce this unit's gradients as a sum divided by ``factor`` (``1.0``: a plain sum), not the mean."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor({factor!r}): the factor must be positive")
        for group in self._unit.groups:
            group.reduction.grad_scale = group.plan.dp_size / float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """The older name of ``set_gradient_divide_factor``."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted: the engine divides after a SUM wherever the backend has no native average (gloo), and
        NCCL's AVG is a sum and one division too; the numbers are those of FSDP2's sum-then-divide."""
        self._unit.settings.extra["force_sum_reduction_for_comms"] = bool(enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """``True``: every trainable parameter gets ``.grad`` at a step's end (zeros where no rank used it, even in
        a unit that did not run, which FSDP2 then reduces too); ``False`` (FSDP2's default): only those some rank
        gave a gradient in the window. A group always reduces every parameter (unused ones as zeros), so ranks
        stay in step either way."""
        for unit in self._units(recurse):
            unit.settings.extra["reduce_scatter_unused_params"] = bool(reduce_scatter_unused_params)
            for group in unit.groups:
                group.window.presence.install_all = bool(reduce_scatter_unused_params) or group.graph_safe

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: backward does not gather this unit's weights (its backward must not read them)."""
        self._unit.settings.unshard_in_backward = bool(unshard_in_backward)

    def set_custom_all_gather(self, comm: Any) -> None:
        raise _not_built("set_custom_all_gather", "pass fully_shard(..., collectives=shardwise.Collectives "
                         "subclass) to replace how buffers travel")

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        raise _not_built("set_custom_reduce_scatter", "pass fully_shard(..., collectives=shardwise.Collectives "
                         "subclass) to replace how buffers travel")

    def set_all_reduce_hook(self, hook: Any, *, stream: Any = None) -> None:
        """FSDP2's: ``hook(reduced)`` runs on each of this unit's finished gradient reductions (the flat local
        shard, after the replicas' all-reduce under HSDP) and may change it in place; ``stream`` (1-D meshes
        only, as FSDP2) is where it runs."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook={hook!r} must be a callable (reduced: torch.Tensor) -> None")
        for group in self._unit.groups:
            if stream is not None and group.plan.finalize_allreduce_axes:
                raise ValueError("stream cannot be set when using native HSDP")
        for group in self._unit.groups:
            group.reduction.all_reduce_hook = (hook, stream)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        raise _not_built("set_reduce_scatter_max_input_buffers",
                         "the engine keeps one reduction in flight per group")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        raise _not_built("set_separate_reduce_scatter_group", "reductions use the mesh's process groups")

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """``True``: this unit's buffers made from now on (gathered weights, staging, gradients) come from its
        process groups' own memory where every data-parallel group's backend allocates tensors (NCCL: memory
        registered for zero-copy and SHARP collectives), and nothing changes where one does not (gloo); ``False``:
        PyTorch's allocator again. Not recursive, as FSDP2; the values are the same either way. A unit with its own
        ``fully_shard(collectives=...)`` raises ``AssertionError`` (``shardwise.engine.process_group_alloc``)."""
        method, groups = "set_allocate_memory_from_process_group_for_comm", self._unit.groups
        for group in groups:
            refuse_custom(method, group.collectives)
        for group in groups:
            group.use_collectives(comm_collectives(group.collectives, bool(enable), group.comm_groups,
                                                   group.target_device))
        self._unit.settings.extra["allocate_memory_from_process_group_for_comm"] = bool(enable)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise _not_built("set_symm_mem_for_comm", "symmetric-memory collectives (NCCL only) are not built in the "
                         "engine; its gathers and reductions use the mesh's process groups")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        pass  # the engine's gathers run on their own stream already

    def _get_fsdp_state(self) -> TorchStateView:
        """What ``torch.distributed.fsdp.register_fsdp_forward_method`` reads (``_pre_forward``/``_post_forward``)."""
        return TorchStateView(self, STATE_ATTR, UNIT_ATTR)

    def _apply(self, fn, recurse: bool = True):
        """``to_empty``, ``to``, ``cuda``, ``float``, ...: the engine follows the new storage (a meta-built
        model gets its buffers here) and a new dtype (the groups rebuilt in it, as FSDP2 casts its shards), or
        raises for a change it cannot follow (another device, a cast of part of a group)."""
        state = self.sharded_state
        outermost = not state.applying
        if outermost:
            for unit in state.all_units:
                unit.reshard()
        state.applying = True
        try:
            result = super(FSDPModule, self)._apply(fn, recurse)  # the original class's (FSDP2's reads its state)
        finally:
            state.applying = not outermost
        if outermost:
            state.adopt_module_params(deep=True, strict_dtype=True)
        return result

    def to_empty(self, *, device, recurse: bool = True):
        """FSDP2's ``to_empty``: the shards get fresh storage on ``device``; the engine then watches it until
        something writes it (``weight_origin``: the first forward names what is still uninitialised)."""
        result = super().to_empty(device=device, recurse=recurse)
        watch = self.sharded_state.weight_watch
        if watch is not None:
            watch.record_emptied(g for unit in self._units(recurse) for g in unit.groups)
        return result

    # ---------------------------------------------------------------- the whole model's
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


def _units_of(modules: list, method: str) -> list[Unit]:
    units = []
    for m in modules:
        if not isinstance(m, ShardedModule):
            raise ValueError(f"{method} takes modules that fully_shard made units, got {type(m).__name__}")
        units.append(m._unit)
    return units


def make_fsdp_modules(state: StepController) -> None:
    """Every module of every unit of ``state``: tied to its state and unit, answering torch's state reads,
    and an instance of ``Sharded<Class>`` (so of torch's ``FSDPModule``)."""
    for unit in state.all_units:
        for module in unit.modules:
            setattr(module, STATE_ATTR, state)
            setattr(module, UNIT_ATTR, unit)
            install_torch_state_view(module, STATE_ATTR, UNIT_ATTR)
            swap_class(module)


def swap_class(module: nn.Module) -> None:
    """Make ``module`` an instance of ``Sharded<Class>(ShardedModule, Class)`` (FSDP2's class swap)."""
    cls = module.__class__
    if isinstance(module, ShardedModule):
        return
    sharded = _CLASSES.get(cls)
    if sharded is None:
        sharded = _CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
    module.__class__ = sharded


_CLASSES: dict[type, type] = {}
