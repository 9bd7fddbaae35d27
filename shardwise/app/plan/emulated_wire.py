"""The wire of a dry run: every collective the engine calls holds the stream it is called on for the time the
step model gives it, and moves no bytes between ranks.

A dry run (``dry_run.py``) runs rank 0 of a world-N job on one device, on torch's ``fake`` process group. The
engine moves every buffer through its ``Collectives`` object (``fully_shard(collectives=...)``), so
:class:`EmulatedCollectives` is where the wire is replaced:

* each call's time is ``latency + factor (n - 1)/n x bytes / bus bandwidth`` over the link the axis spans
  (:class:`WireModel`: ``step_time.collective_time`` over ``Cluster.link``, the static plan's own terms, so
  the two can only differ in what the engine really does: how many calls, which bytes, what overlaps);
* on CUDA the call launches a kernel that spins for that time (:class:`StreamHold`, ``torch.cuda._sleep``
  with its clock rate measured once) on the current stream, which is the engine's gather or reduce stream
  when it calls: the engine's own events then decide what the compute stream waits for, so what is exposed is
  what the real overlap rule exposes;
* on the CPU nothing holds anything (a CPU rank runs its collectives one after another): the calls are
  recorded (:attr:`EmulatedCollectives.calls`) and the dry run adds their time to the step.

Numerics are not the job's: no rank's gradients are summed with another's. A reduce-scatter keeps this
rank's rows of its own input (every rank as if it had this rank's gradient), an all-reduce leaves its
tensor as it is; a gather writes this rank's piece into every rank's slot with ``move_bytes`` (the same bytes
written through HBM as a gather writes; always on the CPU, where otherwise the slots would hold whatever
memory held) and leaves the other slots untouched without it. Losses of a dry run are not reported.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

import torch

from ... import Collectives
from .hardware import Cluster
from .step_time import collective_time

__all__ = ["WireCall", "WireModel", "StreamHold", "EmulatedCollectives", "OUTER_AXIS"]

OUTER_AXIS = "dp_outer"  # build_dp_mesh's hybrid axis: replicas ``inner`` ranks apart


@dataclass(frozen=True)
class WireCall:
    """One emulated collective: its kind, mesh axis, ranks on it, the whole payload and its modelled time."""

    kind: str  # all_gather, reduce_scatter, all_reduce, all_reduce_max
    axis: str
    ranks: int
    nbytes: int
    seconds: float


class WireModel:
    """Seconds of one collective over a mesh axis of ``cluster``: the static plan's alpha-beta terms.

    ``replicas`` > 1: the mesh is (``dp_outer``, ``dp_shard``); the outer axis's ranks sit ``gpus / replicas``
    apart (each replica a whole number of nodes, as the planner's candidates are)."""

    def __init__(self, cluster: Cluster, replicas: int = 1):
        if replicas < 1 or cluster.gpus % replicas:
            raise ValueError(f"replicas={replicas} must be a positive divisor of gpus={cluster.gpus}")
        self.cluster = cluster
        self.inner = cluster.gpus // replicas

    def seconds(self, kind: str, axis: str, ranks: int, nbytes: int) -> float:
        ring = "all_reduce" if kind in ("all_reduce", "all_reduce_max") else kind
        bw, latency = self.cluster.link(ranks, stride=self.inner if axis == OUTER_AXIS else 1, kind=ring)
        return collective_time(ring, nbytes, ranks, bw, latency)


class StreamHold:
    """Holds the current CUDA stream for a number of seconds: ``torch.cuda._sleep(cycles)``, a kernel that
    spins on the GPU's clock, its cycles per second measured once (median of three) on ``device``."""

    CYCLES = 20_000_000  # ~10-20 ms at 1-2 GHz: long against the event timer's resolution

    def __init__(self, device: torch.device):
        with torch.cuda.device(device):
            torch.cuda._sleep(self.CYCLES)  # first launch: module load
            rates = []
            for _ in range(3):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                torch.cuda._sleep(self.CYCLES)
                end.record()
                end.synchronize()
                rates.append(self.CYCLES / (start.elapsed_time(end) / 1e3))
        self.cycles_per_s = statistics.median(rates)

    def hold(self, seconds: float) -> None:
        cycles = int(seconds * self.cycles_per_s)
        if cycles > 0:
            torch.cuda._sleep(cycles)


def _replicate(rows: torch.Tensor, piece: torch.Tensor, index: int) -> None:
    """``piece`` into every row of ``rows``; in place (``piece`` is row ``index``) the other rows only, so no
    temporary is made (a dry run's memory is the engine's)."""
    if piece.untyped_storage().data_ptr() != rows.untyped_storage().data_ptr():
        rows.copy_(piece.expand(rows.shape[0], -1))
        return
    rows[:index].copy_(piece.expand(index, -1))
    rows[index + 1:].copy_(piece.expand(rows.shape[0] - index - 1, -1))


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class EmulatedCollectives(Collectives):
    """The engine's collectives with the wire modelled (see the module docstring).

    ``device``: where the job's buffers live (CUDA: each call holds the current stream; CPU: recorded only).
    ``move_bytes``: gathers write this rank's piece into every slot (HBM traffic of the size a gather writes;
    the hold is shortened by that copy's time at ``hbm_bw``). ``calls`` lists every call since the last
    :meth:`clear`."""

    def __init__(self, wire: WireModel, device: torch.device, move_bytes: bool = False):
        self.wire = wire
        self.cuda = device.type == "cuda"
        self.stream_hold = StreamHold(device) if self.cuda else None
        self.move_bytes = move_bytes or not self.cuda
        self.hbm_bw = wire.cluster.gpu.hbm_bw
        self.calls: list[WireCall] = []

    def clear(self) -> None:
        self.calls = []

    def _emulate(self, kind: str, axis, nbytes: int, copied: int = 0) -> None:
        seconds = self.wire.seconds(kind, axis.name, axis.size, nbytes)
        self.calls.append(WireCall(kind, axis.name, axis.size, nbytes, seconds))
        if self.stream_hold is not None:
            self.stream_hold.hold(seconds - 2 * copied / self.hbm_bw)  # a copy reads and writes its bytes

    def gather(self, outs, ins, axis) -> None:
        nbytes = _nbytes(outs)
        if self.move_bytes:
            for out, inp in zip(outs, ins):
                _replicate(out.view(axis.size, -1), inp.reshape(1, -1), axis.index)
        self._emulate("all_gather", axis, nbytes, nbytes if self.move_bytes else 0)

    def reduce_scatter(self, outs, ins, axis) -> None:
        for out, inp in zip(outs, ins):  # this rank's rows of its own input: 1/n of the bytes, always
            out.copy_(inp.reshape(axis.size, -1)[axis.index].view_as(out))
        self._emulate("reduce_scatter", axis, _nbytes(ins))

    def all_reduce(self, t, axes, average=True) -> None:
        for axis in axes:
            self._emulate("all_reduce", axis, _nbytes([t]))

    def all_reduce_max(self, t, axes) -> None:
        for axis in axes:
            self._emulate("all_reduce_max", axis, _nbytes([t]))
