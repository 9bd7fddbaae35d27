"""The step controller: the hooks that schedule a sharded model (gather, free, reduce) and the step's phase.

A unit's pre-forward gathers its parameters (and starts gathering the next
unit's); its post-forward frees them (not during activation recompute). Hooks
on the unit's outputs gather it again when backward reaches it; an autograd
function on its inputs fires once its backward is done and reduces its
gradients. A callback queued on the autograd engine finishes whatever is left
when backward ends: the root's own gradients, waits, ``.grad`` installation.

The step's phase is one value (:class:`Phase`, FSDP2's ``TrainingState`` in its
own names), moved in one place (:meth:`StepController._move`), which names the
phase it expected to leave when a move comes from another. Every end of a
gradient window, whatever asked for it (:class:`WindowEnd`), goes through
:meth:`StepController.end_window`. docs/design.md, "The step controller".
"""

from __future__ import annotations

import contextlib
import enum
from typing import Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.autograd.profiler import record_function

from .backward_steps import BackwardSteps
from .collectives import InFlight, StreamSet
from .param_group import GradState, ParamGroup
from .mesh import ShardingPlan
from .param_adoption import adopt_module_params
from .step_checks import check_gathered_weights_current, check_materialized
from .unit import Unit

__all__ = ["Phase", "StepController", "WindowEnd", "opaque_to_compiler"]


class Phase(enum.Enum):
    """Where one wrapped model's step is: FSDP2's ``TrainingState``, with a phase for a finished window."""

    IDLE = "idle"  # no step under way: before the first forward, after a reset or a window left open (no_sync)
    FORWARD = "forward"  # inside the root's grad-enabled forward (a no-grad forward is no step phase)
    AWAITING_BACKWARD = "awaiting_backward"  # a forward's backward (or the rest of one) still to come: PRE_BACKWARD
    BACKWARD = "backward"  # a backward of the model under way: its end is queued on autograd's engine
    REDUCED = "reduced"  # a window ended: its gradients reduced and installed as ``.grad``, weights freed


class WindowEnd(enum.Enum):
    """Why a gradient window ends: the reason given to :meth:`StepController.end_window`."""

    BACKWARD = "backward"  # a backward through the root's outputs ended (autograd's final callback)
    PARTIAL_BACKWARD = "partial_backward"  # a backward that did not pass through them (a chunked loss's head)
    WEIGHT_PASS = "weight_pass"  # model_ops.reduce_weight_grads: after a split backward's weight pass
    ACCUMULATION = "accumulation"  # model_ops.finish_grad_accumulation: the micro-batches' no_sync sum
    MANUAL = "manual"  # FSDP2's _root_post_backward_final_callback called by hand (torch's pipeline stage)


# Ends asked for by hand, outside any backward: the public name a user called, and what must have returned first.
_BY_HAND = {
    WindowEnd.WEIGHT_PASS: ("reduce_weight_grads", "the weight pass"),
    WindowEnd.ACCUMULATION: ("finish_grad_accumulation", "the last micro-batch's backward"),
    WindowEnd.MANUAL: ("_root_post_backward_final_callback", "the backward"),
}


def opaque_to_compiler(fn: Callable) -> Callable:
    """``fn`` wrapped so ``torch.compile`` never traces into it.

    A compiled region that reaches it calls it as a whole, eagerly, with
    compilation off for everything it calls: the engine's hooks gather, free
    and reduce through collectives, streams and storage resizes that a graph
    cannot hold. Hooks registered this way cost a compiled unit nothing when
    only its ``forward`` is compiled (``shardwise.compile_units``): they run
    around the compiled code, never inside it.
    """
    return torch.compiler.disable(fn, recursive=True, reason="shardwise hooks run eagerly, outside compiled graphs")


_UNLABELLED = contextlib.nullcontext()


def _label(name: str):
    """``record_function(name)`` while a profiler records (its trace then shows the step's gathers, reductions
    and window ends as ``shardwise.*`` ranges), else nothing: an unwatched label still costs a dispatcher call
    each, a few microseconds, a few per unit and step. Compile-friendly either way (the hooks run eagerly)."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _UNLABELLED


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs whose backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx, state, unit, recompute, *inputs):
        ctx.state, ctx.unit, ctx.recompute = state, unit, recompute
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.state.post_backward_hook(ctx.unit, ctx.recompute)
        return (None, None, None) + grads


class StepController:
    """Everything one ``fully_shard`` call created, and the hook logic."""

    def __init__(self, root: Unit, units: list[Unit], plan: ShardingPlan, streams: StreamSet, prefetch: bool):
        self.root = root
        root.is_root = True
        for unit in units:
            unit.is_root = False
        self.units = units
        self.plan = plan
        self.streams = streams
        self.prefetch = prefetch
        # The step's phase (Phase); moved only by _move. The attributes below it are modes a caller sets
        # around a step (sync_grads, defer_reduction, is_last_backward) or once-only set-up facts.
        self.phase = Phase.IDLE
        self._backward_in_forward = False  # a backward that began inside the forward returns to FORWARD
        self.sync_grads = True
        self.forward_order: list[Unit] = []
        self._order_index: dict[int, int] = {}
        self.order_recorded = False
        self.patched_hooks_read = False  # all-gather hooks patched onto the sharded locals, read at the first forward
        self.in_flight: list[tuple[ParamGroup, InFlight]] = []
        # id(group) -> optimizer stepped as soon as the group's grads are final (see
        # shardwise.engine.optim.BackwardOptimizer); empty for the usual optimizer.step() loop.
        self.backward_optimizers: dict[int, torch.optim.Optimizer] = {}
        self.backward_steps = BackwardSteps(streams)
        # A split backward's input pass (a zero-bubble pipeline schedule): the weight gradients come
        # in a later pass, so no unit reduces in this one (see reduce_weight_grads).
        self.defer_reduction = False
        # Whether this backward came through the root's outputs. A backward that did not (torchtitan's chunked
        # loss runs one per chunk through the output head alone) reduces only the units it reached.
        self.root_in_backward = False
        # FSDP2's set_is_last_backward, kept for what reads it: every backward's end waits for its reductions here
        self.is_last_backward = True
        self.post_optim_event = None  # FSDP2's set_post_optim_event: the next gathers wait on it
        self.hook_handles: list = []  # removed when an ancestor's fully_shard adopts these units
        self.applying = False  # inside a unit's nn.Module._apply (to_empty, to, ...): adopt once, at the outermost
        self.weight_watch = None  # weight_origin.WeightWatch: weights not to be trusted until written (fully_shard's)
        # Every hook is opaque to torch.compile, made once: a compiled region that reaches one
        # (the module's forward hooks, autograd's callbacks under a compiled backward) runs it
        # eagerly and whole. The forward hooks shadow the methods, so fully_shard registers these.
        for name in ("root_pre_forward", "root_post_forward", "unit_pre_forward", "unit_post_forward"):
            setattr(self, name, opaque_to_compiler(getattr(self, name)))
        self._root_pre_backward_hook = opaque_to_compiler(self.on_root_pre_backward)
        self._unit_pre_backward_hooks = {
            id(u): opaque_to_compiler(lambda grad, unit=u: self.on_unit_pre_backward(unit)) for u in units
        }
        self._finish_backward_callback = opaque_to_compiler(self._on_backward_end)
        self.post_backward_hook = opaque_to_compiler(self.on_post_backward)

    @property
    def graph_safe(self) -> bool:
        """Whether the model was wrapped with ``graph_safe=True`` (static buffers; see ``shardwise.engine.graph_safe``)."""
        return self.streams.graph_safe

    @property
    def all_units(self) -> list[Unit]:
        return self.units + [self.root]

    @property
    def groups(self) -> list[ParamGroup]:
        return [g for u in self.all_units for g in u.groups]

    # ---------------------------------------------------------------- phase
    def _move(self, to: Phase, *leaving: Phase) -> None:
        """The one place the step's phase changes: to ``to``, from one of ``leaving``."""
        self._expect(f"the step moved to {to.name}", *leaving)
        self.phase = to

    def _expect(self, what: str, *phases: Phase) -> None:
        """Raise unless the step is in one of ``phases``: a bug of the engine's, named here rather than left to
        show as wrong gradients."""
        if self.phase not in phases:
            raise RuntimeError(f"shardwise internal error: {what} in phase {self.phase.name}, expected "
                               f"{' or '.join(p.name for p in phases)}; please report it with the model")

    # ------------------------------------------------------------- ordering
    def _neighbour(self, unit: Unit, step: int) -> Unit | None:
        i = self._order_index.get(id(unit))
        if i is None or not 0 <= i + step < len(self.forward_order):
            return None
        return self.forward_order[i + step]

    # ------------------------------------------------------------ lazy init
    # FSDP2 fixes which state is a root at its first forward (``FSDPState._lazy_init``): the first state whose
    # forward runs becomes a root and every state below its module a non-root. shardwise knows its root from the
    # calls; it keeps the same per-unit fact (``Unit.role_fixed``) only to refuse, on FSDP2's face
    # (``Unit.fsdp2_refusals``), the two programs FSDP2 refuses there, at the same forward.
    def _names(self, modules: list[nn.Module]) -> list[str]:
        """Where ``modules`` sit under this state's root (a list root's modules: ``0``, ``1``, ...)."""
        roots = self.root.modules
        names = {}
        for i, root in enumerate(roots):
            prefix = f"{i}." if len(roots) > 1 else ""
            for name, m in root.named_modules():
                names.setdefault(id(m), f"{prefix}{name}".rstrip(".") or "<root>")
        return [names.get(id(m), type(m).__name__) for m in modules]

    def _refuse_several_roots(self, unit: Unit) -> None:
        """FSDP2's refusal of a ``fully_shard([a, b, ...])`` state whose forward makes it a root."""
        if unit.fsdp2_refusals and len(unit.modules) > 1:
            raise RuntimeError(
                f"FSDP requires a single root module but got {len(unit.modules)} modules "
                f"{[f'{n} ({type(m).__name__})' for n, m in zip(self._names(unit.modules), unit.modules)]} "
                "(FSDP2's refusal): the unit of one fully_shard([...]) call over "
                "several modules ran forward before any unit enclosing them, which makes it a root, and a root is "
                "one module. Call fully_shard on a module that holds them all as well (fully_shard(model) after "
                "the list call) and run the forward through that module")

    def lazy_init(self, unit: Unit) -> None:
        """FSDP2's lazy init of ``unit`` as a root: the root's first forward, or a unit's own forward before that
        one (FSDP2 then makes the unit a root of its own). The roles of ``unit`` and of every unit below its
        module are fixed from now on. Refused on FSDP2's face, as FSDP2 refuses it: a root over several modules,
        and a unit below whose role an earlier forward already fixed (a forward of its own, or of a unit above
        it, before this one), named by its path in ``unit``'s ``named_modules()`` order, the first found."""
        if unit.role_fixed:
            return
        self._refuse_several_roots(unit)
        by_module = {id(m): u for u in self.all_units if u is not unit for m in u.modules}
        below: dict[int, Unit] = {}
        for name, m in unit.module.named_modules():
            other = by_module.get(id(m))
            if other is None or id(other) in below:
                continue
            if other.role_fixed and unit.fsdp2_refusals:
                top = "the root module" if unit is self.root else repr(self._names([unit.module])[0])
                raise RuntimeError(
                    f"FSDP state has already been lazily initialized for {name}\n"
                    "FSDP requires running forward through the root module first (FSDP2's refusal): the unit "
                    f"{name!r} ran forward before the first forward through {top}, the unit above it, and was "
                    f"made a root then. Run one forward through {top} first; after it, calling {name!r} by "
                    "itself is fine")
            below[id(other)] = other
        for u in [unit, *below.values()]:
            u.role_fixed = True

    # ---------------------------------------------------------------- root
    def root_pre_forward(self, module, args, kwargs):
        if _in_backward():
            return args, kwargs
        self.lazy_init(self.root)  # FSDP2's lazy init: first of all, as FSDP2's
        self.adopt_module_params()
        check_materialized(self)  # once: a module left on the meta device is named, not a device mismatch
        if not self.patched_hooks_read:  # FSDP2 reads all-gather hooks patched onto the local tensors here, once
            for g in self.groups:
                g.read_patched_hooks()
            self.patched_hooks_read = True
        check_gathered_weights_current(self.all_units)  # a unit left gathered across a step would read old weights
        if self.weight_watch is not None and self.weight_watch.armed:  # the first forward (weight_origin)
            self.weight_watch.check(self.root.module)
        if torch.is_grad_enabled():
            if self.phase is Phase.BACKWARD:  # its end never came: autograd runs no final callback after a raise
                raise RuntimeError("a forward of the model began while its last backward had not ended (a backward "
                                   "that raised leaves it so); call model.reset_iter_state() after catching the error")
            self._move(Phase.FORWARD, Phase.IDLE, Phase.REDUCED, Phase.AWAITING_BACKWARD,
                       Phase.FORWARD)  # (FORWARD: a forward that raised, left so until the next)
            self.root.ran_with_grad = True
        self._wait_post_optim_event()
        args, kwargs = self._cast_inputs(self.root, args, kwargs)
        for g in self.groups:
            g.refresh_model_weights()
        with _label("shardwise.gather"):
            self.root.start_unshard()
            if self.prefetch and self.order_recorded and self.forward_order:
                self.forward_order[0].start_unshard()  # queued behind the root's gather
            self.root.unshard()
        return args, kwargs

    def root_post_forward(self, module, args, output):
        if _in_backward():
            return output
        output = self._cast_output(self.root, output)
        for unit in self.units:  # a unit some of whose modules did not run (fully_shard([norm, head]), head later)
            if unit.in_forward:
                self._end_unit_forward(unit)
        self.root.end_forward()
        if not self.order_recorded and self.forward_order:
            self.order_recorded = True
        hooked = torch.is_grad_enabled() and self._hook_outputs(output, self._root_pre_backward_hook)
        if not hooked:  # nothing will run backward through this forward
            for unit in self.all_units:
                unit.reshard()
        if self.phase is Phase.FORWARD:  # (a no-grad forward never entered it)
            self._move(Phase.AWAITING_BACKWARD if hooked else Phase.IDLE, Phase.FORWARD)
        return output

    def on_root_pre_backward(self, grad):
        self.root_in_backward = True
        self._queue_final_callback()
        # Another micro-batch's backward may have ended since this forward (a pipeline
        # schedule runs several forwards before their backwards) and freed the root's
        # weights: gather them again (nothing to do when they are still there).
        self.root.finish_unshard()
        if self.prefetch and self.forward_order:
            last = self.forward_order[-1]  # the first unit backward needs: gather it under the loss's backward
            if last.ran_with_grad and not last.gathered_for_backward and last.settings.unshard_in_backward:
                last.start_unshard()

    # ---------------------------------------------------------------- units
    def unit_pre_forward(self, unit: Unit, module, args, kwargs):
        recompute = _in_backward()
        entering = recompute or not unit.in_forward  # the first of the unit's modules to run in this forward
        if entering and not recompute:
            if not unit.role_fixed:  # its forward before the root's first: FSDP2 makes it a root of its own
                self.lazy_init(unit)
            unit.in_forward = True
            unit.modules_to_run = {id(m) for m in unit.modules}
        args, kwargs = self._cast_inputs(unit, args, kwargs)
        with _label("shardwise.gather"):
            unit.unshard()
        if entering and not recompute:
            if not self.order_recorded:
                if id(unit) not in self._order_index:
                    self._order_index[id(unit)] = len(self.forward_order)
                    self.forward_order.append(unit)
            elif self.prefetch:
                for nxt in self._prefetch_targets(unit, forward=True):
                    nxt.start_unshard()
        if torch.is_grad_enabled():
            unit.ran_with_grad = True
            flat, spec = pytree.tree_flatten((args, kwargs))
            positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
            if positions and entering:
                outs = _PostBackward.apply(self, unit, recompute, *[flat[i] for i in positions])
                for i, t in zip(positions, outs):
                    flat[i] = t
                if not recompute:
                    unit.pending_backward += 1
                args, kwargs = pytree.tree_unflatten(flat, spec)
        elif self.phase is Phase.FORWARD and entering and not recompute:  # inside the root's grad-enabled forward
            unit.expected_recompute += 1
        return args, kwargs

    def unit_post_forward(self, unit: Unit, module, args, output):
        output = self._cast_output(unit, output)
        if not _in_backward():
            unit.modules_to_run.discard(id(module))
            if unit.in_forward and not unit.modules_to_run:  # the last of the unit's modules to run
                self._end_unit_forward(unit)
        if torch.is_grad_enabled():
            self._hook_outputs(output, self._unit_pre_backward_hooks[id(unit)])
        return output

    def _end_unit_forward(self, unit: Unit) -> None:
        unit.in_forward = False
        unit.modules_to_run = set()
        unit.end_forward()

    def on_unit_pre_backward(self, unit: Unit) -> None:
        self._queue_final_callback()
        if unit.settings.unshard_in_backward:
            with _label("shardwise.gather"):
                unit.unshard()  # a no-op when still gathered (explicit unshard(), no reshard after forward)
        if unit.gathered_for_backward:
            return
        unit.gathered_for_backward = True
        if self.prefetch:
            for prev in self._prefetch_targets(unit, forward=False):
                if prev.ran_with_grad and not prev.gathered_for_backward and prev.settings.unshard_in_backward:
                    prev.start_unshard()

    def on_post_backward(self, unit: Unit, recompute: bool) -> None:
        # A non-reentrant recompute's autograd function never runs backward, so only
        # the original forward and reentrant re-runs are counted.
        if recompute:
            unit.expected_recompute -= 1
        else:
            unit.pending_backward -= 1
        if unit.pending_backward > 0 or unit.expected_recompute > 0 or unit.reduced:
            if not unit.reduced:
                unit.stash_unsynced_grads()
            return
        if not self.defer_reduction and unit.settings.requires_gradient_sync:
            self._reduce(unit)
        else:
            unit.stash_unsynced_grads()
        if unit.settings.reshard_after_backward:
            unit.reshard()

    def _reduce(self, unit: Unit) -> None:
        # Let the compute stream catch up with the previous reduction before its
        # flat buffer is released; it has had a whole unit's backward to finish.
        self._land_in_flight()
        with _label("shardwise.reduce"):
            self.in_flight = unit.reduce_grads(finalize=self.sync_grads and unit.settings.requires_all_reduce)

    def _land_in_flight(self) -> None:
        """Wait for the reductions in flight; step the groups that have a backward optimizer."""
        for group, flight in self.in_flight:
            flight.wait()
            optimizer = self.backward_optimizers.get(id(group))
            if optimizer is not None and self.sync_grads:  # beside the rest of the backward
                self.backward_steps.submit(group, optimizer)
        self.in_flight = []

    # ------------------------------------------------------- end of backward
    def _queue_final_callback(self) -> None:
        if self.phase is not Phase.BACKWARD:  # the first backward hook of this backward
            self._backward_in_forward = self.phase is Phase.FORWARD  # (torch.autograd.grad inside the forward)
            self._move(Phase.BACKWARD, Phase.IDLE, Phase.FORWARD, Phase.AWAITING_BACKWARD, Phase.REDUCED)
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward_callback)

    def _on_backward_end(self) -> None:
        """Autograd's final callback. A backward that did not pass through the root's outputs is partial (a
        chunked loss's head, the rest still to come) only where the root ran a forward it awaits; a unit called
        on its own (its forward outside the root's, as FSDP2 allows) ends its whole step here."""
        whole = self.root_in_backward or not self.root.ran_with_grad
        self.root_in_backward = False
        self.end_window(WindowEnd.BACKWARD if whole else WindowEnd.PARTIAL_BACKWARD)

    # ------------------------------------------------- the end of a gradient window
    def end_window(self, reason: WindowEnd) -> None:
        """End the gradient window, for ``reason``: the one road every ending takes (docs/design.md, "The step
        controller"). Start the reductions left to the end, land every reduction in flight (a backward
        optimizer steps what lands), install ``.grad`` where the window was finalized, reshard, forget the
        iteration's bookkeeping, and move the phase on: REDUCED when ``.grad`` was installed, AWAITING_BACKWARD
        while a backward (or its weight pass) is still to come, else IDLE."""
        if reason in _BY_HAND:
            if self.phase is Phase.BACKWARD:
                if reason is WindowEnd.MANUAL:
                    return  # inside a backward: its own end does this
                name, first = _BY_HAND[reason]
                raise RuntimeError(f"{name} was called during a backward of the model; call it after {first} "
                                   "has returned")
            leaving = tuple(p for p in Phase if p is not Phase.BACKWARD)
        else:
            leaving = (Phase.BACKWARD,)
        self._expect(f"the gradient window ended ({reason.value})", *leaving)
        deferred = reason is WindowEnd.BACKWARD and self.defer_reduction  # the weight pass will reduce
        previous = self.sync_grads
        if reason is WindowEnd.ACCUMULATION:
            self.sync_grads = True  # the window is finalized, and the backward optimizers step on what lands
        installs = not deferred and (reason is WindowEnd.ACCUMULATION or (
            self.sync_grads and reason in (WindowEnd.BACKWARD, WindowEnd.MANUAL)))
        try:
            with _label(f"shardwise.end_window.{reason.value}"):
                self._close_window(reason, deferred, installs)
        finally:
            self.sync_grads = previous
            if self._backward_in_forward and reason not in _BY_HAND:
                to = Phase.FORWARD  # the forward this backward ran inside goes on
            elif reason is WindowEnd.PARTIAL_BACKWARD or deferred:
                to = Phase.AWAITING_BACKWARD
            elif installs:
                to = Phase.REDUCED
            else:  # the window stays open (no_sync); a pipeline's other micro-batches may still owe a backward
                to = Phase.AWAITING_BACKWARD if any(u.pending_backward for u in self.all_units) else Phase.IDLE
            self._backward_in_forward = False
            self._move(to, *leaving)

    def _close_window(self, reason: WindowEnd, deferred: bool, installs: bool) -> None:
        """:meth:`end_window`'s work, in its order."""
        # 1. the reductions left to the window's end
        if reason is WindowEnd.BACKWARD and not deferred:
            self._reduce_left()
        elif reason is WindowEnd.WEIGHT_PASS:  # what the weight pass wrote on the gathered parameters
            for unit in self._reduce_order():
                if any(g.has_unsharded_grads() for g in unit.groups):
                    self._reduce(unit)
        elif reason is WindowEnd.ACCUMULATION:  # the windows the micro-batches left open, finalized
            for unit in self.all_units:
                self.in_flight.extend(unit.finalize_idle_groups())
        # 2. every reduction landed; every group stepped before anything reads weights or grads again
        if not deferred:
            self._land_in_flight()
            self.backward_steps.join()
        if reason is WindowEnd.BACKWARD and not deferred:
            self._check_no_late_grads()
        # 3. .grad installed, weights freed, the iteration's bookkeeping forgotten
        if reason is WindowEnd.PARTIAL_BACKWARD:  # only the units it reached; the others' forwards await the rest
            for unit in self.all_units:
                if unit.reduced:
                    if self.sync_grads:
                        unit.install_grads()
                    if unit.settings.reshard_after_backward:
                        unit.reshard()
                else:
                    unit.stash_unsynced_grads()
                unit.reset_iteration(keep_forward_counts=True, keep_forward_state=not unit.reduced)
            return
        if reason is WindowEnd.ACCUMULATION:  # outside any step's forwards: every count goes (no reshard)
            for unit in self.all_units:
                unit.install_grads()
                unit.reset_iteration()
            self.streams.pool.clear()
            return
        if installs:
            for unit in self.all_units:
                unit.install_grads()
        for unit in self.all_units:
            if unit.settings.reshard_after_backward:
                unit.reshard()
            # Under no_sync other micro-batches' forwards may still await their backward (a
            # pipeline schedule): their counts stay; the step's end (sync) forgets stale ones.
            unit.reset_iteration(keep_forward_counts=not (self.sync_grads and unit.settings.requires_gradient_sync))
        self.streams.pool.clear()

    def _reduce_order(self) -> list[Unit]:
        """The units in the order a backward reaches them (reverse forward order; unseen units, then the root)."""
        ordered = list(reversed(self.forward_order)) + [u for u in self.units if id(u) not in self._order_index]
        return ordered + [self.root]

    def _reduce_left(self) -> None:
        """A whole backward's end: reduce every unit holding gradients not yet reduced."""
        for unit in self._reduce_order():
            if not unit.settings.requires_gradient_sync:  # FSDP2's no-sync: grads stay unsharded, accumulating
                unit.stash_unsynced_grads()
                continue
            # grads from a forward before the last backward's end count too (pipeline micro-batches)
            if (unit.ran_with_grad or any(g.has_unsharded_grads() for g in unit.groups)) and not unit.reduced:
                self._reduce(unit)
            elif (unit.settings.extra.get("reduce_scatter_unused_params") and self.sync_grads and not unit.reduced
                  and all(g.grad_state is GradState.IDLE for g in unit.trainable_groups)):
                self._reduce(unit)  # FSDP2 reduces a unit that did not run as zeros, and hands them out
            elif not unit.ran_with_grad and self.sync_grads and unit.settings.requires_all_reduce:
                self.in_flight.extend(unit.finalize_idle_groups())

    def _check_no_late_grads(self) -> None:
        late = [u.name for u in self.all_units if u.settings.requires_gradient_sync
                and any(g.has_unsharded_grads() for g in u.groups)]
        if late:
            raise RuntimeError(
                f"gradients reached units {late} after their gradients were reduced in this backward; "
                "this happens when a unit's backward runs in pieces the hooks cannot see "
                "(a custom autograd path around the unit); please report it with the model"
            )

    # ------------------------------------------------------------- helpers
    def _prefetch_targets(self, unit: Unit, forward: bool) -> list[Unit]:
        """The units to start gathering once ``unit`` starts: the ones set with FSDP2's
        ``set_modules_to_{forward,backward}_prefetch``, else the neighbour in the recorded order."""
        chosen = unit.settings.forward_prefetch if forward else unit.settings.backward_prefetch
        if chosen is not None:
            return chosen
        neighbour = self._neighbour(unit, +1 if forward else -1)
        return [] if neighbour is None else [neighbour]

    @staticmethod
    def _cast_inputs(unit: Unit, args, kwargs):
        policy = unit.settings.policy
        return (args, kwargs) if policy is None else policy.cast_inputs(args, kwargs)

    @staticmethod
    def _cast_output(unit: Unit, output):
        policy = unit.settings.policy
        return output if policy is None else policy.cast_output(output)

    def _wait_post_optim_event(self) -> None:
        event, self.post_optim_event = self.post_optim_event, None
        if event is None or self.streams.gather is None:  # CPU: the optimizer step already returned
            return
        self.streams.gather.wait_event(event)
        # Kept weights (``persistent_unsharded``: replicated, or the one-rank model shard itself) are read, and
        # refreshed, on this stream with no gather between: it waits for the optimizer's writes itself.
        if any(g.persistent_unsharded for g in self.groups):
            torch.cuda.current_stream().wait_event(event)

    def reset_iteration_state(self) -> None:
        """After a forward or backward that raised: forget the step's bookkeeping and its unreduced grads."""
        self.in_flight = []
        self.root_in_backward = self._backward_in_forward = False
        self.phase = Phase.IDLE  # from any phase: the step is forgotten
        for unit in self.all_units:
            unit.modules_to_run.clear()
            unit.reshard()
            unit.reset_iteration()
            for group in unit.groups:
                group.discard_unsharded_grads()
        self.streams.pool.clear()

    @staticmethod
    def _hook_outputs(output, hook: Callable) -> bool:
        hooked = False
        for t in pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(hook)
                hooked = True
        return hooked

    def adopt_module_params(self, deep: bool = False, strict_dtype: bool = False) -> None:
        """Take parameters the user replaced in the modules (``load_state_dict(assign=True)``, ``to_empty``,
        setattr) into the engine (``param_adoption``) instead of training tensors forward never reads. Every
        root forward checks identities (cheap); ``deep`` (after ``_apply`` and loads) also storage."""
        for g in self.groups:
            adopt_module_params(g, deep, strict_dtype)

    def after_load_state_dict(self) -> None:
        self.adopt_module_params(deep=True)
        self.mark_weights_modified()

    def reduce_unit_now(self, unit: Unit) -> None:
        """FSDP2's ``FSDPParamGroup.post_backward`` called by hand (torch's pipeline stage at its reduce-grad
        point): reduce what the unit's gathered parameters accumulated. ``end_window(WindowEnd.MANUAL)`` ends
        the window after it (FSDP2's ``_root_post_backward_final_callback`` called by hand)."""
        if any(g.has_unsharded_grads() for g in unit.groups) and not unit.reduced:
            self._reduce(unit)
        if unit.settings.reshard_after_backward:
            unit.reshard()

    def mark_weights_modified(self) -> None:
        for g in self.groups:
            g.mark_weights_stale()

    def remake_buffers_in_capture(self) -> None:
        """Graph-safe mode, right before ``capture_step`` captures (nothing in flight): the kept gradient and
        staging buffers the eager warm-up made are let go, so the captured step makes them inside the graph's
        memory pool, sharing it with the step's activations as a plain module's gradients do."""
        self._land_in_flight()
        for g in self.groups:
            g.forget_kept_grad_buffers()
        self.streams.pool.forget()

