"""A parameter group's gradient window: from a step's first reduction to the ``.grad`` the optimizer reads.

A window opens at the first reduction of a step (``reduce``), accumulates
micro-batches (``no_sync``) at the gradient level, is finalized at the
optimizer level when the last one syncs, and is installed as the sharded
parameters' ``grad_attr`` (``install``). The buffers live only as long as
the ``.grad`` DTensors that view them: once ``optimizer.zero_grad()`` drops
those, the next window allocates afresh and its first reduction overwrites
(no zero-fill); grads the user kept are accumulated onto. An offloaded
group streams the finished shard to the host right behind its reduction.
Which parameters get ``.grad`` is FSDP2's rule (``grad_presence``); gradients
that wait unsharded between reductions accumulate in the comm dtype, as FSDP2's
do (``unsynced_grads``).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from .collectives import InFlight, replicas_reduce_first
from .distributed_buffer import BufferState, DistributedBuffer
from .grad_presence import GradPresence
from .unsynced_grads import UnsyncedGrads

__all__ = ["GradDtypes", "GradState", "GradWindow", "ReduceSettings"]


class GradState(enum.Enum):
    """Where a step's gradients are."""

    IDLE = "idle"  # nothing in progress; ``.grad`` (if set) holds the last finished gradients
    ACCUMULATING = "accumulating"  # micro-batches reduced into the accumulation buffer, window open
    REDUCED = "reduced"  # the window is finalized; the grads wait to be installed as ``.grad``


@dataclass(frozen=True)
class GradDtypes:
    """A group's dtypes, as its gradients see them."""

    main: torch.dtype  # the main weights' (``.grad`` must have it: main grads of another are handed out cast)
    main_grad: torch.dtype  # the finalized gradients'
    comm: torch.dtype  # the reductions' (and the unsynced accumulation's)
    compute: torch.dtype  # autograd's gradients'


@dataclass
class ReduceSettings:
    """What FSDP2's per-module setters change about a group's reductions after wrapping; the group's, shared by
    each window it makes. ``grad_scale`` multiplies the reduced gradients (the plan's mean over the
    data-parallel ranks, or ``set_gradient_divide_factor``'s sum divided by the factor); ``all_reduce_hook``:
    ``set_all_reduce_hook``'s ``(hook, stream)``, called at each finished reduction."""

    grad_scale: float = 1.0
    all_reduce_hook: tuple | None = None


class GradWindow:
    """The gradients of one ``ParamGroup``, built from what they need of it: ``name`` (for errors), ``params``
    (``ShardedParam``: each parameter's rows), ``sharded_params`` / ``unsharded_params`` (the group's lists,
    shared: their entries may be replaced in place), ``levels`` (buffers, collectives), ``plan`` (the gradient
    and optimizer levels, the finalizing all-reduce's axes), ``streams``, ``dtypes`` (``GradDtypes``),
    ``reduction`` (``ReduceSettings``), ``sum_over_axes`` (model-parallel partial sums), ``host`` (the host
    memory of an offloaded group, else ``None``), ``graph_safe``, ``requires_grad``, ``on_install`` (called
    when ``.grad`` is handed out: the group's weights are then stale).

    ``state``: a ``GradState``. ``grad_acc``: the micro-batches' sum at the gradient level (Partial over
    the axes that reduce later), ``None`` outside a window. ``main_grad``: the finalized gradients at the
    optimizer level, until installed. ``main_grad_ref``: a weak reference to the flat main grads handed
    out (the ``.grad`` the user may keep across steps). ``released``: what the reduce stream may still
    read, kept alive by the next ``InFlight``. ``graph_safe_buffers``: graph-safe mode's kept buffers by kind
    (``main_grad``, ``grad_acc``, ``grad_copy``). ``grad_attr``: where grads are handed out (``grad``,
    or Megatron's ``decoupled_grad``, uncast); ``grad_aliases``: attributes of the gathered parameters
    that alias their ``.grad`` (Megatron's ``main_grad``), dropped with it. The offload branch:
    ``host_grad`` (the host buffer, reused), ``host_ready`` (the copy's event), ``host_kept`` (grads the
    user kept, added to at install). ``presence``: which parameters got a gradient in the window
    (``GradPresence``); ``unsynced``: gradients waiting unsharded for a later reduction (``UnsyncedGrads``).
    """

    def __init__(self, name: str, params: list, sharded_params: list, unsharded_params: list, levels, plan, streams,
                 dtypes: GradDtypes, reduction: ReduceSettings, sum_over_axes: list, host, graph_safe: bool,
                 requires_grad: bool, on_install: Callable[[], None]):
        self.name, self.params, self.levels, self.plan, self.streams = name, params, levels, plan, streams
        self.sharded_params, self.unsharded_params = sharded_params, unsharded_params
        self.dtypes, self.reduction, self.sum_over_axes = dtypes, reduction, sum_over_axes
        self.host, self.offloaded, self.graph_safe = host, host is not None, graph_safe
        self.requires_grad, self.on_install = requires_grad, on_install
        self.grad_level, self.opt_level = len(plan.grad_axes), len(plan.opt_axes)
        self.state = GradState.IDLE
        self.grad_acc: DistributedBuffer | None = None
        self.main_grad: DistributedBuffer | None = None
        self.main_grad_ref: weakref.ref | None = None
        self.released: tuple = ()
        self.graph_safe_buffers: dict[str, torch.Tensor] = {}
        self.grad_attr = "grad"
        self.grad_aliases: tuple[str, ...] = ()
        self.host_grad: torch.Tensor | None = None
        self.host_ready: "torch.cuda.Event | None" = None
        self.host_kept = None
        self.presence = GradPresence(len(params), [p.owner is not None and not p.mine for p in params])
        # graph-safe: the optimizer reads, after a replay that runs no Python, the .grad of every parameter
        self.presence.install_all = graph_safe
        self.unsynced = UnsyncedGrads()

    @property
    def grad_acc_flat(self) -> torch.Tensor | None:
        return None if self.grad_acc is None else self.grad_acc.flat

    @property
    def main_grad_flat(self) -> torch.Tensor | None:
        return None if self.main_grad is None else self.main_grad.flat

    def kept_main_grad(self) -> torch.Tensor | None:
        """The flat main grads last handed out, while the user still holds them."""
        return self.main_grad_ref() if self.main_grad_ref is not None else None

    def _open(self) -> None:
        """Start accumulating a step's gradients.

        The main-grad buffer lives only as long as the ``.grad`` DTensors that
        view it: once ``optimizer.zero_grad()`` drops them it is freed, and the
        next step allocates a fresh one that the first reduction overwrites
        (no zero-fill). Grads the user kept are accumulated onto.
        """
        if self.state is GradState.REDUCED:  # the engine installs every finalized window first
            raise RuntimeError(f"group {self.name}: a new accumulation window opened before the last one's "
                               "gradients were installed; please report it with the model")
        m = self.opt_level
        cleared = [getattr(p, self.grad_attr, None) is None for p in self.sharded_params]
        existing = self.main_grad_ref() if self.main_grad_ref is not None else None
        if self.offloaded:  # the host grads the user kept are added to at install time
            self.host_kept = None if all(cleared) or existing is None else (existing, cleared)
            existing = None
        if all(cleared) or existing is None or self.hands_out_copies:
            # (grads handed out as cast copies hold the earlier windows' sum themselves: install adds to them)
            self.main_grad = self._fresh("main_grad", m)  # the first reduction overwrites it
            self.main_grad_ref = weakref.ref(self.main_grad.flat)
        else:  # the kept grads, accumulated onto (those the user cleared restart from zero)
            self.main_grad = DistributedBuffer(self.levels, m, existing)
            for i, was_cleared in enumerate(cleared):
                if was_cleared:
                    self.main_grad.local(i).zero_()
        if self.levels.same_layout(self.grad_level, m):  # the same level, or one buffer with it in all but name
            self.grad_acc = self.main_grad
        else:  # a Partial accumulation buffer of its own, restarted every window
            self.grad_acc = self._fresh("grad_acc", self.grad_level)
        self.presence.reset()
        self.state = GradState.ACCUMULATING

    def _fresh(self, kind: str, level: int, dtype: torch.dtype | None = None) -> DistributedBuffer:
        """An ``EMPTY`` gradient buffer of ``level`` (``dtype``: the main grads' unless given): a new one, or in
        graph-safe mode the one this group made at its first window (kept for good: the same addresses every
        step, whoever drops ``.grad``)."""
        dtype = dtype or self.dtypes.main_grad
        if not self.graph_safe:
            return self.levels.empty(level, dtype)
        flat = self.graph_safe_buffers.get(kind)
        if flat is None:
            flat = self.graph_safe_buffers[kind] = self.levels.new(self.levels.layouts[level].total, dtype)
        return DistributedBuffer(self.levels, level, flat, BufferState.EMPTY)

    @property
    def has_unsharded_grads(self) -> bool:
        """Whether gradients wait for a reduction: on the gathered parameters, or accumulated apart."""
        return self.unsynced.waiting or any(p.grad is not None for p in self.unsharded_params)

    def stash_unsynced(self) -> None:
        """A post-backward that does not reduce: move the gathered parameters' gradients into the comm-dtype
        accumulator where their dtype is another (FSDP2's accumulation; ``unsynced_grads``). Megatron's
        ``main_grad`` alias (fused wgrad accumulation writes into ``.grad``) keeps autograd's own."""
        if self.grad_aliases:
            return
        comm = self.dtypes.comm
        self.unsynced.stash(self.unsharded_params, comm, lambda: self._fresh("unsynced", 0, comm))

    def _take_grads(self) -> list:
        """This backward's unsharded grads (``None`` where a parameter got none), taken off the parameters."""
        grads = []
        for param, sharded in zip(self.unsharded_params, self.params):
            grads.append(sharded.local_grad(param.grad))  # a DTensor's local tensor under an SPMD mesh
            param.grad = None
            for alias in self.grad_aliases:
                setattr(param, alias, None)
        return grads

    def _adds_in_place(self) -> bool:
        """Whether this micro-batch's grads go straight into the accumulation buffer, with no staged copy:
        every gradient axis has one rank (one GPU), so the reduction is the values themselves, and the buffer
        holds level 0's rows in a dtype the staged path would give the same result in: the comm dtype, or any
        dtype when the comm dtype holds the grads exactly (bf16 grads, fp32 comm: the staged copy is exact and
        the add rounds once either way; Megatron-LM's no-sync micro-batches, the bf16-main recipe)."""
        acc, dtypes = self.grad_acc, self.dtypes
        return (not self.unsynced.waiting and self.reduction.grad_scale == 1.0
                and self.levels.same_layout(0, self.grad_level)
                and (acc.flat.dtype == dtypes.comm or _holds_exactly(dtypes.comm, dtypes.compute))
                and not replicas_reduce_first(dtypes.comm, self.plan.finalize_allreduce_axes))

    def _add_in_place(self, finalize: bool) -> InFlight:
        """``reduce`` where :meth:`_adds_in_place`: the first micro-batch's grads loaded into the fresh buffer
        (zeros where missing), the later ones added, one kernel each, no staging."""
        grads = self._take_grads()
        self.presence.note([g is not None for g in grads])
        staged: list = []
        pairs = []
        with self.streams.on(self.streams.reduce):
            if self.grad_acc.state is BufferState.EMPTY:
                self.grad_acc.load(grads)
            else:
                pairs = [(local, g) for local, g in zip(self.grad_acc.locals(), grads) if g is not None]
                if pairs:
                    torch._foreach_add_([local for local, _ in pairs], [g for _, g in pairs])
            if finalize:
                self._finalize(staged)
        self.released = self.released + tuple(g for g in grads if g is not None)  # the reduce stream reads them
        return self._in_flight(staged)

    def _flat_unsharded(self, staged: list) -> DistributedBuffer:
        """The unsharded grads (zeros where missing) in one comm-dtype buffer, one kernel: the accumulation
        buffer itself when that is a fresh one of level 0 and this dtype (ZeRO-0/1), else a staged one; the
        waiting accumulator with this backward's grads added, when there is one."""
        grads = self._take_grads()
        if self.unsynced.waiting:  # FSDP2: the accumulated grad += this backward's, then reduced
            flat, held = self.unsynced.take(grads)
            self.presence.note([h or g is not None for h, g in zip(held, grads)])
            return flat
        acc = self.grad_acc
        flat = acc if acc.takes(0, self.dtypes.comm) else self.levels.staged(0, self.dtypes.comm, staged)
        flat.load(grads)
        self.presence.note([g is not None for g in grads])
        return flat

    def reduce(self, finalize: bool) -> InFlight:
        """Reduce this micro-batch's grads into the accumulation buffer; finalize at a step's end.

        Returns the in-flight work; the caller waits on it before the optimizer
        reads grads or before dropping the flat buffer it keeps alive.
        """
        if self.state is not GradState.ACCUMULATING:
            self._open()
        self.released = ()
        if self._adds_in_place():
            return self._add_in_place(finalize)
        staged: list = []
        acc = self.grad_acc
        own = self.unsynced.waiting  # the flat buffer will be the waiting accumulator
        flat = self._flat_unsharded(staged)
        with self.streams.on(self.streams.reduce):
            # the first micro-batch's reduction lands in the fresh accumulation buffer itself (when the
            # grads were loaded into it, ZeRO-0/1, it holds them already and takes nothing more)
            lands = self.grad_level > 0 and acc.takes(self.grad_level, flat.flat.dtype)
            shard = flat.reduce_scatter(self.grad_level, staged, into=acc if lands else None)
            replicas = self.plan.finalize_allreduce_axes  # FSDP2's HSDP in fp16: in that dtype, before the cast
            early = (finalize and shard is not acc and acc.takes(self.grad_level, acc.flat.dtype)
                     and not self.sum_over_axes and replicas_reduce_first(shard.flat.dtype, replicas))
            if early:
                shard.all_reduce(replicas)
            if self.reduction.grad_scale != 1.0:
                shard.flat.mul_(self.reduction.grad_scale)
            if shard is not acc:
                acc.accumulate(shard)
            if finalize:
                self._finalize(staged, replicas_done=early)
        if own:  # the waiting accumulator: the reduce stream may still read it
            self.released = self.released + (flat.flat,)
        return self._in_flight(staged)

    def _in_flight(self, staged: list) -> InFlight:
        event = self.streams.record(self.streams.reduce)
        if self.offloaded and self.state is GradState.REDUCED:
            self.host_ready = event  # the CPU may read the host grads once this has passed
        flight = InFlight(event, keepalive=self.released, staged=tuple(staged), pool=self.streams.pool)
        self.released = ()  # only the flight keeps them now: they go as soon as it is waited on
        return flight

    def finalize_without_new_grads(self) -> InFlight | None:
        """End an accumulation window whose last micro-batch brought no grads to this group."""
        if self.state is not GradState.ACCUMULATING:
            return None
        staged: list = []
        with self.streams.on(self.streams.reduce):
            self._finalize(staged)
        return self._in_flight(staged)

    def _finalize(self, staged: list, replicas_done: bool = False) -> None:
        acc, main_grad = self.grad_acc, self.main_grad
        if self.sum_over_axes:  # partial sums across model-parallel ranks (sequence parallel)
            acc.all_reduce(self.sum_over_axes, average=False)
        if acc is main_grad:
            if not replicas_done:
                main_grad.all_reduce(self.plan.finalize_allreduce_axes)
            self._call_all_reduce_hook(main_grad.flat)
        else:
            into = main_grad if main_grad.takes(self.opt_level, acc.flat.dtype) else None
            reduced = acc.reduce_scatter(self.opt_level, staged, into=into)
            if not replicas_done:
                reduced.all_reduce(self.plan.finalize_allreduce_axes)
            self._call_all_reduce_hook(reduced.flat)
            if reduced is not main_grad:
                main_grad.accumulate(reduced)
            # the reduce stream may still read it: the caller keeps it alive until it waits
            self.released = (acc.flat,)
        self.grad_acc = None
        self.state = GradState.REDUCED
        if self.offloaded:  # stream the finished shard to the host right behind its reduction
            numel, dtype = main_grad.flat.numel(), main_grad.flat.dtype
            if self.host_grad is None:
                self.host_grad = self.host.empty(numel, dtype)
            host = self.host_grad
            if self.host_kept is not None:  # the user kept last step's grads there: add to them at install
                host = torch.empty(numel, dtype=dtype)
            self.main_grad = main_grad.copy_to(host)
            self.released = self.released + (main_grad.flat,)
        self.presence.reduced_over(self.plan.axes.values())

    def _call_all_reduce_hook(self, flat: torch.Tensor) -> None:
        """FSDP2's ``set_all_reduce_hook``: the hook gets this step's reduced flat shard (after the replicas'
        all-reduce under HSDP; averaged, before it joins grads the user kept) and may change it in place; on
        its own stream when one was given (1-D meshes only), ordered after the reduction and before its use."""
        if self.reduction.all_reduce_hook is None:
            return
        hook, stream = self.reduction.all_reduce_hook
        if stream is None:
            hook(flat)
            return
        module = torch.get_device_module(flat.device.type)
        stream.wait_stream(module.current_stream())
        with module.stream(stream):
            hook(flat)
        module.current_stream().wait_stream(stream)

    def discard(self) -> None:
        """Drop installed grads and any accumulation still open (the next backward overwrites)."""
        for param in self.sharded_params:
            param.grad = None
            if self.grad_attr != "grad":
                setattr(param, self.grad_attr, None)
        self.drop_accumulation()
        self.host_ready = None
        self.host_kept = None

    def drop_accumulation(self) -> None:
        """Forget the unsharded parameters' gradients and the step's accumulation buffers."""
        for param in self.unsharded_params:
            param.grad = None
            for alias in self.grad_aliases:
                setattr(param, alias, None)
        self.unsynced.drop()
        self.presence.reset()
        self.grad_acc = None
        self.main_grad = None
        self.state = GradState.IDLE

    def forget_kept_buffers(self) -> None:
        """Graph-safe mode, before a capture: let the captured step make its kept gradient buffers again, inside
        the graph's memory pool (``.grad`` tensors still installed keep theirs: the step accumulates onto them).
        Made there at the first reduction of the captured backward, they may take memory forward's activations
        freed, as a plain module's gradients do; made by the eager warm-up, they sat beside forward's peak."""
        self.graph_safe_buffers.clear()

    @torch.no_grad()
    def zero_in_place(self) -> None:
        """Graph-safe mode's ``zero_grad``: zero the kept gradient buffer and the gradients handed out where
        they are, never drop them; the next window adds onto those zeros.

        A replayed graph runs no Python, so the ``.grad`` (or ``grad_attr``) tensors the optimizer reads
        after a replay must be the very tensors the captured step wrote: they stay installed for good.
        Also ends any ``no_sync`` accumulation left open, as :meth:`discard_grads` does.
        """
        self.drop_accumulation()
        flat = self.graph_safe_buffers.get("main_grad")
        handed = [getattr(p, self.grad_attr, None) for p in self.sharded_params]
        handed = [g._local_tensor if hasattr(g, "_local_tensor") else g for g in handed if g is not None]
        if flat is not None:
            flat.zero_()
            handed = [g for g in handed if g._base is not flat]  # views of the kept buffer: zeroed with it
        handed = [g for g in handed if g.numel()]
        if handed:
            torch._foreach_zero_(handed)

    def install(self) -> None:
        """Expose the finalized main grads as the sharded parameters' ``.grad``.

        Only the ``.grad`` DTensors keep the buffer alive from here on.
        """
        if self.state is not GradState.REDUCED:
            return
        if self.offloaded:
            self._install_host()
            return
        flat, attr = self.main_grad.flat, self.grad_attr
        if all(getattr(p, attr, None) is not None and getattr(p, attr)._local_tensor._base is flat
               for p in self.sharded_params):
            pass  # accumulated onto the grads already installed
        else:
            self._hand_out(self.main_grad.dtensors(), self.presence.present(self.main_grad.locals()))
        self.main_grad = None
        self.state = GradState.IDLE
        # An optimizer step on these grads may not show in any version counter: on CUDA, torch's
        # default (foreach) AdamW over DTensors moved none (2 x H200, torch 2.11), so the next
        # forward rebuilds the model weights whenever grads were handed out.
        self.on_install()

    def install_graph_safe(self) -> None:
        """Graph-safe mode: ``grad_attr`` views of the kept gradient buffer, or of the kept cast copies (after a
        replay, which runs no Python)."""
        flat = self.graph_safe_buffers.get("grad_copy" if self.hands_out_copies else "main_grad")
        if flat is None or not self.requires_grad:
            return
        for param, grad in zip(self.sharded_params, DistributedBuffer(self.levels, self.opt_level, flat).dtensors()):
            setattr(param, self.grad_attr, grad)

    @property
    def hands_out_copies(self) -> bool:
        """Whether ``.grad`` is a copy of the main grads cast to the main weights' dtype (``.grad`` must have its
        parameter's dtype), not a view of the main-grad buffer: then the copies, not the buffer, carry what earlier
        windows accumulated, and every window starts the buffer afresh."""
        return self.grad_attr == "grad" and self.dtypes.main_grad != self.dtypes.main

    def _hand_out(self, grads, present: list[bool]) -> None:
        """Set each sharded parameter's ``grad_attr`` to its main grad, where ``present`` (``grad_presence``):
        a parameter no rank gave a gradient keeps what it has (``None`` after ``zero_grad``).

        ``.grad`` must have its parameter's dtype: main grads of another dtype are
        handed out as a cast copy (the grads a user kept across steps are added to);
        graph-safe mode casts into a kept buffer, so the copies too keep their addresses.
        """
        if not self.hands_out_copies:
            for param, grad, here in zip(self.sharded_params, grads, present):
                if here or getattr(param, self.grad_attr, None) is not None:
                    setattr(param, self.grad_attr, grad)
            return
        copies = None  # graph-safe mode's kept copies, made only where some .grad was dropped
        for i, (param, grad) in enumerate(zip(self.sharded_params, grads)):
            if not present[i]:  # its reduced gradient is zeros: a kept .grad stays as it is
                continue
            if param.grad is not None:
                param.grad.add_(grad.to(self.dtypes.main))
            elif not self.graph_safe:
                param.grad = grad.to(self.dtypes.main)
            else:
                copies = copies or self._graph_safe_copies()
                copies[i].to_local().copy_(grad.to_local())
                param.grad = copies[i]

    def _graph_safe_copies(self) -> list:
        """Graph-safe mode's cast ``.grad`` copies: DTensor views of one buffer of the main weights' dtype, made once."""
        flat = self.graph_safe_buffers.get("grad_copy")
        if flat is None:
            flat = self.graph_safe_buffers["grad_copy"] = self.levels.new(
                self.levels.layouts[self.opt_level].total, self.dtypes.main)
        return DistributedBuffer(self.levels, self.opt_level, flat).dtensors()

    def _install_host(self) -> None:
        if self.host_ready is not None:
            self.host_ready.synchronize()  # the host copy has landed
            self.host_ready = None
        kept = self.host_kept
        if kept is not None:  # accumulate onto the grads the user did not clear
            existing, cleared = kept
            target = DistributedBuffer(self.levels, self.opt_level, existing)
            for i, was_cleared in enumerate(cleared):
                old, new = target.local(i), self.main_grad.local(i)
                if was_cleared:
                    old.copy_(new)
                else:
                    old.add_(new)
            self.main_grad = target
        self.host_kept = None
        if kept is None or any(getattr(p, self.grad_attr, None) is None for p in self.sharded_params):
            self._hand_out(self.main_grad.dtensors(), self.presence.present(self.main_grad.locals()))
        self.main_grad_ref = weakref.ref(self.main_grad.flat)
        self.main_grad = None
        self.state = GradState.IDLE
        self.on_install()


def _holds_exactly(wide: torch.dtype, narrow: torch.dtype) -> bool:
    """Whether every value of ``narrow`` is a value of ``wide`` (a cast there and back is the identity)."""
    if wide == narrow:
        return True
    if not (wide.is_floating_point and narrow.is_floating_point):
        return False
    w, n = torch.finfo(wide), torch.finfo(narrow)
    return w.bits >= n.bits and w.eps <= n.eps and w.max >= n.max and w.smallest_normal <= n.smallest_normal
