"""One parameter group: its buffers and their lifecycle.

A group is the parameters of one unit that share a dtype and requires_grad.
Each buffer holds one *level* of every parameter's sharding (see ``layout``),
one slot per parameter packed into a flat tensor:

- ``main``: the main weights (``main_params_dtype``) at the optimizer level;
  the sharded DTensor parameters the optimizer sees view their real rows.
  Where dtypes allow it lives inside ``model_shard`` (fp32 keeps one copy);
- ``model_shard``: the compute-dtype model weights at the parameter level;
- ``unsharded``: the full compute-dtype parameters forward and backward read
  (level 0); its storage is freed while the group rests when parameters are
  sharded;
- ``grad_acc`` / ``main_grad``: gradients accumulated at the gradient level
  across micro-batches, and finalized at the optimizer level.

Moving between levels is one coalesced group of per-parameter collectives
per mesh axis; every parameter's gathered rows land contiguous in its slot.
"""

from __future__ import annotations

import enum
import weakref
from typing import Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .buffers import Collectives, InFlight, StreamSet
from .layout import LevelLayout
from .mesh import ShardingPlan
from .offload import HostMemory
from .param import ParamRef, ShardedParam
from .precision import MixedPrecisionPolicy

__all__ = ["ParamRef", "ParamGroup", "WeightState", "GradState"]


class WeightState(enum.Enum):
    """Where a group's full compute-dtype weights are."""

    SHARDED = "sharded"  # only shards exist; the unsharded storage is freed
    GATHERING = "gathering"  # an all-gather into the unsharded storage is in flight
    UNSHARDED = "unsharded"  # the full weights are there for forward and backward


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
    ):
        self.name = name
        self.refs = list(refs)
        self.fqns = [r.fqn for r in self.refs]
        self.params = [ShardedParam(r, plan) for r in self.refs]
        self.plan = plan
        self.streams = streams
        self.collectives = collectives or Collectives()
        self.device = device
        first = self.refs[0].param
        self.requires_grad = first.requires_grad
        self.sum_over_axes = list(sum_over_axes)
        self.compute_dtype = policy.compute_dtype(first.dtype)
        self.main_dtype = policy.main_params_dtype
        self.main_grad_dtype = policy.main_grads_dtype
        self.comm_dtype = policy.comm_dtype
        # Offloaded: main weights (so the optimizer state) and the finished grads live on the host.
        self.offloaded = offload
        # page-locked only where a GPU copies from it (a gloo run on a CUDA host makes no CUDA context)
        self._host = HostMemory(pin_memory and device.type == "cuda") if offload else None
        self._host_grad: torch.Tensor | None = None  # reused step after step unless the user kept the last grads
        self._host_ready: "torch.cuda.Event | None" = None  # the grads' copy to the host
        self._upload_pending = False  # updated host weights not yet copied into the model shard
        self._host_kept = None  # grads the user kept across steps, added to at install
        # Levels of the buffers: parameter, gradient and optimizer placements.
        self.param_level = len(plan.param_axes)
        self.grad_level = len(plan.grad_axes)
        self.opt_level = len(plan.opt_axes)
        self.layouts = [
            LevelLayout([p.slot_numel(level) for p in self.params]) for level in range(self.opt_level + 1)
        ]
        kp, m = self.param_level, self.opt_level
        self.main_aliases_model = self.compute_dtype == self.main_dtype and not offload
        # With ZeRO-3-like placements (parameters sharded exactly like the optimizer state) a
        # lower-precision model-weight shard is cast from the main weights on the gather
        # stream right before each gather instead of being kept: 2 bytes/param less at rest.
        self.casts_on_gather = not self.main_aliases_model and kp == m and kp > 0 and not offload
        with torch.no_grad():
            self.model_shard: torch.Tensor | None = None
            self._model_views: list[torch.Tensor] | None = None
            if not self.casts_on_gather:
                self.model_shard = torch.zeros(self.layouts[kp].total, dtype=self.compute_dtype, device=device)
                self._model_views = self.layouts[kp].views(self.model_shard)
                self._fill(self._model_views, kp)
            self.main: torch.Tensor | None  # the flat main weights, when they have a buffer of their own
            if self.main_aliases_model and m == kp:
                self.main, self._main_views = self.model_shard, self._model_views
            elif self.main_aliases_model and m == kp + 1:  # this rank's pieces inside the model shard
                self.main = None
                self._main_views = [p.own_piece(v, m) for p, v in zip(self.params, self._model_views)]
            elif offload:
                self.main = self._host.empty(self.layouts[m].total, self.main_dtype).zero_()
                self._main_views = self.layouts[m].views(self.main)
                self._fill(self._main_views, m)
            else:
                self.main = torch.zeros(self.layouts[m].total, dtype=self.main_dtype, device=device)
                self._main_views = self.layouts[m].views(self.main)
                self._fill(self._main_views, m)
        self.sharded_params = [self._make_sharded_param(i) for i in range(len(self.params))]

        # The unsharded buffer and the leaf parameters forward uses.
        self.persistent_unsharded = kp == 0
        if self.persistent_unsharded:
            self.unsharded = self.model_shard
            self._unsharded_views = self._model_views
        else:
            self.unsharded = torch.empty(self.layouts[0].total, dtype=self.compute_dtype, device=device)
            self._unsharded_views = self.layouts[0].views(self.unsharded)
        self.unsharded_params = [
            nn.Parameter(view[: p.shape.numel()].view(p.shape), requires_grad=self.requires_grad)
            for p, view in zip(self.params, self._unsharded_views)
        ]
        if not self.persistent_unsharded:
            self.unsharded.untyped_storage().resize_(0)  # the views above keep their shapes
        self.weight_state = WeightState.UNSHARDED if self.persistent_unsharded else WeightState.SHARDED
        self._gather: InFlight | None = None  # the all-gather while GATHERING
        self._swapped_in = False

        # Gradient state: buffers exist only from a step's first reduction until the
        # optimizer drops the ``.grad`` DTensors (see _open_window).
        self.grad_acc: torch.Tensor | None = None
        self.main_grad: torch.Tensor | None = None
        self._main_grad_ref: weakref.ref | None = None
        self.grad_state = GradState.IDLE
        self._acc_overwrite = False  # the accumulation buffer holds nothing yet: the first reduction overwrites
        self._main_overwrite = False  # likewise for the main-grad buffer
        self._released: tuple = ()
        self._grad_gaps = self.layouts[0].gaps([p.shape.numel() for p in self.params])
        self.weights_stale = False  # set when the main weights changed in a way their version does not show
        self._refreshed_version = self._main_version()

    # ----------------------------------------------------------- construction
    def _fill(self, views: list[torch.Tensor], level: int) -> None:
        for ref, p, view in zip(self.refs, self.params, views):
            p.local(view, level).copy_(p.shard_of(ref.param.detach(), level))

    def _make_sharded_param(self, i: int) -> nn.Parameter:
        ref, p = self.refs[i], self.params[i]
        local = p.local(self._main_views[i], self.opt_level)
        param = nn.Parameter(p.dtensor(local), requires_grad=ref.param.requires_grad)
        # Keep the model's own annotations (tensor_model_parallel, partition_dim, allreduce, ...).
        for key, value in vars(ref.param).items():
            if not key.startswith("_"):
                setattr(param, key, value)
        return param

    # ------------------------------------------------------- level movement
    def _paired(self, level: int, parents: list[torch.Tensor], pieces: list[torch.Tensor]) -> tuple[list, list]:
        """For a collective between ``level - 1`` and ``level``: each parameter's gathered region of its
        parent slot and its piece (parameters with no rows at this level take no part)."""
        gathered, own = [], []
        for p, parent, piece in zip(self.params, parents, pieces):
            if p.piece_numel(level):
                gathered.append(parent[: p.gathered_numel(level)])
                own.append(piece[: p.piece_numel(level)])
        return gathered, own

    def _gather_levels(self, views: list[torch.Tensor], top: int, bottom: int, targets: list[torch.Tensor]) -> list:
        """All-gather every parameter's pieces from level ``top`` down to ``bottom`` into ``targets``.

        Returns the temporaries the side stream still reads.
        """
        temps = []
        for level in range(top, bottom, -1):
            if level - 1 == bottom:
                out_views = targets
            else:
                temp = torch.empty(self.layouts[level - 1].total, dtype=views[0].dtype, device=self.device)
                temps.append(temp)
                out_views = self.layouts[level - 1].views(temp)
            self.collectives.gather(*self._paired(level, out_views, views), self.plan.opt_axes[level - 1])
            views = out_views
        return temps

    def _reduce_levels(self, flat: torch.Tensor, bottom: int, top: int, staged: list) -> torch.Tensor:
        """Reduce-scatter a flat buffer of level ``bottom`` down to a staged one of level ``top``.

        Slot rows past a piece's real rows hold whatever the padding summed to;
        nothing reads them.
        """
        for level in range(bottom + 1, top + 1):
            total = self.layouts[level].total
            buffer = self.streams.pool.take(total, flat.dtype, self.device)
            staged.append(buffer)
            out = buffer[:total]
            ins, outs = self._paired(level, self.layouts[level - 1].views(flat), self.layouts[level].views(out))
            self.collectives.reduce_scatter(outs, ins, self.plan.opt_axes[level - 1])
            flat = out
        return flat

    # ------------------------------------------------------------- swapping
    def install_sharded_params(self) -> None:
        """Replace the original parameters in their modules and drop our references to them."""
        self._swapped_in = True
        self.use_sharded()
        for ref in self.refs:
            ref.param = None

    def use_unsharded(self) -> None:
        """Point every holding module at the unsharded parameters (for forward)."""
        if self._swapped_in:
            return
        for ref, param in zip(self.refs, self.unsharded_params):
            for module, attr in ref.holders:
                module._parameters[attr] = param
        self._swapped_in = True

    def use_sharded(self) -> None:
        """Point every holding module back at the sharded DTensor parameters."""
        if not self._swapped_in:
            return
        for ref, param in zip(self.refs, self.sharded_params):
            for module, attr in ref.holders:
                module._parameters[attr] = param
        self._swapped_in = False

    # ------------------------------------------------------- unshard / free
    @property
    def is_unsharded(self) -> bool:
        return self.weight_state is WeightState.UNSHARDED

    @property
    def storage_bytes_unsharded(self) -> int:
        return self.unsharded.untyped_storage().nbytes()

    def start_unshard(self) -> None:
        """Begin gathering the model weights (returns at once on CUDA)."""
        if self.weight_state is not WeightState.SHARDED:
            return
        self.unsharded.untyped_storage().resize_(self.unsharded.numel() * self.unsharded.element_size())
        level = self.param_level
        with self.streams.on(self.streams.gather), torch.autograd._unsafe_preserve_version_counter(self.unsharded):
            staged = ()
            if self.model_shard is not None:
                if self._upload_pending:  # offloaded: the optimizer's update comes in right before the gather
                    self.model_shard.copy_(self.main, non_blocking=True)
                    self._upload_pending = False
                views = self._model_views
            else:  # ZeRO-3 mixed precision: cast the main shard right before the gather
                buffer = self.streams.pool.take(self.main.numel(), self.compute_dtype, self.device)
                source = buffer[: self.main.numel()]
                source.copy_(self.main)
                views = self.layouts[level].views(source)
                staged = (buffer,)
            temps = self._gather_levels(views, level, 0, self._unsharded_views)
        self._gather = InFlight(
            self.streams.record(self.streams.gather), keepalive=tuple(temps), staged=staged, pool=self.streams.pool
        )
        self.weight_state = WeightState.GATHERING

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
            self.unsharded.untyped_storage().resize_(0)
            self.weight_state = WeightState.SHARDED

    # --------------------------------------------------------------- grads
    def _grad_views(self, main_grad: torch.Tensor) -> list[DTensor]:
        views = self.layouts[self.opt_level].views(main_grad)
        return [p.dtensor(p.local(v, self.opt_level)) for p, v in zip(self.params, views)]

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
        cleared = [p.grad is None for p in self.sharded_params]
        existing = self._main_grad_ref() if self._main_grad_ref is not None else None
        if self.offloaded:  # the host grads the user kept are added to at install time
            self._host_kept = None if all(cleared) or existing is None else (existing, cleared)
            existing = None
        if all(cleared) or existing is None:
            self.main_grad = torch.empty(self.layouts[m].total, dtype=self.main_grad_dtype, device=self.device)
            self._main_grad_ref = weakref.ref(self.main_grad)
            fresh = True
        else:
            self.main_grad = existing
            for was_cleared, p, view in zip(cleared, self.params, self.layouts[m].views(existing)):
                if was_cleared:
                    p.local(view, m).zero_()
            fresh = False
        if self.grad_level == m:
            self.grad_acc = self.main_grad
            self._acc_overwrite = fresh
            self._main_overwrite = False
        else:  # a Partial accumulation buffer of its own, restarted every window
            self.grad_acc = torch.empty(self.layouts[self.grad_level].total, dtype=self.main_grad_dtype, device=self.device)
            self._acc_overwrite = True
            self._main_overwrite = fresh
        self.grad_state = GradState.ACCUMULATING

    def _flat_grads(self, staged: list) -> torch.Tensor:
        """Copy the unsharded grads (zeros where missing) into one comm-dtype buffer, one kernel."""
        total = self.layouts[0].total
        buffer = self.streams.pool.take(total, self.comm_dtype, self.device)
        staged.append(buffer)
        flat = buffer[:total]
        targets, grads = [], []
        for param, p, view in zip(self.unsharded_params, self.params, self.layouts[0].views(flat)):
            view = view[: p.shape.numel()]
            if param.grad is None:
                view.zero_()
            else:
                targets.append(view.view(p.shape))
                grads.append(param.grad)
                param.grad = None
        for start, end in self._grad_gaps:
            flat[start:end].zero_()
        if grads:
            torch._foreach_copy_(targets, grads)
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
        flat = self._flat_grads(staged)
        plan = self.plan
        with self.streams.on(self.streams.reduce):
            shard = self._reduce_levels(flat, 0, self.grad_level, staged)
            if plan.grad_scale != 1.0:
                shard.mul_(plan.grad_scale)
            if self._acc_overwrite:
                self.grad_acc.copy_(shard)
                self._acc_overwrite = False
            else:
                self.grad_acc.add_(shard)
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
        plan = self.plan
        if self.sum_over_axes:  # partial sums across model-parallel ranks (sequence parallel)
            self.collectives.all_reduce(self.grad_acc, self.sum_over_axes, average=False)
        if self.grad_acc is self.main_grad:
            self.collectives.all_reduce(self.main_grad, plan.finalize_allreduce_axes)
        else:
            reduced = self._reduce_levels(self.grad_acc, self.grad_level, self.opt_level, staged)
            self.collectives.all_reduce(reduced, plan.finalize_allreduce_axes)
            if self._main_overwrite:
                self.main_grad.copy_(reduced)
            else:
                self.main_grad.add_(reduced)
            # the reduce stream may still read it: the caller keeps it alive until it waits
            self._released = (self.grad_acc,)
        self.grad_acc = None
        self.grad_state = GradState.REDUCED
        if self.offloaded:  # stream the finished shard to the host right behind its reduction
            if self._host_grad is None:
                self._host_grad = self._host.empty(self.main_grad.numel(), self.main_grad.dtype)
            host = self._host_grad
            if self._host_kept is not None:  # the user kept last step's grads there: add to them at install
                host = torch.empty(self.main_grad.numel(), dtype=self.main_grad.dtype)
            host.copy_(self.main_grad, non_blocking=True)
            self._released = self._released + (self.main_grad,)
            self.main_grad = host

    def discard_grads(self) -> None:
        """Drop installed grads and any accumulation still open (the next backward overwrites)."""
        for param in self.sharded_params:
            param.grad = None
        for param in self.unsharded_params:
            param.grad = None
        self.grad_acc = None
        self.main_grad = None
        self.grad_state = GradState.IDLE
        self._host_ready = None
        self._host_kept = None

    def install_grads(self) -> None:
        """Expose the finalized main grads as the sharded parameters' ``.grad``.

        Only the ``.grad`` DTensors keep the buffer alive from here on.
        """
        if self.grad_state is not GradState.REDUCED:
            return
        if self.offloaded:
            self._install_host_grads()
            return
        existing = [p.grad for p in self.sharded_params]
        if all(g is not None and g._local_tensor._base is self.main_grad for g in existing):
            pass  # accumulated onto the grads already installed
        else:
            for param, grad in zip(self.sharded_params, self._grad_views(self.main_grad)):
                param.grad = grad
        self.main_grad = None
        self.grad_state = GradState.IDLE
        # An optimizer step on these grads may not show in any version counter: on CUDA, torch's
        # default (foreach) AdamW over DTensors moved none (2 x H200, torch 2.11), so the next
        # forward rebuilds the model weights whenever grads were handed out.
        self.weights_stale = True

    def _install_host_grads(self) -> None:
        if self._host_ready is not None:
            self._host_ready.synchronize()  # the host copy has landed
            self._host_ready = None
        kept = self._host_kept
        if kept is not None:  # accumulate onto the grads the user did not clear
            existing, cleared = kept
            m = self.opt_level
            for was_cleared, p, old, new in zip(
                cleared, self.params, self.layouts[m].views(existing), self.layouts[m].views(self.main_grad)
            ):
                target, fresh = p.local(old, m), p.local(new, m)
                if was_cleared:
                    target.copy_(fresh)
                else:
                    target.add_(fresh)
            self.main_grad = existing
        self._host_kept = None
        if kept is None or any(p.grad is None for p in self.sharded_params):
            for param, grad in zip(self.sharded_params, self._grad_views(self.main_grad)):
                param.grad = grad
        self._main_grad_ref = weakref.ref(self.main_grad)
        self.main_grad = None
        self.grad_state = GradState.IDLE
        self.weights_stale = True

    # -------------------------------------------------------- weight refresh
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
        if not self.weights_stale and version == self._refreshed_version:
            return
        self.weights_stale = False
        self._refreshed_version = version
        kp, m = self.param_level, self.opt_level
        if self.offloaded and kp == m and kp > 0:
            self._upload_pending = True  # copied in on the gather stream, right before the next gather
            return
        if self.offloaded and kp == m:  # replicated weights (no_shard): one copy from the host
            self.model_shard.copy_(self.main, non_blocking=True)
            return
        if self.model_shard is None or (self.main_aliases_model and m == kp):
            return
        if self.main is None:  # main weights are this rank's pieces of the model shard: gather in place
            views = self._main_views
        else:  # (from the host when offloaded)
            views = self.layouts[m].views(self.main.to(self.device, self.compute_dtype, non_blocking=True))
        with torch.autograd._unsafe_preserve_version_counter(self.model_shard):
            self._gather_levels(views, m, kp, self._model_views)

    @torch.no_grad()
    def broadcast_main_weights(self, axis) -> None:
        """Give every rank of ``axis`` (where main weights are replicated) the first rank's values."""
        import torch.distributed as dist

        buffer = self.main if self.main is not None else self.model_shard
        if buffer.numel():
            on_device = buffer.to(self.device)  # the buffer itself when it is not offloaded
            dist.broadcast(on_device, src=dist.get_global_rank(axis.group, 0), group=axis.group)
            if on_device is not buffer:
                buffer.copy_(on_device)
        self.weights_stale = True

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
