"""Collectives over a flat buffer, one mesh axis at a time, on side streams.

Each transition between placements is a chain of 1-D collectives: Shard->
Replicate is an all-gather per axis (least significant axis first),
Partial->Shard a reduce-scatter per axis (most significant first),
Partial->Replicate an all-reduce. Averages divide by the axis size (NCCL's
``AVG`` does that inside the collective; gloo sums, then we divide).

On CUDA the chains run on a gather or a reduce side stream that first waits
for the compute stream; the caller gets an event to make the compute stream
wait on before it reads the result. Tensors the side stream reads are kept
alive by the caller until that wait (no ``record_stream``). On CPU everything
is synchronous over gloo: same calls, no streams.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist

from .mesh import AxisGroup

__all__ = ["StreamSet", "all_gather_chain", "reduce_scatter_chain", "all_reduce_chain", "InFlight"]


class StreamSet:
    """The side streams of one sharded model (none on CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.gather = torch.cuda.Stream(device=device) if self.cuda else None
        self.reduce = torch.cuda.Stream(device=device) if self.cuda else None

    @contextlib.contextmanager
    def on(self, stream: "torch.cuda.Stream | None") -> Iterator[None]:
        """Run the body on ``stream`` after everything already queued on the compute stream."""
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            yield

    def record(self, stream: "torch.cuda.Stream | None") -> "torch.cuda.Event | None":
        if stream is None:
            return None
        event = torch.cuda.Event()
        event.record(stream)
        return event


class InFlight:
    """A finished-on-the-host, maybe-running-on-the-device operation and what it reads."""

    __slots__ = ("event", "keepalive")

    def __init__(self, event: "torch.cuda.Event | None", keepalive: tuple = ()):
        self.event = event
        self.keepalive = keepalive

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        self.event = None
        self.keepalive = ()


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch 2.13 renamed the single-tensor collectives; 2.11 only has the old names.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=op, group=group)


def _average(t: torch.Tensor, axis: AxisGroup, native: bool) -> None:
    if not native:
        t.div_(axis.size)


def all_gather_chain(out: torch.Tensor, shard: torch.Tensor, axes: Sequence[AxisGroup]) -> None:
    """Gather ``shard`` (sharded over ``axes``, first axis most significant) into ``out``."""
    if not axes:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return
    current = shard
    for i, axis in enumerate(reversed(axes)):
        last = i == len(axes) - 1
        target = out if last else torch.empty(current.numel() * axis.size, dtype=out.dtype, device=out.device)
        if not axis.averages_natively and _overlaps(target, current):
            current = current.clone()  # gloo copies shards in place without aliasing checks
        _all_gather(target, current, axis.group)
        current = target


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def reduce_scatter_chain(flat: torch.Tensor, axes: Sequence[AxisGroup]) -> torch.Tensor:
    """Average-reduce ``flat`` and keep this rank's shard over ``axes`` (first most significant)."""
    current = flat
    for axis in axes:
        native = axis.averages_natively
        out = torch.empty(current.numel() // axis.size, dtype=current.dtype, device=current.device)
        op = dist.ReduceOp.AVG if native else dist.ReduceOp.SUM
        _reduce_scatter(out, current, op, axis.group)
        _average(out, axis, native)
        current = out
    return current


def all_reduce_chain(t: torch.Tensor, axes: Sequence[AxisGroup], average: bool = True) -> None:
    """Average (or sum) ``t`` in place over each of ``axes``."""
    for axis in axes:
        native = axis.averages_natively and average
        dist.all_reduce(t, op=dist.ReduceOp.AVG if native else dist.ReduceOp.SUM, group=axis.group)
        if average:
            _average(t, axis, native)
