"""Collectives over a group's parameter pieces, one mesh axis at a time, on side streams.

Each transition between placements is a chain of 1-D steps, one per mesh
axis: Shard->Replicate all-gathers every parameter's piece (least significant
axis first), Partial->Shard reduce-scatters them (most significant first),
Partial->Replicate all-reduces a flat buffer. The per-parameter collectives of
one step run as one coalesced NCCL group, which costs no more than one flat
collective and leaves each gathered parameter contiguous. Averages divide by
the axis size (NCCL's ``AVG`` does that inside the collective; gloo sums, then
we divide). A reduce-scatter in a narrow-range dtype (fp16, anything but fp32 and
bf16) divides as FSDP2 does against overflow and underflow: by about the square
root of the axis size before a SUM and by the rest after it, on every backend.

On CUDA the chains run on a gather or a reduce side stream that first waits
for the compute stream; the caller gets an event to make the compute stream
wait on before it reads the result. Tensors the side stream reads are kept
alive by the caller until that wait (no ``record_stream``). On CPU everything
is synchronous over gloo: one call per transition on a packed copy of the
pieces (gloo has no coalesced collectives), no streams.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, ReduceScatterOptions

from .mesh import AxisGroup

__all__ = ["StagingPool", "GraphSafeStagingPool", "StreamSet", "Collectives", "gather_pieces", "reduce_scatter_pieces", "all_reduce_chain",
           "all_reduce_max", "broadcast_from_first_rank", "InFlight", "replicas_reduce_first"]


class StagingPool:
    """Flat temporaries the collectives read, reused instead of allocated per collective.

    NCCL keeps a reference to every tensor of a coalesced collective until its
    watchdog reaps the finished work, so a fresh buffer per collective stays
    allocated well after we drop it (measured at 0.89B on 2 x H200: +1.4 GiB
    peak). Units of one kind (transformer layers) need buffers of the same
    sizes, so a buffer of exactly the size asked for is reused. A size with no
    spare means the step moved on to a unit of another shape (the output head,
    the embedding): the spares of other sizes are let go before the new one is
    allocated, so they never sit beside it (at 8B they were 1.2 GiB of peak).
    A buffer comes back here once the compute stream has waited for the
    collective that read it (``InFlight.wait``), so reusing it is ordered after
    that collective on every stream.
    """

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D buffer of ``numel`` elements (uninitialized)."""
        key = (numel, dtype, device)
        spares = self._free.get(key)
        if spares:
            return spares.pop()
        self._free = {}  # a unit of another shape: the other sizes' spares would only add to the peak
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, buffer: torch.Tensor) -> None:
        self._free.setdefault((buffer.numel(), buffer.dtype, buffer.device), []).append(buffer)

    def clear(self) -> None:
        """Let the buffers go (at the end of a backward: nothing is in flight then)."""
        self._free = {}


class GraphSafeStagingPool(StagingPool):
    """A staging pool for graph-safe mode: every buffer it ever made stays, and each step gets them back in the
    same order, so a step reads and writes the same addresses as the one before (a CUDA graph replays them).

    The spares are a stack per size; ``clear`` (the end of a backward, nothing in flight) restacks every buffer
    in the order it was made. A step's takes and gives come in the same order every step, so the k-th take of a
    step gets the same buffer as in every other step, and a buffer is made only where the first step needed one
    more than it had: no allocation after the first step. The price: every size's buffers are held at once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[tuple, list[torch.Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (numel, dtype, device)
        spares = self._free.get(key)
        if spares:
            return spares.pop()
        buffer = torch.empty(numel, dtype=dtype, device=device)
        self.made.setdefault(key, []).append(buffer)
        return buffer

    def clear(self) -> None:
        self._free = {key: list(reversed(made)) for key, made in self.made.items()}

    def forget(self) -> None:
        """Before a capture: drop every buffer made so far (nothing in flight), so the captured step makes its
        own inside the graph's memory pool, in the order every later step takes them."""
        self.made, self._free = {}, {}

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer made so far (for tests and memory reports)."""
        return [b for made in self.made.values() for b in made]


class StreamSet:
    """The side streams of one sharded model (none on CPU) and its staging buffers.

    ``graph_safe``: the staging buffers are static (``GraphSafeStagingPool``) and the groups keep every buffer
    allocated (``fully_shard(graph_safe=True)``).
    """

    def __init__(self, device: torch.device, graph_safe: bool = False):
        self.cuda = device.type == "cuda"
        self.gather = torch.cuda.Stream(device=device) if self.cuda else None
        self.reduce = torch.cuda.Stream(device=device) if self.cuda else None
        self.graph_safe = graph_safe
        self.pool = GraphSafeStagingPool() if graph_safe else StagingPool()

    def share_side_streams(self, other: "StreamSet") -> None:
        """Run this set's collectives on ``other``'s side streams from now on (torch's ``share_comm_ctx``: one
        pair of streams for several roots, so the caching allocator keeps one set of blocks per stream). The
        units of one device share one set already (``fully_shard._shared_streams``); a graph-safe set is apart,
        and its static staging buffers stay its own. Everything holding this set sees the change."""
        if not isinstance(other, StreamSet):
            raise TypeError(f"share_comm_ctx: a shardwise unit can share streams only with another shardwise "
                            f"model's, not with {type(other).__name__} (torch's FSDP2 modules and shardwise's "
                            "cannot be passed to one share_comm_ctx call)")
        if other.cuda != self.cuda:
            raise ValueError("share_comm_ctx: the modules live on different device types (CUDA and not)")
        self.gather, self.reduce = other.gather, other.reduce

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
    """A finished-on-the-host, maybe-running-on-the-device operation and what it reads.

    ``staged`` buffers go back to ``pool`` once the compute stream has waited for it.
    """

    __slots__ = ("event", "keepalive", "staged", "pool")

    def __init__(
        self,
        event: "torch.cuda.Event | None",
        keepalive: tuple = (),
        staged: tuple = (),
        pool: StagingPool | None = None,
    ):
        self.event = event
        self.keepalive = keepalive
        self.staged = staged
        self.pool = pool

    def wait(self) -> None:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        self.event = None
        self.keepalive = ()
        for buffer in self.staged:
            self.pool.give(buffer)
        self.staged = ()


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # torch 2.13 renamed the single-tensor collectives; 2.11 only has the old names.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=op, group=group)


def _coalesced_call(group, names: tuple[str, str], outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor],
                    options) -> None:
    """One NCCL group launch of per-parameter collectives, by one call into the process group.

    torch's ``_coalescing_manager`` ends in the same call, but first runs each
    collective's Python wrapper to record it: nine wrappers per layer and
    transition cost enough host time to leave the GPU waiting at 0.89B on two
    H200s (docs/performance.md, change 9). The call returns once the current
    stream waits for the group (``asyncOp`` off), as the manager's does.
    """
    method = getattr(group, names[0], None) or getattr(group, names[1])  # torch 2.13 renamed them
    options.asyncOp = False
    work = method(list(outs), list(ins), options)
    if work is not None:
        work.wait()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    return a0 < b1 and b0 < a1


def _packable(ins: Sequence[torch.Tensor]) -> bool:
    """Whether gloo should move these pieces in one call on a packed copy: several, of one dtype."""
    return len(ins) > 1 and len({t.dtype for t in ins}) == 1


def _unpack(rows: torch.Tensor, numels: Sequence[int]) -> tuple[torch.Tensor, ...]:
    """Column blocks of a ``(ranks, sum(numels))`` packed buffer, one per piece."""
    return rows.split(list(numels), dim=1)


def _as_bytes(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """FP8 tensors as their bytes (gloo has no FP8 type; a gather moves bytes either way), others as they are."""
    return [t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t for t in tensors]


def gather_pieces(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], axis: AxisGroup) -> None:
    """All-gather each ``ins[i]`` over ``axis`` into ``outs[i]`` (rank-major), as one coalesced group.

    An input may sit inside its output at this rank's position (in place).
    """
    if not outs:
        return
    outs, ins = _as_bytes(outs), _as_bytes(ins)
    if axis.averages_natively:  # NCCL
        _coalesced_call(axis.group, ("all_gather_single_coalesced", "allgather_into_tensor_coalesced"), outs, ins,
                        AllgatherOptions())
        return
    if not _packable(ins):
        for out, inp in zip(outs, ins):  # gloo: one by one
            if _overlaps(out, inp):
                inp = inp.clone()  # gloo copies shards in place without aliasing checks
            _all_gather(out, inp, axis.group)
        return
    # gloo, several pieces: one call on a packed copy (a gloo call costs far more than the two copies)
    packed = torch.cat([inp.reshape(-1) for inp in ins])
    gathered = packed.new_empty(axis.size * packed.numel())
    _all_gather(gathered, packed, axis.group)
    for out, rows in zip(outs, _unpack(gathered.view(axis.size, -1), [inp.numel() for inp in ins])):
        out.view(axis.size, -1).copy_(rows)


def reduce_scatter_pieces(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], axis: AxisGroup) -> None:
    """Average ``ins[i]`` over ``axis`` and keep this rank's piece in ``outs[i]``, as one coalesced group."""
    if not outs:
        return
    split = _split_divide(ins[0].dtype, axis.size * axis.replicas)
    if split is not None:  # fp16: FSDP2's pre-divide, SUM, post-divide, on every backend
        pre, post = split
        _sum_scatter(outs, torch._foreach_div(list(ins), float(pre)), axis)
        if axis.replicas == 1:  # else after the replicas' SUM (``all_reduce_chain``), as FSDP2's HSDP
            torch._foreach_div_(list(outs), float(post))
        return
    if axis.averages_natively:  # NCCL
        options = ReduceScatterOptions()
        options.reduceOp = dist.ReduceOp.AVG
        _coalesced_call(axis.group, ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"), outs, ins,
                        options)
        return
    _sum_scatter(outs, ins, axis)
    torch._foreach_div_(list(outs), float(axis.size))


def _split_divide(dtype: torch.dtype, n: int) -> tuple[int, float] | None:
    """FSDP2's split of the mean's division by ``n`` for a dtype with overflow risk (not fp32, not bf16):
    ``pre`` doubles from 1 while it divides ``n`` and ``n / pre > pre``; ``n / pre`` after the SUM.
    ``None`` for fp32 and bf16 (one average, bits unchanged) and for ``n == 1``."""
    if dtype in (torch.float32, torch.bfloat16) or n == 1:
        return None
    pre = 1
    while n % pre == 0 and n / pre > pre:
        pre *= 2
    return pre, n / pre


def _sum_scatter(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], axis: AxisGroup) -> None:
    """SUM ``ins[i]`` over ``axis`` and keep this rank's piece in ``outs[i]`` (NCCL: one coalesced group)."""
    if axis.averages_natively:  # NCCL
        options = ReduceScatterOptions()
        options.reduceOp = dist.ReduceOp.SUM
        _coalesced_call(axis.group, ("reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"), outs, ins,
                        options)
    elif not _packable(ins):
        for out, inp in zip(outs, ins):  # gloo: one by one
            _reduce_scatter(out, inp, dist.ReduceOp.SUM, axis.group)
    else:  # gloo, several pieces: one call, rank-major over the packed pieces
        numels = [out.numel() for out in outs]
        packed = ins[0].new_empty(axis.size, sum(numels))
        for rows, inp, n in zip(_unpack(packed, numels), ins, numels):
            rows.copy_(inp.view(axis.size, n))
        mine = packed.new_empty(sum(numels))
        _reduce_scatter(mine, packed.view(-1), dist.ReduceOp.SUM, axis.group)
        for out, piece in zip(outs, mine.split(numels)):
            out.copy_(piece.view_as(out))


def broadcast_from_first_rank(tensor: torch.Tensor, groups: Sequence, device: torch.device) -> None:
    """Give every rank of each group of ``groups`` (in order) the values the group's first rank holds in
    ``tensor``, in place, through ``device`` where ``tensor`` lives elsewhere (a host buffer, a parameter not
    yet moved). A collective over each group of more than one rank; the one broadcast the build's
    ``sync_module_states``, its TP-replicated parameters and ``broadcast_from_first_replica`` share."""
    with torch.no_grad():
        value = tensor.detach().to(device)
        for group in groups:
            if dist.get_world_size(group) > 1:
                dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
        if value.data_ptr() != tensor.data_ptr():
            tensor.copy_(value)


def all_reduce_chain(t: torch.Tensor, axes: Sequence[AxisGroup], average: bool = True) -> None:
    """Average (or sum) ``t`` in place over each of ``axes``. HSDP's replicas after a 16-bit reduce-scatter
    (``mesh.hsdp_division``): one SUM, then the rest of FSDP2's split division over shards and replicas
    (the part before the SUM too where the shard axis has one rank, so no reduce-scatter ran)."""
    split = _hsdp_split(t.dtype, axes) if average else None
    if split is not None:
        pre, post = split
        if axes[0].scattered_over == 1:
            t.div_(pre)
        for axis in axes:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=axis.group)
        t.div_(post)
        return
    for axis in axes:
        native = axis.averages_natively and average
        dist.all_reduce(t, op=dist.ReduceOp.AVG if native else dist.ReduceOp.SUM, group=axis.group)
        if average and not native:
            t.div_(axis.size)


def _hsdp_split(dtype: torch.dtype, axes: Sequence[AxisGroup]) -> tuple[int, float] | None:
    """FSDP2's split of a ``dtype`` mean over HSDP's shards and these replica axes (``mesh.hsdp_division``), or
    ``None`` (fp32, bf16, axes that are not HSDP's replicas)."""
    scattered = {axis.scattered_over for axis in axes}
    if len(scattered) != 1 or 0 in scattered:
        return None
    return _split_divide(dtype, scattered.pop() * math.prod(axis.size for axis in axes))


def replicas_reduce_first(dtype: torch.dtype, axes: Sequence[AxisGroup]) -> bool:
    """Whether HSDP's replicas all-reduce a reduce-scatter's ``dtype`` output before it is accumulated in another
    dtype, as FSDP2 does for a 16-bit split mean (its SUM over replicas, and the division after it, in ``dtype``)."""
    return _hsdp_split(dtype, [axis for axis in axes if axis.size > 1]) is not None


def all_reduce_max(t: torch.Tensor, axes: Sequence[AxisGroup]) -> None:
    """The elementwise maximum of ``t`` over each of ``axes``, in place."""
    for axis in axes:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=axis.group)


_NO_POOL = contextlib.nullcontext()  # reusable: entering it allocates nothing and costs nothing


class Collectives:
    """How a group's buffers move between placements: the three transitions, one mesh axis at a time.

    Groups call only these, so a subclass changes how the bytes travel (a reduction
    in another dtype) without touching the groups (an FP8 gather is ``gather`` of
    uint8 slots after one ``all_reduce_max`` of the amaxes, ``quantized_gather``); pass one to
    ``fully_shard(collectives=...)``. The default is the coalesced per-parameter
    collectives above. ``buffers()`` is where the device buffers these collectives read
    and write come from (``shardwise.engine.nccl_buffers``: a memory pool registered with NCCL).
    """

    def buffers(self) -> contextlib.AbstractContextManager:
        """The context every device buffer of a group is allocated under (weights, gathered weights, gradients,
        staging temporaries, a freed buffer taken back): PyTorch's caching allocator, as it is, by default."""
        return _NO_POOL

    def gather(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], axis: AxisGroup) -> None:
        """All-gather each ``ins[i]`` over ``axis`` into ``outs[i]`` (rank-major)."""
        gather_pieces(outs, ins, axis)

    def reduce_scatter(self, outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor], axis: AxisGroup) -> None:
        """Average each ``ins[i]`` over ``axis``, keeping this rank's piece in ``outs[i]``."""
        reduce_scatter_pieces(outs, ins, axis)

    def all_reduce(self, t: torch.Tensor, axes: Sequence[AxisGroup], average: bool = True) -> None:
        """Average (or sum) ``t`` in place over each of ``axes``."""
        all_reduce_chain(t, axes, average)

    def all_reduce_max(self, t: torch.Tensor, axes: Sequence[AxisGroup]) -> None:
        """The elementwise maximum of ``t`` over each of ``axes``, in place (an FP8 gather's amaxes)."""
        all_reduce_max(t, axes)
