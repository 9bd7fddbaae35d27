"""One parameter group: its buffers and their lifecycle.

A group is the parameters of one unit that share a dtype and requires_grad.
Each buffer is a ``DistributedBuffer`` (``distributed_buffer``): one *level* of every
parameter's sharding (see ``layout``), one slot per parameter packed into a
flat tensor, and the transitions between levels:

- ``main``: the main weights (``main_params_dtype``) at the optimizer level;
  the sharded DTensor parameters the optimizer sees view their real rows.
  Where dtypes allow it lives inside ``model_shard`` (fp32 keeps one copy);
- ``model_shard``: the compute-dtype model weights at the parameter level;
- ``unsharded``: the full compute-dtype parameters forward and backward read
  (level 0); its storage is freed while the group rests when parameters are
  sharded;
- ``grad_acc`` / ``main_grad``: gradients accumulated at the gradient level
  across micro-batches, and finalized at the optimizer level.

A group of weights marked for an FP8 gather (``quantized_gather``) gathers uint8
e4m3 bytes into ``unsharded`` instead, cast from ``main`` with scales shared
over the axes, and its unsharded parameters wrap those bytes.

The buffers move themselves; the group decides when, on which stream, and
what stays alive until a flight is waited on. Its states: which parameters the
modules hold (``ModuleParams``), where the full weights are (``WeightState``),
whether the model weights follow the main weights (``RefreshState``), where a
step's gradients are (``GradState``).
"""

from __future__ import annotations

import enum
import weakref
from typing import Sequence

import torch
import torch.nn as nn

from .collectives import Collectives, InFlight, StreamSet
from .distributed_buffer import BufferState, DistributedBuffer, Levels
from .mesh import ShardingPlan
from .offload import HostMemory
from .sharded_param import ParamRef, ShardedParam
from .precision import MixedPrecisionPolicy
from .quantized_gather import QuantizedGather, gather_mark
from .replaced_params import mark_replaced

__all__ = ["SHARDED_MARK", "ParamRef", "ParamGroup", "ModuleParams", "WeightState", "RefreshState", "GradState"]


SHARDED_MARK = "_shardwise_sharded"  # set on every sharded DTensor parameter the engine hands out


class ModuleParams(enum.Enum):
    """Which parameters the modules that hold the group's parameters point at."""

    ORIGINAL = "original"  # their own, until the group installs its sharded parameters
    SHARDED = "sharded"  # the sharded DTensor parameters (at rest; what the optimizer sees)
    UNSHARDED = "unsharded"  # the full compute-dtype parameters (forward and backward)


class WeightState(enum.Enum):
    """Where a group's full compute-dtype weights are."""

    SHARDED = "sharded"  # only shards exist; the unsharded storage is freed
    GATHERING = "gathering"  # an all-gather into the unsharded storage is in flight
    UNSHARDED = "unsharded"  # the full weights are there for forward and backward


class RefreshState(enum.Enum):
    """Whether the compute-dtype model weights follow the main weights."""

    CURRENT = "current"  # rebuilt since the main weights last changed, as far as their version counters show
    STALE = "stale"  # the main weights changed in a way no version counter shows: rebuilt at the next refresh


class GradState(enum.Enum):
    """Where a step's gradients are."""

    IDLE = "idle"  # nothing in progress; ``.grad`` (if set) holds the last finished gradients
    ACCUMULATING = "accumulating"  # micro-batches reduced into the accumulation buffer, window open
    REDUCED = "reduced"  # the window is finalized; the grads wait to be installed as ``.grad``


class ParamGroup:
    def __init__(
        self,
        name: str,
        refs: Sequence[ParamRef],
        plan: ShardingPlan,
        policy: MixedPrecisionPolicy,
        device: torch.device,
        streams: StreamSet,
        sum_over_axes: Sequence = (),
        offload: bool = False,
        pin_memory: bool = True,
        collectives: Collectives | None = None,
        target_device: torch.device | None = None,
    ):
        self.name = name
        self.refs = list(refs)
        self.fqns = [r.fqn for r in self.refs]
        self.params = [ShardedParam(r, plan) for r in self.refs]
        self.plan = plan
        self.streams = streams
        # Graph-safe mode (fully_shard(graph_safe=True)): every buffer is allocated once and kept, so a step
        # reads and writes the same addresses as the one before (a captured CUDA graph replays them).
        self.static = streams.graph_safe
        self._static_grads: dict[str, torch.Tensor] = {}
        self.collectives = collectives or Collectives()
        self.device = device
        # Where the buffers belong: a group built on the meta device (a model built there) gets them at
        # model.to_empty(device=...) (``materialize``).
        self.target_device = target_device or device
        first = self.refs[0].param
        self._annotations = [{k: v for k, v in vars(r.param).items() if not k.startswith("_")} for r in self.refs]
        self.requires_grad = first.requires_grad
        self.sum_over_axes = list(sum_over_axes)
        self.compute_dtype = policy.compute_dtype(first.dtype)
        self.main_dtype = policy.main_dtype(first.dtype)
        self.main_grad_dtype = policy.main_grad_dtype(first.dtype)
        # Where install_grads hands the main grads out: ``.grad`` (a copy cast to the main weights'
        # dtype when the two differ, as Megatron-FSDP casts), or ``.decoupled_grad`` in their own
        # dtype, uncast, where Megatron's precision-aware optimizer reads them.
        self.grad_attr = "grad"
        # Attributes of the compute parameters that alias their ``.grad`` (Megatron's fused wgrad
        # kernels keep ``.main_grad``): dropped with it, so no full gradient outlives its reduction.
        self.grad_aliases: tuple[str, ...] = ()
        self.comm_dtype = policy.comm_dtype(first.dtype)
        # Multiplies the reduced gradients (the plan's mean over the data-parallel ranks, or FSDP2's
        # ``set_gradient_divide_factor``: a sum divided by the factor).
        self.grad_scale = plan.grad_scale
        # Offloaded: main weights (so the optimizer state) and the finished grads live on the host.
        self.offloaded = offload
        # page-locked only where a GPU copies from it (a gloo run on a CUDA host makes no CUDA context)
        self._host = HostMemory(pin_memory and self.target_device.type == "cuda") if offload else None
        self._host_grad: torch.Tensor | None = None  # reused step after step unless the user kept the last grads
        self._host_ready: "torch.cuda.Event | None" = None  # the grads' copy to the host
        self._host_kept = None  # grads the user kept across steps, added to at install
        # Levels of the buffers: parameter, gradient and optimizer placements.
        self.param_level = len(plan.param_axes)
        self.grad_level = len(plan.grad_axes)
        self.opt_level = len(plan.opt_axes)
        self.levels = Levels(self.params, plan.opt_axes, self.collectives, streams, device)
        self.layouts = self.levels.layouts
        kp, m = self.param_level, self.opt_level
        self.main_aliases_model = self.compute_dtype == self.main_dtype and not offload
        # With ZeRO-3-like placements (parameters sharded exactly like the optimizer state) a
        # lower-precision model-weight shard is cast from the main weights on the gather
        # stream right before each gather instead of being kept: 2 bytes/param less at rest.
        self.casts_on_gather = not self.main_aliases_model and kp == m and kp > 0 and not offload
        marks = [gather_mark(r.param) for r in self.refs]
        self.quantized: QuantizedGather | None = None
        if any(mark is not None for mark in marks):
            self._check_quantized(marks, policy, plan)
            self.quantized = QuantizedGather(self.levels, marks, self.compute_dtype)
        self.persistent_unsharded = kp == 0
        self._allocate([ref.param.detach() for ref in self.refs])
        self.weight_state = WeightState.UNSHARDED if self.persistent_unsharded else WeightState.SHARDED
        self._gather: InFlight | None = None  # the all-gather while GATHERING
        self.module_params = ModuleParams.ORIGINAL

        # Gradient state: buffers exist only from a step's first reduction until the
        # optimizer drops the ``.grad`` DTensors (see _open_window).
        self._grad_acc: DistributedBuffer | None = None
        self._main_grad: DistributedBuffer | None = None
        self._main_grad_ref: weakref.ref | None = None
        self.grad_state = GradState.IDLE
        self._released: tuple = ()
        # Graph-safe: the first forward rebuilds the weights as every later one does (the same values), so the
        # first step already takes every staging buffer a step needs: none is made after it.
        self.refresh_state = RefreshState.STALE if self.static else RefreshState.CURRENT
        self._refreshed_version = self._main_version()

    # ----------------------------------------------------------- construction
    def _allocate(self, fulls: list[torch.Tensor] | None) -> None:
        """Make the weight buffers on ``self.device`` (filled from the full parameters ``fulls``, zeros when
        ``None``), the sharded DTensor parameters over the main weights and the unsharded leaf parameters."""
        kp, m = self.param_level, self.opt_level
        with torch.no_grad():
            self._model: DistributedBuffer | None = None
            if not self.casts_on_gather:
                self._model = self.levels.zeros(kp, self.compute_dtype)
                if fulls is not None:
                    self._model.fill(fulls)
            if self.main_aliases_model and m == kp:
                self._main = self._model
            elif self.main_aliases_model and m == kp + 1:  # this rank's pieces inside the model shard
                self._main = self._model.own_pieces()
            else:
                if self.offloaded:
                    flat = self._host.empty(self.layouts[m].total, self.main_dtype).zero_()
                    self._main = DistributedBuffer(self.levels, m, flat)
                else:
                    self._main = self.levels.zeros(m, self.main_dtype)
                if fulls is not None:
                    self._main.fill(fulls)
        self.sharded_params = [self._make_sharded_param(i) for i in range(len(self.params))]

        # The unsharded buffer and the leaf parameters forward uses.
        if self.persistent_unsharded:
            self._unsharded = self._model
        else:
            self._unsharded = self.levels.empty(
                0, self.compute_dtype if self.quantized is None else self.quantized.wire_dtype)
        self.unsharded_params = [
            nn.Parameter(self._unsharded.local(i) if self.quantized is None
                         else self.quantized.compute_tensor(self._unsharded, i), requires_grad=self.requires_grad)
            for i in range(len(self.params))
        ]
        if not self.persistent_unsharded:
            self._unsharded.free()  # the views above keep their shapes

    def _check_quantized(self, marks: list, policy: MixedPrecisionPolicy, plan: ShardingPlan) -> None:
        """An FP8 gather casts the main pieces right before each gather: it needs every parameter of the
        group marked, compute weights of a lower precision than the main ones, and parameters sharded
        like the main weights (ZeRO-3, HSDP) and kept on the device."""
        unmarked = [r.fqn for r, mark in zip(self.refs, marks) if mark is None]
        if unmarked:
            raise ValueError(f"group {self.name}: parameters {unmarked} are not marked for the FP8 gather while "
                             "others are; the engine groups marked parameters apart, please report it")
        why = None
        if self.main_aliases_model:
            why = (f"the compute dtype {self.compute_dtype} is the main weights' dtype; use "
                   "mixed_precision=MixedPrecisionPolicy(param_dtype=torch.bfloat16)")
        elif self.offloaded:
            why = "its main weights are offloaded to the host (offload_policy)"
        elif not self.casts_on_gather:
            why = ("its parameters are not sharded like the main weights (strategy optim_grads_params, HSDP "
                   "or one GPU); other placements gather bf16 weights and the FP8 linears cast them")
        elif plan.model_parallel:
            why = "FP8 gathers under tensor or expert parallelism are not built"
        if why:
            raise ValueError(f"FP8 weight all-gather of group {self.name} ({', '.join(self.fqns)}): {why} "
                             "(shardwise.engine.fp8.convert_to_fp8(..., all_gather=False) keeps the bf16 gather)")

    def _make_sharded_param(self, i: int) -> nn.Parameter:
        param = nn.Parameter(self.params[i].dtensor(self._main.local(i)), requires_grad=self.requires_grad)
        # Keep the model's own annotations (tensor_model_parallel, partition_dim, allreduce, ...).
        for key, value in self._annotations[i].items():
            setattr(param, key, value)
        setattr(param, SHARDED_MARK, True)
        return param

    def main_local(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s rows of the main weights on this rank (what its sharded DTensor views)."""
        return self._main.local(i)

    def rebuild_sharded_param(self, i: int) -> nn.Parameter:
        """A new sharded DTensor parameter over parameter ``i``'s main rows (the engine's view of it)."""
        return self._make_sharded_param(i)

    def materialize(self, device: torch.device) -> None:
        """Give a group built on the meta device its buffers on ``device`` (zeros) and new sharded parameters;
        the modules still hold the old ones until they are installed again."""
        self.device = self.levels.device = device
        self._allocate(None)
        self.module_params = ModuleParams.ORIGINAL
        self._refreshed_version = self._main_version()
        self.mark_weights_stale()

    # --------------------------------------------------- the buffers' tensors
    @property
    def main(self) -> torch.Tensor | None:
        """The flat main weights, when they have a buffer of their own (else pieces of ``model_shard``)."""
        return self._main.flat

    @property
    def model_shard(self) -> torch.Tensor | None:
        """The flat compute-dtype weight shard (``None`` when cast from ``main`` at each gather)."""
        return None if self._model is None else self._model.flat

    @property
    def unsharded(self) -> torch.Tensor:
        return self._unsharded.flat

    @property
    def grad_acc(self) -> torch.Tensor | None:
        return None if self._grad_acc is None else self._grad_acc.flat

    @property
    def main_grad(self) -> torch.Tensor | None:
        return None if self._main_grad is None else self._main_grad.flat

    # ------------------------------------------------------------- swapping
    def install_sharded_params(self) -> None:
        """Replace the original parameters in their modules and drop our references to them."""
        self.use_sharded()
        for ref in self.refs:
            mark_replaced(ref.param, "fully_shard")  # an optimizer built before it is refused at its first step
            ref.param = None

    def use_unsharded(self) -> None:
        """Point every holding module at the unsharded parameters (for forward)."""
        if self.module_params is ModuleParams.UNSHARDED:
            return
        for ref, param in zip(self.refs, self.unsharded_params):
            for module, attr in ref.holders:
                module._parameters[attr] = param
        self.module_params = ModuleParams.UNSHARDED

    def use_sharded(self) -> None:
        """Point every holding module back at the sharded DTensor parameters."""
        if self.module_params is ModuleParams.SHARDED:
            return
        for ref, param in zip(self.refs, self.sharded_params):
            for module, attr in ref.holders:
                module._parameters[attr] = param
        self.module_params = ModuleParams.SHARDED

    # ------------------------------------------------------- unshard / free
    @property
    def storage_bytes_unsharded(self) -> int:
        return self._unsharded.storage_bytes()

    def start_unshard(self) -> None:
        """Begin gathering the model weights (returns at once on CUDA)."""
        if self.weight_state is not WeightState.SHARDED:
            return
        self._gather = self._unsharded.start_gather(self._gather_source)
        self.weight_state = WeightState.GATHERING

    def _gather_source(self, staged: list) -> DistributedBuffer:
        """What the gather reads, made on the gather stream right before it."""
        if self.quantized is not None:  # FP8: the main pieces cast to e4m3 bytes (scales once per step)
            return self.quantized.source(self._main, self._unsharded, staged)
        model = self._model
        if model is None:  # ZeRO-3 mixed precision: cast the main shard right before the gather
            if self.levels.same_layout(0, self._main.level):  # one rank per axis: the gather is the cast
                return self._main
            return self._main.cast(self.compute_dtype, staged)
        if model.state is BufferState.OUTDATED:  # offloaded: the optimizer's update comes in right before the gather
            model.copy_from(self._main, non_blocking=True)
        return model

    def finish_unshard(self) -> None:
        if self.weight_state is WeightState.UNSHARDED:
            return
        if self.weight_state is WeightState.SHARDED:
            self.start_unshard()
        self._gather.wait()
        self._gather = None
        self.weight_state = WeightState.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded storage (when parameters are sharded) and swap DTensors back in."""
        self.use_sharded()
        if self.persistent_unsharded:
            return
        if self.weight_state is WeightState.GATHERING:  # prefetched but never used
            self._gather.wait()
            self._gather = None
        if self.weight_state is not WeightState.SHARDED:
            if not self.static:  # graph-safe: the storage stays (regathered in place at the next unshard)
                self._unsharded.free()
            self.weight_state = WeightState.SHARDED

    # --------------------------------------------------------------- grads
    def _open_window(self) -> None:
        """Start accumulating a step's gradients.

        The main-grad buffer lives only as long as the ``.grad`` DTensors that
        view it: once ``optimizer.zero_grad()`` drops them it is freed, and the
        next step allocates a fresh one that the first reduction overwrites
        (no zero-fill). Grads the user kept are accumulated onto.
        """
        if self.grad_state is GradState.REDUCED:  # the engine installs every finalized window first
            raise RuntimeError(f"group {self.name}: a new accumulation window opened before the last one's "
                               "gradients were installed; please report it with the model")
        m = self.opt_level
        cleared = [getattr(p, self.grad_attr, None) is None for p in self.sharded_params]
        existing = self._main_grad_ref() if self._main_grad_ref is not None else None
        if self.offloaded:  # the host grads the user kept are added to at install time
            self._host_kept = None if all(cleared) or existing is None else (existing, cleared)
            existing = None
        if all(cleared) or existing is None or self.hands_out_copies:
            # (grads handed out as cast copies hold the earlier windows' sum themselves: install adds to them)
            self._main_grad = self._fresh_grads("main_grad", m)  # the first reduction overwrites it
            self._main_grad_ref = weakref.ref(self._main_grad.flat)
        else:  # the kept grads, accumulated onto (those the user cleared restart from zero)
            self._main_grad = DistributedBuffer(self.levels, m, existing)
            for i, was_cleared in enumerate(cleared):
                if was_cleared:
                    self._main_grad.local(i).zero_()
        if self.levels.same_layout(self.grad_level, m):  # the same level, or one buffer with it in all but name
            self._grad_acc = self._main_grad
        else:  # a Partial accumulation buffer of its own, restarted every window
            self._grad_acc = self._fresh_grads("grad_acc", self.grad_level)
        self.grad_state = GradState.ACCUMULATING

    def _fresh_grads(self, kind: str, level: int) -> DistributedBuffer:
        """An ``EMPTY`` gradient buffer of ``level``: a new one, or in graph-safe mode the one this group made
        at its first window (kept for good: the same addresses every step, whoever drops ``.grad``)."""
        if not self.static:
            return self.levels.empty(level, self.main_grad_dtype)
        flat = self._static_grads.get(kind)
        if flat is None:
            flat = self._static_grads[kind] = torch.empty(self.layouts[level].total, dtype=self.main_grad_dtype,
                                                          device=self.device)
        return DistributedBuffer(self.levels, level, flat, BufferState.EMPTY)

    def _flat_grads(self, staged: list) -> DistributedBuffer:
        """The unsharded grads (zeros where missing) in one comm-dtype buffer, one kernel: the accumulation
        buffer itself when that is a fresh one of level 0 and this dtype (ZeRO-0/1), else a staged one."""
        acc = self._grad_acc
        flat = acc if acc.takes(0, self.comm_dtype) else self.levels.staged(0, self.comm_dtype, staged)
        grads = []
        for param in self.unsharded_params:
            grads.append(param.grad)
            param.grad = None
            for alias in self.grad_aliases:
                setattr(param, alias, None)
        flat.load(grads)
        return flat

    def has_unsharded_grads(self) -> bool:
        return any(p.grad is not None for p in self.unsharded_params)

    def reduce_grads(self, finalize: bool) -> InFlight:
        """Reduce this micro-batch's grads into the accumulation buffer; finalize at a step's end.

        Returns the in-flight work; the caller waits on it before the optimizer
        reads grads or before dropping the flat buffer it keeps alive.
        """
        if self.grad_state is not GradState.ACCUMULATING:
            self._open_window()
        self._released = ()
        staged: list = []
        acc = self._grad_acc
        flat = self._flat_grads(staged)
        with self.streams.on(self.streams.reduce):
            # the first micro-batch's reduction lands in the fresh accumulation buffer itself (when the
            # grads were loaded into it, ZeRO-0/1, it holds them already and takes nothing more)
            into = acc if acc.takes(self.grad_level, flat.flat.dtype) else None
            shard = flat.reduce_scatter(self.grad_level, staged, into=into)
            if self.grad_scale != 1.0:
                shard.flat.mul_(self.grad_scale)
            if shard is not acc:
                acc.accumulate(shard)
            if finalize:
                self._finalize(staged)
        return self._in_flight(staged)

    def _in_flight(self, staged: list) -> InFlight:
        event = self.streams.record(self.streams.reduce)
        if self.offloaded and self.grad_state is GradState.REDUCED:
            self._host_ready = event  # the CPU may read the host grads once this has passed
        flight = InFlight(event, keepalive=self._released, staged=tuple(staged), pool=self.streams.pool)
        self._released = ()  # only the flight keeps them now: they go as soon as it is waited on
        return flight

    def finalize_without_new_grads(self) -> InFlight | None:
        """End an accumulation window whose last micro-batch brought no grads to this group."""
        if self.grad_state is not GradState.ACCUMULATING:
            return None
        staged: list = []
        with self.streams.on(self.streams.reduce):
            self._finalize(staged)
        return self._in_flight(staged)

    def _finalize(self, staged: list) -> None:
        acc, main_grad = self._grad_acc, self._main_grad
        if self.sum_over_axes:  # partial sums across model-parallel ranks (sequence parallel)
            acc.all_reduce(self.sum_over_axes, average=False)
        if acc is main_grad:
            main_grad.all_reduce(self.plan.finalize_allreduce_axes)
        else:
            into = main_grad if main_grad.takes(self.opt_level, acc.flat.dtype) else None
            reduced = acc.reduce_scatter(self.opt_level, staged, into=into)
            reduced.all_reduce(self.plan.finalize_allreduce_axes)
            if reduced is not main_grad:
                main_grad.accumulate(reduced)
            # the reduce stream may still read it: the caller keeps it alive until it waits
            self._released = (acc.flat,)
        self._grad_acc = None
        self.grad_state = GradState.REDUCED
        if self.offloaded:  # stream the finished shard to the host right behind its reduction
            numel, dtype = main_grad.flat.numel(), main_grad.flat.dtype
            if self._host_grad is None:
                self._host_grad = self._host.empty(numel, dtype)
            host = self._host_grad
            if self._host_kept is not None:  # the user kept last step's grads there: add to them at install
                host = torch.empty(numel, dtype=dtype)
            self._main_grad = main_grad.copy_to(host)
            self._released = self._released + (main_grad.flat,)

    def discard_grads(self) -> None:
        """Drop installed grads and any accumulation still open (the next backward overwrites)."""
        for param in self.sharded_params:
            param.grad = None
            if self.grad_attr != "grad":
                setattr(param, self.grad_attr, None)
        self._drop_accumulation()
        self._host_ready = None
        self._host_kept = None

    def _drop_accumulation(self) -> None:
        """Forget the unsharded parameters' gradients and the step's accumulation buffers."""
        for param in self.unsharded_params:
            param.grad = None
            for alias in self.grad_aliases:
                setattr(param, alias, None)
        self._grad_acc = None
        self._main_grad = None
        self.grad_state = GradState.IDLE

    @torch.no_grad()
    def zero_grads_in_place(self) -> None:
        """Graph-safe mode's ``zero_grad``: zero the kept gradient buffer and the gradients handed out where
        they are, never drop them; the next window adds onto those zeros.

        A replayed graph runs no Python, so the ``.grad`` (or ``grad_attr``) tensors the optimizer reads
        after a replay must be the very tensors the captured step wrote: they stay installed for good.
        Also ends any ``no_sync`` accumulation left open, as :meth:`discard_grads` does.
        """
        self._drop_accumulation()
        flat = self._static_grads.get("main_grad")
        handed = [getattr(p, self.grad_attr, None) for p in self.sharded_params]
        handed = [g._local_tensor if hasattr(g, "_local_tensor") else g for g in handed if g is not None]
        if flat is not None:
            flat.zero_()
            handed = [g for g in handed if g._base is not flat]  # views of the kept buffer: zeroed with it
        handed = [g for g in handed if g.numel()]
        if handed:
            torch._foreach_zero_(handed)

    def install_grads(self) -> None:
        """Expose the finalized main grads as the sharded parameters' ``.grad``.

        Only the ``.grad`` DTensors keep the buffer alive from here on.
        """
        if self.grad_state is not GradState.REDUCED:
            return
        if self.offloaded:
            self._install_host_grads()
            return
        flat, attr = self._main_grad.flat, self.grad_attr
        if all(getattr(p, attr, None) is not None and getattr(p, attr)._local_tensor._base is flat
               for p in self.sharded_params):
            pass  # accumulated onto the grads already installed
        else:
            self._hand_out(self._main_grad.dtensors())
        self._main_grad = None
        self.grad_state = GradState.IDLE
        # An optimizer step on these grads may not show in any version counter: on CUDA, torch's
        # default (foreach) AdamW over DTensors moved none (2 x H200, torch 2.11), so the next
        # forward rebuilds the model weights whenever grads were handed out.
        self.mark_weights_stale()

    def install_static_grads(self) -> None:
        """Graph-safe mode: ``grad_attr`` views of the kept gradient buffer, or of the kept cast copies (after a
        replay, which runs no Python)."""
        flat = self._static_grads.get("grad_copy" if self.hands_out_copies else "main_grad")
        if flat is None or not self.requires_grad:
            return
        for param, grad in zip(self.sharded_params, DistributedBuffer(self.levels, self.opt_level, flat).dtensors()):
            setattr(param, self.grad_attr, grad)

    @property
    def hands_out_copies(self) -> bool:
        """Whether ``.grad`` is a copy of the main grads cast to the main weights' dtype (``.grad`` must have its
        parameter's dtype), not a view of the main-grad buffer: then the copies, not the buffer, carry what earlier
        windows accumulated, and every window starts the buffer afresh."""
        return self.grad_attr == "grad" and self.main_grad_dtype != self.main_dtype

    def _hand_out(self, grads) -> None:
        """Set each sharded parameter's ``grad_attr`` to its main grad.

        ``.grad`` must have its parameter's dtype: main grads of another dtype are
        handed out as a cast copy (the grads a user kept across steps are added to);
        graph-safe mode casts into a kept buffer, so the copies too keep their addresses.
        """
        if not self.hands_out_copies:
            for param, grad in zip(self.sharded_params, grads):
                setattr(param, self.grad_attr, grad)
            return
        copies = None  # graph-safe mode's kept copies, made only where some .grad was dropped
        for i, (param, grad) in enumerate(zip(self.sharded_params, grads)):
            if param.grad is not None:
                param.grad.add_(grad.to(self.main_dtype))
            elif not self.static:
                param.grad = grad.to(self.main_dtype)
            else:
                copies = copies or self._static_grad_copies()
                copies[i].to_local().copy_(grad.to_local())
                param.grad = copies[i]

    def _static_grad_copies(self) -> list:
        """Graph-safe mode's cast ``.grad`` copies: DTensor views of one buffer of the main weights' dtype, made once."""
        flat = self._static_grads.get("grad_copy")
        if flat is None:
            flat = self._static_grads["grad_copy"] = torch.empty(self.layouts[self.opt_level].total,
                                                                 dtype=self.main_dtype, device=self.device)
        return DistributedBuffer(self.levels, self.opt_level, flat).dtensors()

    def _install_host_grads(self) -> None:
        if self._host_ready is not None:
            self._host_ready.synchronize()  # the host copy has landed
            self._host_ready = None
        kept = self._host_kept
        if kept is not None:  # accumulate onto the grads the user did not clear
            existing, cleared = kept
            target = DistributedBuffer(self.levels, self.opt_level, existing)
            for i, was_cleared in enumerate(cleared):
                old, new = target.local(i), self._main_grad.local(i)
                if was_cleared:
                    old.copy_(new)
                else:
                    old.add_(new)
            self._main_grad = target
        self._host_kept = None
        if kept is None or any(getattr(p, self.grad_attr, None) is None for p in self.sharded_params):
            self._hand_out(self._main_grad.dtensors())
        self._main_grad_ref = weakref.ref(self._main_grad.flat)
        self._main_grad = None
        self.grad_state = GradState.IDLE
        self.mark_weights_stale()

    # -------------------------------------------------------- weight refresh
    def mark_weights_stale(self) -> None:
        """The main weights changed in a way their version counters may not show: rebuild at the next refresh."""
        self.refresh_state = RefreshState.STALE
        if self.quantized is not None:  # new amaxes and scales at the next gather
            self.quantized.stale = True

    def _main_version(self) -> tuple[int, int]:
        """Version counters that any in-place update of the main weights moves, and our refresh does not.

        An optimizer step or ``load_state_dict`` updates the DTensor parameters
        (their own counters); a write into ``to_local()`` (DCP's load) moves the
        counter the local views share with their flat buffer.
        """
        base = self.main if self.main is not None else self.model_shard
        return sum(p._version for p in self.sharded_params), base._version

    @torch.no_grad()
    def refresh_model_weights(self) -> None:
        """Rebuild the compute-dtype model weights from the main weights after an update."""
        version = self._main_version()
        if self.refresh_state is RefreshState.CURRENT and version == self._refreshed_version:
            return
        self.refresh_state = RefreshState.CURRENT
        self._refreshed_version = version
        if self.quantized is not None:  # new amaxes and scales at the next gather
            self.quantized.stale = True
        kp, m = self.param_level, self.opt_level
        if self.offloaded and kp == m and kp > 0:
            self._model.state = BufferState.OUTDATED  # uploaded on the gather stream, right before the next gather
            return
        if self.offloaded and kp == m:  # replicated weights (no_shard): one copy from the host
            self._model.copy_from(self._main, non_blocking=True)
            return
        if self._model is None or (self.main_aliases_model and m == kp):
            return
        # main weights that are this rank's pieces of the model shard gather in place; others are
        # cast (from the host when offloaded) first
        source, staged = self._main, []
        if source.flat is not None and not (source.flat.device == self.device and self.levels.same_layout(kp, m)):
            if not self.static:
                source = source.to(self.device, self.compute_dtype, True)  # else the gather is the cast
            elif source.flat.dtype != self.compute_dtype:  # graph-safe: cast into a static pool buffer
                source = source.cast(self.compute_dtype, staged)
        with torch.autograd._unsafe_preserve_version_counter(self._model.flat):
            temps = source.gather_into(self._model)
        if self.static:  # read on this stream only: every later user of the pool is ordered after it
            for buffer in staged + temps:
                self.streams.pool.give(buffer)

    @torch.no_grad()
    def broadcast_main_weights(self, axis) -> None:
        """Give every rank of ``axis`` (where main weights are replicated) the first rank's values."""
        (self._main if self._main.flat is not None else self._model).broadcast(axis)
        self.mark_weights_stale()

    # ------------------------------------------------------------ reporting
    def resident_bytes(self) -> dict[str, int]:
        """Bytes of device storage this group holds right now, by buffer."""
        main_grad = self._main_grad_ref() if self._main_grad_ref is not None else None
        own_main = self.main is not None and self.main is not self.model_shard
        if self.offloaded:  # on the host: see host_bytes()
            own_main, main_grad = False, None
        return {
            "model_shard": 0 if self.model_shard is None else self.model_shard.untyped_storage().nbytes(),
            "main": self.main.untyped_storage().nbytes() if own_main else 0,
            "unsharded": 0 if self.persistent_unsharded else self.storage_bytes_unsharded,
            "main_grad": 0 if main_grad is None else main_grad.untyped_storage().nbytes(),
            "grad_acc": 0 if self.grad_acc is None or self.grad_acc is main_grad else self.grad_acc.untyped_storage().nbytes(),
        }

    def host_bytes(self) -> dict[str, int]:
        """Bytes of host memory an offloaded group holds right now (main weights and grads)."""
        if not self.offloaded:
            return {"main": 0, "main_grad": 0}
        grad = self._main_grad_ref() if self._main_grad_ref is not None else None
        return {"main": self.main.untyped_storage().nbytes(), "main_grad": 0 if grad is None else grad.untyped_storage().nbytes()}
