"""One parameter group: its buffers and their lifecycle.

What a group is (which parameters of a unit share one) is written once, in docs/design.md's vocabulary
("group"), and built once, by ``construct.GroupBuilder._buckets``.
Each buffer is a ``DistributedBuffer`` (``distributed_buffer``): one *level* of every
parameter's sharding (see ``layout``), one slot per parameter packed into a
flat tensor, and the transitions between levels:

- ``main``: the main weights (``main_params_dtype``) at the optimizer level;
  the sharded DTensor parameters the optimizer sees view their real rows.
  Where dtypes allow it lives inside ``model_shard`` (fp32 keeps one copy);
- ``model_shard``: the compute-dtype model weights at the parameter level;
- ``unsharded``: the full compute-dtype parameters forward and backward read
  (level 0); its storage is freed while the group rests when parameters are
  sharded, and it is ``model_shard`` itself, kept, where a gather would only
  copy that (replicated parameters; one rank per parameter axis with the
  compute dtype the main weights' own);
- ``grad_acc`` / ``main_grad``: gradients accumulated at the gradient level
  across micro-batches, and finalized at the optimizer level.

A group of weights marked for an FP8 gather (``quantized_gather``) gathers uint8
e4m3 bytes into ``unsharded`` instead, cast from ``main`` with scales shared
over the axes, and its unsharded parameters wrap those bytes. A group of
parameters with FSDP2's all-gather extensions (``gather_extensions``) has no
flat weight buffers: its sharded pieces are the subclass's own, and its
gathers go through the parameters' hooks (``extensions``).

The buffers move themselves; the group decides when, on which stream, and
what stays alive until a flight is waited on. Its states: which parameters the
modules hold (``ModuleParams``), where the full weights are (``WeightState``),
whether the model weights follow the main weights (``RefreshState``), where a
step's gradients are (``GradState``)."""

from __future__ import annotations

import enum
from typing import Sequence

import torch
import torch.nn as nn

from .collectives import Collectives, InFlight, StreamSet
from .distributed_buffer import BufferState, DistributedBuffer, Levels
from .mesh import ShardingPlan
from .offload import HostMemory
from .sharded_param import ParamRef, ShardedParam
from .precision import CASTABLE_DTYPES, MixedPrecisionPolicy
from .owner_layout import OWNER_SUM_GROUP
from .quantized_gather import QuantizedGather, gather_mark
from .gather_extensions import ExtensionGather, ExtensionParam, check_extension_group, has_extensions, patched_hooks
from .grad_window import GradDtypes, GradState, GradWindow, ReduceSettings
from .replaced_params import mark_replaced

__all__ = ["SHARDED_MARK", "ParamRef", "ParamGroup", "ModuleParams", "WeightState", "RefreshState", "GradState"]


SHARDED_MARK = "_shardwise_sharded"  # set on every sharded DTensor parameter the engine hands out


class ModuleParams(enum.Enum):
    """Which parameters the modules that hold the group's parameters point at."""

    ORIGINAL = "original"  # their own, until the group installs its sharded parameters
    SHARDED = "sharded"  # the sharded DTensor parameters (at rest; what the optimizer sees)
    UNSHARDED = "unsharded"  # the full compute-dtype parameters (forward and backward)
    POST_FORWARD = "post_forward"  # reshard_after_forward=k: the parts kept over k ranks (post_forward_shard.py)


class WeightState(enum.Enum):
    """Where a group's full compute-dtype weights are."""

    SHARDED = "sharded"  # only shards exist; the unsharded storage is freed
    GATHERING = "gathering"  # an all-gather into the unsharded storage is in flight
    UNSHARDED = "unsharded"  # the full weights are there for forward and backward


class RefreshState(enum.Enum):
    """Whether the compute-dtype model weights follow the main weights."""

    CURRENT = "current"  # rebuilt since the main weights last changed, as far as their version counters show
    STALE = "stale"  # the main weights changed in a way no version counter shows: rebuilt at the next refresh


class ParamGroup:
    """The parameters of one unit that share a plan, dtype and requires_grad: their buffers and when they move.

    Attributes: ``refs`` / ``fqns`` / ``params`` (``ShardedParam``: each parameter's rows at every level);
    ``plan`` (which axes shard which buffer) and ``levels`` / ``layouts`` (slot offsets per level; ``param_level``
    <= ``grad_level`` <= ``opt_level``); ``compute_dtype``, ``main_dtype``, ``main_grad_dtype``, ``comm_dtype``;
    ``reduction`` (``ReduceSettings``: FSDP2's setters' grad scale and hook); ``sharded_params`` (the DTensor
    parameters over ``main``, what the optimizer sees) and ``unsharded_params`` (over ``unsharded``, what
    forward reads); ``module_params``, ``weight_state``, ``refresh_state`` (the states below); ``window``
    (``GradWindow``: the step's gradients); ``offloaded`` / ``host`` (main weights and finished grads in host
    memory); ``quantized`` (the FP8 gather); ``static`` (graph-safe mode: every buffer kept at one address);
    ``device`` / ``target_device`` (meta until ``to_empty`` when built on the meta device)."""

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
        # FSDP2's all-gather extensions (the parameters' own hooks): a group of them only (the bucket key)
        uses_hooks = any(has_extensions(r.param, r.fqn) for r in self.refs)
        self.params = [(ExtensionParam if uses_hooks else ShardedParam)(r, plan) for r in self.refs]
        self.plan = plan
        self.streams = streams
        # Graph-safe mode (fully_shard(graph_safe=True)): every buffer is allocated once and kept, so a step
        # reads and writes the same addresses as the one before (a captured CUDA graph replays them).
        self.graph_safe = streams.graph_safe
        self.collectives = collectives or Collectives()
        self.device = device
        # Where the buffers belong: a group built on the meta device (a model built there) gets them at
        # model.to_empty(device=...) (``materialize``).
        self.target_device = target_device or device
        first = self.refs[0].param
        self._annotations = [{k: v for k, v in vars(r.param).items() if not k.startswith("_")} for r in self.refs]
        self.requires_grad = first.requires_grad
        self.sum_over_axes = list(sum_over_axes)
        self.policy = policy
        self.reduction = ReduceSettings(plan.grad_scale)  # FSDP2's setters change it; every window reads it
        # Offloaded: main weights (so the optimizer state) and the finished grads live on the host.
        self.offloaded = offload
        # page-locked only where a GPU copies from it (a gloo run on a CUDA host makes no CUDA context)
        self.host = HostMemory(pin_memory and self.target_device.type == "cuda") if offload else None
        # Levels of the buffers: parameter, gradient and optimizer placements.
        self.param_level = len(plan.param_axes)
        self.grad_level = len(plan.grad_axes)
        self.opt_level = len(plan.opt_axes)
        self.levels = Levels(self.params, plan.opt_axes, self.collectives, streams, device)
        self.layouts = self.levels.layouts
        # ``policy.keep_compute_weights``: the compute-dtype shard kept at rest, cast once per update (an FP8
        # gather casts before every gather anyway)
        marks = [gather_mark(r.param) for r in self.refs]
        self.extensions: ExtensionGather | None = None
        if uses_hooks:
            check_extension_group(name, self.fqns, self.refs, plan, policy, offload, self.graph_safe,
                                  any(mark is not None for mark in marks), first.dtype)
            self.extensions = ExtensionGather(self.refs, self.levels, plan, policy, first.dtype)
        self.keeps_compute_weights = policy.keep_compute_weights and all(mark is None for mark in marks)
        self._set_dtypes(first.dtype)
        self.quantized: QuantizedGather | None = None
        if any(mark is not None for mark in marks):
            self._check_quantized(marks, policy, plan)
            self.quantized = QuantizedGather(self.levels, marks, self.compute_dtype)
        self.persistent_unsharded = self._keeps_unsharded()
        self.sharded_params, self.unsharded_params = [], []  # filled in place from here on: the window's too
        self._allocate([ref.param.detach() for ref in self.refs])
        self.weight_state = WeightState.UNSHARDED if self.persistent_unsharded else WeightState.SHARDED
        self._gather: InFlight | None = None  # the all-gather while GATHERING
        self.module_params = ModuleParams.ORIGINAL

        # The gradients, from a step's first reduction until the optimizer drops the ``.grad`` DTensors.
        self.window = self._new_window()
        # Graph-safe: the first forward rebuilds the weights as every later one does (the same values), so the
        # first step already takes every staging buffer a step needs: none is made after it.
        self.refresh_state = RefreshState.STALE if self.graph_safe else RefreshState.CURRENT
        self._refreshed_version = self._main_version()

    # ----------------------------------------------------------- construction
    def _set_dtypes(self, dtype: torch.dtype) -> None:
        """Every buffer's dtype for parameters of ``dtype`` under the group's policy, and what follows from it."""
        policy, kp, m = self.policy, len(self.plan.param_axes), len(self.plan.opt_axes)
        cast = dtype in CASTABLE_DTYPES  # a frozen integer / FP8 parameter (FSDP2 shards them too) is never cast
        self.compute_dtype = policy.compute_dtype(dtype) if cast else dtype
        self.main_dtype = policy.main_dtype(dtype) if cast else dtype
        self.main_grad_dtype = policy.main_grad_dtype(dtype) if cast else dtype
        self.comm_dtype = policy.comm_dtype(dtype) if cast else dtype
        self.main_aliases_model = self.compute_dtype == self.main_dtype and not self.offloaded
        # With ZeRO-3-like placements (parameters sharded exactly like the optimizer state) a
        # lower-precision model-weight shard is cast from the main weights on the gather
        # stream right before each gather instead of being kept: 2 bytes/param less at rest (unless the policy
        # keeps it: ``keeps_compute_weights``).
        self.casts_on_gather = (not self.main_aliases_model and kp == m and kp > 0 and not self.offloaded
                                and not self.keeps_compute_weights)

    def _keeps_unsharded(self) -> bool:
        """Whether the unsharded parameters are kept for good, as views of the model shard: wherever a gather
        would only copy the model shard into a buffer of the same layout (parameters replicated, kp == 0,
        ZeRO-0/1/2; or every parameter axis of one rank, one GPU or a one-rank dp_shard, with a model shard kept:
        the main weights themselves or the compute-dtype shard ``keep_compute_weights`` keeps; no FP8 bytes,
        nothing on the host). Then the optimizer's in-place update of the main weights (or its cast into the kept
        shard, once per update) is what forward reads, with no gather, free or allocation."""
        kp = self.param_level
        if self.extensions is not None:  # every gather goes through the hooks
            return False
        return kp == 0 or (not self.casts_on_gather and self.quantized is None
                           and not self.offloaded and self.levels.same_layout(0, kp))

    def _allocate(self, fulls: list[torch.Tensor] | None) -> None:
        """Make the weight buffers on ``self.device`` (filled from the full parameters ``fulls``, zeros when
        ``None``), the sharded DTensor parameters over the main weights and the unsharded leaf parameters."""
        if self.extensions is not None:
            return self._allocate_extended(fulls)
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
                    flat = self.host.empty(self.layouts[m].total, self.main_dtype).zero_()
                    self._main = DistributedBuffer(self.levels, m, flat)
                else:
                    self._main = self.levels.zeros(m, self.main_dtype)
                if fulls is not None and not (self.offloaded and any(f.is_meta for f in fulls)):
                    self._main.fill(fulls)  # (host main weights of a meta-built model: zeros until loaded)
        self.sharded_params[:] = [self._make_sharded_param(i) for i in range(len(self.params))]

        # The unsharded buffer and the leaf parameters forward uses.
        if self.persistent_unsharded:  # the model shard, named as level 0 (one buffer with it in all but name)
            self._unsharded = DistributedBuffer(self.levels, 0, self._model.flat)
        else:
            self._unsharded = self.levels.empty(
                0, self.compute_dtype if self.quantized is None else self.quantized.wire_dtype)
        self.unsharded_params[:] = [
            nn.Parameter(self.params[i].compute_tensor(self._unsharded.local(i)) if self.quantized is None
                         else self.quantized.compute_tensor(self._unsharded, i), requires_grad=self.requires_grad)
            for i in range(len(self.params))
        ]
        if not self.persistent_unsharded:
            self._unsharded.free()  # the views above keep their shapes

    def _allocate_extended(self, fulls: list[torch.Tensor] | None) -> None:
        """A group gathered through its parameters' hooks: the subclass's own sharded pieces (FSDP2's), no flat
        weight buffers; the unsharded parameters are the post-hooks' at the first gather (placeholders until then)."""
        self.extensions.shard(fulls, self.device)
        self._model = self._main = self._unsharded = None
        self.sharded_params[:] = [self._make_sharded_param(i) for i in range(len(self.params))]
        self.unsharded_params[:] = self.extensions.placeholders(self.device, self.requires_grad)

    def read_patched_hooks(self) -> None:
        """FSDP2's hooks patched onto the sharded parameters' local tensors after ``fully_shard`` (instance
        methods on plain tensors; FSDP2 reads them at its first forward): from now on this group gathers through
        them, its main weights staying where they are. Every parameter of the group or none (one flat buffer)."""
        if self.extensions is not None or not patched_hooks(self.name, self.fqns, self.sharded_params):
            return
        dtype = self.sharded_params[0].dtype
        check_extension_group(self.name, self.fqns, self.refs, self.plan, self.policy, self.offloaded, self.graph_safe,
                              self.quantized is not None, dtype)
        self.reshard()
        self.extensions = ExtensionGather(self.refs, self.levels, self.plan, self.policy, dtype)
        self.extensions.adopt([p._local_tensor for p in self.sharded_params])
        self.persistent_unsharded = False
        self.weight_state = WeightState.SHARDED
        self.unsharded_params[:] = self.extensions.placeholders(self.device, self.requires_grad)

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
        param = nn.Parameter(self.params[i].dtensor(self.main_local(i)), requires_grad=self.requires_grad)
        # Keep the model's own annotations (tensor_model_parallel, partition_dim, allreduce, ...).
        for key, value in self._annotations[i].items():
            setattr(param, key, value)
        setattr(param, SHARDED_MARK, True)
        if self.params[i].owner is not None:  # whole on its owner: its norm sums over the shard axis (clipping)
            setattr(param, OWNER_SUM_GROUP, self.params[i].sum_group.group)
        return param

    def main_local(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s rows of the main weights on this rank (what its sharded DTensor views)."""
        return self._main.local(i) if self.extensions is None else self.extensions.locals[i]

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

    def rebuild_in(self, dtype: torch.dtype) -> None:
        """Rebuild the group's buffers for parameters of ``dtype`` (``model.to(dtype)`` after wrapping): zeros
        and new sharded parameters, no gradients; the caller fills the main weights and installs them."""
        self.reshard()
        self._set_dtypes(dtype)
        self.persistent_unsharded = self._keeps_unsharded()
        self._allocate(None)
        self.weight_state = WeightState.UNSHARDED if self.persistent_unsharded else WeightState.SHARDED
        self.window = self._new_window()
        self.module_params = ModuleParams.ORIGINAL
        self._refreshed_version = self._main_version()
        self.mark_weights_stale()

    def use_collectives(self, collectives: Collectives) -> None:
        """Move the buffers with ``collectives`` from now on, and allocate the next ones in its ``buffers()``
        (FSDP2's ``set_allocate_memory_from_process_group_for_comm``); buffers allocated already stay put."""
        self.collectives = self.levels.collectives = collectives

    @property
    def comm_groups(self) -> list:
        """The process groups of the data-parallel axes the buffers travel over (an axis of one rank moves
        nothing: no collective runs over it)."""
        return [axis.group for axis in self.plan.axes.values() if axis.size > 1]

    def _new_window(self) -> GradWindow:  # built from what it reads of this group (the lists shared, not copied)
        dtypes = GradDtypes(self.main_dtype, self.main_grad_dtype, self.comm_dtype, self.compute_dtype)
        return GradWindow(self.name, self.params, self.sharded_params, self.unsharded_params, self.levels, self.plan,
                          self.streams, dtypes, self.reduction, self.sum_over_axes, self.host, self.graph_safe,
                          self.requires_grad, self.mark_weights_stale)

    # --------------------------------------------------- the buffers' tensors
    @property
    def main(self) -> torch.Tensor | None:
        """The flat main weights, when they have a buffer of their own (else pieces of ``model_shard``)."""
        return None if self._main is None else self._main.flat

    @property
    def model_shard(self) -> torch.Tensor | None:
        """The flat compute-dtype weight shard (``None`` when cast from ``main`` at each gather)."""
        return None if self._model is None else self._model.flat

    @property
    def unsharded(self) -> torch.Tensor | None:
        return None if self._unsharded is None else self._unsharded.flat

    @property
    def unsharded_buffer(self) -> DistributedBuffer:
        return self._unsharded

    @property
    def grad_acc(self) -> torch.Tensor | None:
        return self.window.grad_acc_flat

    @property
    def main_grad(self) -> torch.Tensor | None:
        return self.window.main_grad_flat

    # ------------------------------------------------------------- swapping
    def install_sharded_params(self) -> None:
        """Replace the original parameters in their modules and drop our references to them."""
        self.use_sharded()
        for ref in self.refs:
            mark_replaced(ref.param, "fully_shard")  # an optimizer built before it is refused at its first step
            ref.param = None

    def use_unsharded(self) -> None:
        """Point every holding module at the unsharded parameters (for forward), frozen where their DTensors are."""
        for param, sharded, fqn in zip(self.unsharded_params, self.sharded_params, self.fqns):
            if param.requires_grad != sharded.requires_grad:  # frozen (or unfrozen) since wrapping, as FSDP2 follows
                if not self.requires_grad:
                    raise RuntimeError(f"parameter {fqn!r} was frozen when fully_shard wrapped it and requires grad "
                                       "now: its group has no gradient buffers; unfreeze it before fully_shard")
                param.requires_grad_(sharded.requires_grad)
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
        return self._unsharded.storage_bytes() if self.extensions is None else self.extensions.storage_bytes()

    def start_unshard(self) -> None:
        """Begin gathering the model weights (returns at once on CUDA)."""
        if self.weight_state is not WeightState.SHARDED:
            return
        with torch.profiler.record_function("shardwise::gather"):
            if self.extensions is None:
                self._gather = self._unsharded.start_gather(self._gather_source)
            else:  # the pre-hooks of the locals the sharded parameters hold now (monkey patches included)
                self._gather = self.extensions.start([p._local_tensor for p in self.sharded_params])
        self.weight_state = WeightState.GATHERING
        self._gathered_version = self._main_version()

    def weights_changed_since_gather(self) -> bool:
        """Whether the main weights moved (an optimizer step, a load) since the unsharded ones were gathered."""
        return self._main_version() != getattr(self, "_gathered_version", None)

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
        if self.extensions is not None:  # the post-hooks build (or refill) the unsharded parameters
            self.extensions.finish(self.unsharded_params, self.requires_grad)
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
            if self.extensions is not None:  # the gathered outputs and the post-hooks' inner tensors
                self.extensions.free()
            elif not self.graph_safe:  # graph-safe: the storage stays (regathered in place at the next unshard)
                self._unsharded.free()
            self.weight_state = WeightState.SHARDED

    # --------------------------------------------------------------- grads (the window's)
    def has_unsharded_grads(self) -> bool:
        return self.window.has_unsharded_grads

    def stash_unsynced_grads(self) -> None:
        """A post-backward that does not reduce: accumulate the gathered grads in the comm dtype, as FSDP2."""
        self.window.stash_unsynced()

    def reduce_grads(self, finalize: bool) -> InFlight:
        """Reduce this micro-batch's grads into the window; finalize at a step's end (``GradWindow.reduce``)."""
        with torch.profiler.record_function("shardwise::reduce"):
            return self.window.reduce(finalize)

    def finalize_without_new_grads(self) -> InFlight | None:
        return self.window.finalize_without_new_grads()

    def install_grads(self) -> None:
        self.window.install()

    def install_graph_safe_grads(self) -> None:
        self.window.install_graph_safe()

    def discard_grads(self) -> None:
        """Drop installed grads and any accumulation still open (the next backward overwrites)."""
        self.window.discard()

    def discard_unsharded_grads(self) -> None:
        """Forget what the gathered parameters accumulated and the open window (a step that raised)."""
        self.window.drop_accumulation()

    def zero_grads_in_place(self) -> None:
        self.window.zero_in_place()

    def forget_kept_grad_buffers(self) -> None:
        self.window.forget_kept_buffers()

    @property
    def grad_state(self) -> GradState:
        return self.window.state

    @property
    def grad_attr(self) -> str:
        """Where the finished grads are handed out: ``.grad``, or Megatron's ``.decoupled_grad``."""
        return self.window.grad_attr

    @grad_attr.setter
    def grad_attr(self, value: str) -> None:
        self.window.grad_attr = value

    @property
    def grad_aliases(self) -> tuple[str, ...]:
        """Attributes of the gathered parameters that alias their ``.grad`` (Megatron's ``.main_grad``)."""
        return self.window.grad_aliases

    @grad_aliases.setter
    def grad_aliases(self, value: tuple[str, ...]) -> None:
        self.window.grad_aliases = tuple(value)

    @property
    def hands_out_copies(self) -> bool:
        return self.window.hands_out_copies

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
        counter the local views share with their flat buffer."""
        if self.extensions is not None:  # the subclass pieces (the locals are views of them)
            return sum(p._version for p in self.sharded_params), sum(t._version for t in self.extensions.padded)
        base = self.main if self.main is not None else self.model_shard
        return sum(p._version for p in self.sharded_params), base._version

    @torch.no_grad()
    def refresh_model_weights(self) -> None:
        """Rebuild the compute-dtype model weights from the main weights after an update."""
        version = self._main_version()
        if self.refresh_state is RefreshState.CURRENT and version == self._refreshed_version:
            return
        with torch.profiler.record_function("shardwise::refresh_weights"):
            self._refresh(version)

    def _refresh(self, version: tuple[int, int]) -> None:
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
            if not self.graph_safe:
                source = source.to(self.device, self.compute_dtype, True)  # else the gather is the cast
            elif source.flat.dtype != self.compute_dtype:  # graph-safe: cast into a static pool buffer
                source = source.cast(self.compute_dtype, staged)
        with torch.autograd._unsafe_preserve_version_counter(self._model.flat):
            temps = source.gather_into(self._model)
        if self.graph_safe:  # read on this stream only: every later user of the pool is ordered after it
            for buffer in staged + temps:
                self.streams.pool.give(buffer)

    @torch.no_grad()
    def broadcast_main_weights(self, axis) -> None:
        """Give every rank of ``axis`` (where main weights are replicated) the first rank's values."""
        if self.extensions is not None:
            raise NotImplementedError(f"sync_module_states=True with parameters {self.fqns} that define FSDP2's "
                                      "all-gather extensions is not built: load the weights after fully_shard")
        (self._main if self._main.flat is not None else self._model).broadcast(axis)
        self.mark_weights_stale()

    # ------------------------------------------------------------ reporting
    def resident_bytes(self) -> dict[str, int]:
        """Bytes of device storage this group holds right now, by buffer."""
        main_grad = self.window.kept_main_grad()
        own_main = self.main is not None and self.main is not self.model_shard
        if self.offloaded:  # on the host: see host_bytes()
            own_main, main_grad = False, None
        return {
            "model_shard": 0 if self.model_shard is None else self.model_shard.untyped_storage().nbytes(),
            "main": self.main.untyped_storage().nbytes() if own_main else (
                0 if self.extensions is None else self.extensions.nbytes()),
            "unsharded": 0 if self.persistent_unsharded else self.storage_bytes_unsharded,
            "main_grad": 0 if main_grad is None else main_grad.untyped_storage().nbytes(),
            "grad_acc": 0 if self.grad_acc is None or self.grad_acc is main_grad else self.grad_acc.untyped_storage().nbytes(),
        }

    def host_bytes(self) -> dict[str, int]:
        """Bytes of host memory an offloaded group holds right now (main weights and grads)."""
        if not self.offloaded:
            return {"main": 0, "main_grad": 0}
        grad = self.window.kept_main_grad()
        return {"main": self.main.untyped_storage().nbytes(), "main_grad": 0 if grad is None else grad.untyped_storage().nbytes()}
