"""One parameter group: its flat buffers and their lifecycle.

A group is the parameters of one unit that share a dtype and requires_grad.
It owns, in its ``FlatLayout``:

- ``main``: the main weights (``main_params_dtype``) in the optimizer
  placement; the sharded DTensor parameters the optimizer sees are views of it;
- ``model_shard``: the compute-dtype model weights in the parameter placement
  (a view of ``main`` where dtype and placement allow, so fp32 ZeRO-3 keeps
  one copy);
- ``unsharded``: the full compute-dtype buffer forward and backward read;
  its storage is freed while the group rests when parameters are sharded;
- ``grad_acc`` / ``main_grad``: gradients accumulated in the gradient
  placement across micro-batches, and finalized in the optimizer placement.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .buffers import InFlight, StreamSet, all_gather_chain, all_reduce_chain, reduce_scatter_chain
from .layout import FlatLayout, Slot
from .mesh import ShardingPlan
from .precision import MixedPrecisionPolicy

__all__ = ["ParamRef", "ParamGroup", "rows_view"]


@dataclass
class ParamRef:
    """A parameter and every (module, attribute) that holds it (more than one when tied).

    ``model_parallel_dims`` maps a model-parallel mesh axis (``tp``, ``ep``) to
    the dimension along which the local parameter is one slice of the global
    tensor; the DTensors then describe the global tensor.
    """

    fqn: str
    param: nn.Parameter
    holders: list[tuple[nn.Module, str]]
    model_parallel_dims: dict[str, int] = field(default_factory=dict)


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))


def rows_view(buffer: torch.Tensor, buffer_start: int, slot: Slot, rows: tuple[int, int]) -> torch.Tensor:
    """The view of ``buffer`` (which begins at flat offset ``buffer_start``) holding ``rows`` of a slot."""
    first, last = rows
    begin = slot.offset + first * slot.row_numel - buffer_start
    return buffer[begin : begin + (last - first) * slot.row_numel].view(last - first, *slot.shape[1:])


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
    ):
        self.name = name
        self.refs = list(refs)
        self.fqns = [r.fqn for r in self.refs]
        self.plan = plan
        self.streams = streams
        self.device = device
        first = self.refs[0].param
        self.requires_grad = first.requires_grad
        self.sum_over_axes = list(sum_over_axes)
        self.compute_dtype = policy.compute_dtype(first.dtype)
        self.main_dtype = policy.main_params_dtype
        self.main_grad_dtype = policy.main_grads_dtype
        self.comm_dtype = policy.comm_dtype
        self.layout = FlatLayout([r.param.shape for r in self.refs], plan.shard_count)
        self.global_shapes = [plan.global_shape(r.param.shape, r.model_parallel_dims) for r in self.refs]
        self.dtensor_placements = [plan.dtensor_placements(r.model_parallel_dims) for r in self.refs]
        total = self.layout.total

        # Flat ranges this rank holds in each placement.
        self.param_range = self.layout.shard_range(plan.index(plan.param_axes), plan.count(plan.param_axes))
        self.grad_range = self.layout.shard_range(plan.index(plan.grad_axes), plan.count(plan.grad_axes))
        self.opt_range = self.layout.shard_range(plan.index(plan.opt_axes), plan.count(plan.opt_axes))

        p0, p1 = self.param_range
        o0, o1 = self.opt_range
        self.main_aliases_model = self.compute_dtype == self.main_dtype
        # With ZeRO-3-like placements (parameters sharded exactly like the optimizer state) a
        # lower-precision model-weight shard is cast from the main weights on the gather
        # stream right before each gather instead of being kept: 2 bytes/param less at rest.
        self.casts_on_gather = (
            not self.main_aliases_model and plan.shards_parameters and not plan.refresh_gather_axes
        )
        with torch.no_grad():
            self.model_shard: torch.Tensor | None = None
            if not self.casts_on_gather:
                self.model_shard = torch.zeros(p1 - p0, dtype=self.compute_dtype, device=device)
                self._fill(self.model_shard, p0, p1)
            if self.main_aliases_model:
                self.main = self.model_shard[o0 - p0 : o1 - p0]
            else:
                self.main = torch.zeros(o1 - o0, dtype=self.main_dtype, device=device)
                self._fill(self.main, o0, o1)
        self.sharded_params = [self._make_sharded_param(i) for i in range(len(self.refs))]

        # The unsharded buffer and the leaf parameters forward uses.
        self.persistent_unsharded = not plan.shards_parameters
        if self.persistent_unsharded:
            self.unsharded = self.model_shard
        else:
            self.unsharded = torch.empty(total, dtype=self.compute_dtype, device=device)
        self.unsharded_params = [
            nn.Parameter(
                self.unsharded[slot.offset : slot.end].view(slot.shape), requires_grad=self.requires_grad
            )
            for slot in self.layout.slots
        ]
        if not self.persistent_unsharded:
            self.unsharded.untyped_storage().resize_(0)  # the views above keep their shapes
        self._is_unsharded = self.persistent_unsharded
        self._gather: InFlight | None = None
        self._swapped_in = False

        # Gradient state: buffers exist only from a step's first reduction until the
        # optimizer drops the ``.grad`` DTensors (see _open_window).
        self.grad_acc: torch.Tensor | None = None
        self.main_grad: torch.Tensor | None = None
        self._main_grad_ref: weakref.ref | None = None
        self._window_open = False  # micro-batches accumulated since the last finalize
        self._acc_overwrite = False
        self._main_overwrite = False
        self._pending_install = False
        self._released: tuple = ()
        self._gaps = self.layout.gaps()
        self.weights_stale = False

    # ----------------------------------------------------------- construction
    def _fill(self, buffer: torch.Tensor, start: int, end: int) -> None:
        for ref, slot in zip(self.refs, self.layout.slots):
            rows = slot.rows_in(start, end)
            if rows[1] > rows[0]:
                rows_view(buffer, start, slot, rows).copy_(ref.param.detach()[rows[0] : rows[1]])

    def _dtensor(self, i: int, local: torch.Tensor) -> DTensor:
        shape = self.global_shapes[i]
        return DTensor.from_local(
            local,
            self.plan.mesh,
            self.dtensor_placements[i],
            run_check=False,
            shape=shape,
            stride=_contiguous_stride(shape),
        )

    def _make_sharded_param(self, i: int) -> nn.Parameter:
        ref, slot = self.refs[i], self.layout.slots[i]
        local = rows_view(self.main, self.opt_range[0], slot, slot.rows_in(*self.opt_range))
        param = nn.Parameter(self._dtensor(i, local), requires_grad=ref.param.requires_grad)
        # Keep the model's own annotations (tensor_model_parallel, partition_dim, allreduce, ...).
        for key, value in vars(ref.param).items():
            if not key.startswith("_"):
                setattr(param, key, value)
        param._shardwise_group = self  # lets optimizer hooks and clipping find the group
        return param

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
        return self._is_unsharded

    @property
    def storage_bytes_unsharded(self) -> int:
        return self.unsharded.untyped_storage().nbytes()

    def start_unshard(self) -> None:
        """Begin gathering the model weights (returns at once on CUDA)."""
        if self._is_unsharded or self._gather is not None:
            return
        self.unsharded.untyped_storage().resize_(self.unsharded.numel() * self.unsharded.element_size())
        with self.streams.on(self.streams.gather), torch.autograd._unsafe_preserve_version_counter(self.unsharded):
            source = self.model_shard if self.model_shard is not None else self.main.to(self.compute_dtype)
            all_gather_chain(self.unsharded, source, self.plan.param_axes)
        self._gather = InFlight(self.streams.record(self.streams.gather))

    def finish_unshard(self) -> None:
        if self._is_unsharded:
            return
        if self._gather is None:
            self.start_unshard()
        self._gather.wait()
        self._gather = None
        self._is_unsharded = True

    def reshard(self) -> None:
        """Free the unsharded storage (when parameters are sharded) and swap DTensors back in."""
        self.use_sharded()
        if self.persistent_unsharded:
            return
        if self._gather is not None:  # prefetched but never used
            self._gather.wait()
            self._gather = None
        if self._is_unsharded:
            self.unsharded.untyped_storage().resize_(0)
            self._is_unsharded = False

    # --------------------------------------------------------------- grads
    def _grad_views(self, main_grad: torch.Tensor) -> list[DTensor]:
        o0, o1 = self.opt_range
        return [
            self._dtensor(i, rows_view(main_grad, o0, slot, slot.rows_in(o0, o1)))
            for i, slot in enumerate(self.layout.slots)
        ]

    def _open_window(self) -> None:
        """Start accumulating a step's gradients.

        The main-grad buffer lives only as long as the ``.grad`` DTensors that
        view it: once ``optimizer.zero_grad()`` drops them it is freed, and the
        next step allocates a fresh one that the first reduction overwrites
        (no zero-fill). Grads the user kept are accumulated onto.
        """
        o0, o1 = self.opt_range
        g0, g1 = self.grad_range
        cleared = [p.grad is None for p in self.sharded_params]
        existing = self._main_grad_ref() if self._main_grad_ref is not None else None
        if all(cleared) or existing is None:
            self.main_grad = torch.empty(o1 - o0, dtype=self.main_grad_dtype, device=self.device)
            self._main_grad_ref = weakref.ref(self.main_grad)
            fresh = True
        else:
            self.main_grad = existing
            for was_cleared, slot in zip(cleared, self.layout.slots):
                if was_cleared:
                    rows_view(existing, o0, slot, slot.rows_in(o0, o1)).zero_()
            fresh = False
        if (g0, g1) == (o0, o1):
            self.grad_acc = self.main_grad
            self._acc_overwrite = fresh
            self._main_overwrite = False
        else:  # a Partial accumulation buffer of its own, restarted every window
            self.grad_acc = torch.empty(g1 - g0, dtype=self.main_grad_dtype, device=self.device)
            self._acc_overwrite = True
            self._main_overwrite = fresh
        self._window_open = True

    def _flat_grads(self) -> torch.Tensor:
        """Copy the unsharded grads (zeros where missing) into one comm-dtype buffer, one kernel."""
        flat = torch.empty(self.layout.total, dtype=self.comm_dtype, device=self.device)
        targets, grads = [], []
        for param, slot in zip(self.unsharded_params, self.layout.slots):
            view = flat[slot.offset : slot.end]
            if param.grad is None:
                view.zero_()
            else:
                targets.append(view.view(slot.shape))
                grads.append(param.grad)
                param.grad = None
        for start, end in self._gaps:
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
        if not self._window_open:
            self._open_window()
        self._released = ()
        flat = self._flat_grads()
        plan = self.plan
        with self.streams.on(self.streams.reduce):
            shard = reduce_scatter_chain(flat, plan.grad_axes)
            if plan.grad_scale != 1.0:
                shard.mul_(plan.grad_scale)
            if self._acc_overwrite:
                self.grad_acc.copy_(shard)
                self._acc_overwrite = False
            else:
                self.grad_acc.add_(shard)
            if finalize:
                self._finalize()
        return InFlight(self.streams.record(self.streams.reduce), keepalive=(flat, *self._released))

    def finalize_without_new_grads(self) -> InFlight | None:
        """End an accumulation window whose last micro-batch brought no grads to this group."""
        if not self._window_open:
            return None
        with self.streams.on(self.streams.reduce):
            self._finalize()
        return InFlight(self.streams.record(self.streams.reduce), keepalive=self._released)

    def _finalize(self) -> None:
        plan = self.plan
        if self.sum_over_axes:  # partial sums across model-parallel ranks (sequence parallel)
            all_reduce_chain(self.grad_acc, self.sum_over_axes, average=False)
        if self.grad_acc is self.main_grad:
            all_reduce_chain(self.main_grad, plan.finalize_allreduce_axes)
        else:
            reduced = reduce_scatter_chain(self.grad_acc, plan.finalize_scatter_axes)
            all_reduce_chain(reduced, plan.finalize_allreduce_axes)
            if self._main_overwrite:
                self.main_grad.copy_(reduced)
            else:
                self.main_grad.add_(reduced)
            # the reduce stream may still read it: the caller keeps it alive until it waits
            self._released = (self.grad_acc,)
        self.grad_acc = None
        self._window_open = False
        self._pending_install = True

    def discard_grads(self) -> None:
        """Drop installed grads and any accumulation still open (the next backward overwrites)."""
        for param in self.sharded_params:
            param.grad = None
        for param in self.unsharded_params:
            param.grad = None
        self.grad_acc = None
        self.main_grad = None
        self._window_open = False
        self._pending_install = False

    def install_grads(self) -> None:
        """Expose the finalized main grads as the sharded parameters' ``.grad``.

        Only the ``.grad`` DTensors keep the buffer alive from here on.
        """
        if not self._pending_install:
            return
        existing = [p.grad for p in self.sharded_params]
        if all(g is not None and g._local_tensor._base is self.main_grad for g in existing):
            pass  # accumulated onto the grads already installed
        else:
            for param, grad in zip(self.sharded_params, self._grad_views(self.main_grad)):
                param.grad = grad
        self.main_grad = None
        self._pending_install = False

    # -------------------------------------------------------- weight refresh
    @torch.no_grad()
    def refresh_model_weights(self) -> None:
        """Rebuild the compute-dtype model weights from the main weights after an update."""
        if not self.weights_stale:
            return
        self.weights_stale = False
        plan = self.plan
        if self.model_shard is None or (self.main_aliases_model and not plan.refresh_gather_axes):
            return
        p0 = self.param_range[0]
        o0, o1 = self.opt_range
        own = self.model_shard[o0 - p0 : o1 - p0]
        with torch.autograd._unsafe_preserve_version_counter(self.model_shard):
            if not self.main_aliases_model:
                own.copy_(self.main)
            all_gather_chain(self.model_shard, own, plan.refresh_gather_axes)

    # --------------------------------------------------------- full weights
    @torch.no_grad()
    def full_main_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter of the group, unsharded, in the main dtype (a collective)."""
        full = torch.empty(self.layout.total, dtype=self.main_dtype, device=self.device)
        all_gather_chain(full, self.main, self.plan.opt_axes)
        return {fqn: full[s.offset : s.end].view(s.shape).clone() for fqn, s in zip(self.fqns, self.layout.slots)}

    # ------------------------------------------------------------ reporting
    def resident_bytes(self) -> dict[str, int]:
        """Bytes of device storage this group holds right now, by buffer."""
        main_grad = self._main_grad_ref() if self._main_grad_ref is not None else None
        return {
            "model_shard": 0 if self.model_shard is None else self.model_shard.untyped_storage().nbytes(),
            "main": 0 if self.main_aliases_model else self.main.untyped_storage().nbytes(),
            "unsharded": 0 if self.persistent_unsharded else self.storage_bytes_unsharded,
            "main_grad": 0 if main_grad is None else main_grad.untyped_storage().nbytes(),
            "grad_acc": 0 if self.grad_acc is None or self.grad_acc is main_grad else self.grad_acc.untyped_storage().nbytes(),
        }
