"""A distributed buffer: one sharding level of a group's parameters, as one flat local tensor.

A group's parameters are split level after level (``layout``): level 0 is the
whole parameter, level ``j`` this rank's piece over the ``j``-th sharded axis.
A ``DistributedBuffer`` holds one level of every parameter of a group, one
padded slot per parameter packed into one flat tensor, and moves itself to
other levels:

- ``gather_into`` (and ``start_gather`` on a side stream): all-gather down to a
  lower level, one axis at a time, each parameter landing contiguous in its slot;
- ``reduce_scatter``: average up to a higher level into staged buffers;
- ``all_reduce``: average (or sum) in place over mesh axes;
- ``accumulate``: copy into an ``EMPTY`` buffer, add into one that holds values;
- ``free`` / ``alloc``: drop and take back the storage (the views keep their shapes).

An axis of one rank (one GPU, or a model-parallel layout with no data
parallelism) splits nothing: the levels on either side of it hold the same
rows, so moving across it is a copy, and no collective is issued for it.
Where every axis between two levels has one rank and their slots are the
same size (``Levels.same_layout``: always so on one GPU), the two are one
buffer in all but name: a gather is one copy (or cast) of the flat buffer, a
reduction is the values themselves, and a group lets one buffer serve both.

Every collective goes through the group's ``Collectives``, one call per mesh
axis and transition (one coalesced NCCL group of per-parameter collectives).
The buffers of one group share a ``Levels``: the parameters' rows
(``ShardedParam``), one ``LevelLayout`` per level, the axes between levels
(the plan's optimizer axes, outermost first), the collectives, the streams and
the device. Which buffers a group has, and when they move, is ``param_group``'s part.
"""

from __future__ import annotations

import enum
from typing import Callable, Sequence

import torch
from torch.distributed.tensor import DTensor

from .collectives import Collectives, InFlight, StreamSet, broadcast_from_first_rank
from .layout import LevelLayout
from .sharded_param import ShardedParam

__all__ = ["BufferState", "Levels", "DistributedBuffer"]


class BufferState(enum.Enum):
    """What a buffer's storage holds."""

    FREED = "freed"  # no storage (the unsharded level at rest); the views keep their shapes
    EMPTY = "empty"  # storage whose values mean nothing: the next write overwrites (``accumulate`` copies)
    HOLDS = "holds"  # values: ``accumulate`` adds to them
    OUTDATED = "outdated"  # values a newer source replaces before anything reads them (``copy_from``)


class Levels:
    """What the buffers of one group share: its parameters' levels and how to move between them."""

    def __init__(
        self,
        params: Sequence[ShardedParam],
        axes: Sequence,
        collectives: Collectives,
        streams: StreamSet,
        device: torch.device,
    ):
        self.params = list(params)
        self.axes = list(axes)  # axes[j - 1] splits level j - 1 into level j (the plan's optimizer axes)
        self.collectives = collectives
        self.streams = streams
        self.device = device
        self.layouts = [
            LevelLayout([p.slot_numel(level) for p in self.params]) for level in range(len(self.axes) + 1)
        ]
        self._gaps: dict[int, list[tuple[int, int]]] = {}
        self._same_layout: dict[tuple[int, int], bool] = {}
        # Parameters sharded along a dim > 0 (``ShardedParam.blocked``): a transition over an axis of more than
        # one rank moves them through a temporary of W blocks (``unblock`` after a gather, ``block`` before a
        # reduce-scatter); per level, those parameters and the temporary's layout.
        self._blocked: dict[int, tuple[list[int], LevelLayout]] = {}
        for level, axis in enumerate(self.axes, start=1):
            blocked = [i for i, p in enumerate(self.params) if p.blocked and p.piece_numel(level)]
            if blocked and axis.size > 1:
                self._blocked[level] = (blocked, LevelLayout([self.params[i].gathered_numel(level) for i in blocked]))
        # Matrices whole on one owner rank (``owner_layout``): they travel packed, each rank's owned matrices one
        # after the other in a region of the largest region's size, as one more piece of the collective.
        self.owned = [i for i, p in enumerate(self.params) if p.owner is not None]
        self.owned_region, self.owned_offsets = _owner_regions([self.params[i] for i in self.owned])

    def same_layout(self, a: int, b: int) -> bool:
        """Whether levels ``a`` and ``b`` (either order) are one buffer in all but name: every axis between
        them has one rank (the same rows) and their slots have the same sizes (the same offsets). A slot can
        still differ where a one-rank axis meets a larger one (padding for the other axis's pieces)."""
        lo, hi = min(a, b), max(a, b)
        same = self._same_layout.get((lo, hi))
        if same is None:
            same = self._same_layout[(lo, hi)] = (all(self.axes[j].size == 1 for j in range(lo, hi))
                                                  and self.layouts[lo].numels == self.layouts[hi].numels)
        return same

    def gaps(self, level: int) -> list[tuple[int, int]]:
        """Flat ranges of a level's buffer outside every parameter's real rows."""
        gaps = self._gaps.get(level)
        if gaps is None:
            used = [p.real_rows(level)[1] * p.row_numel for p in self.params]
            gaps = self._gaps[level] = self.layouts[level].gaps(used)
        return gaps

    def paired(self, level: int, parents: list[torch.Tensor], pieces: list[torch.Tensor]) -> tuple[list, list]:
        """For a collective between ``level - 1`` and ``level``: each parameter's gathered region of its
        parent slot and its piece (parameters with no rows at this level take no part)."""
        gathered, own = [], []
        for p, parent, piece in zip(self.params, parents, pieces):
            if p.owner is None and p.piece_numel(level):
                gathered.append(parent[: p.gathered_numel(level)])
                own.append(piece[: p.piece_numel(level)])
        return gathered, own

    def blocked(self, level: int) -> list[int]:
        """The parameters whose transition between ``level - 1`` and ``level`` goes through blocks."""
        return self._blocked[level][0] if level in self._blocked else []

    def blocks_total(self, level: int) -> int:
        return self._blocked[level][1].total

    def with_blocks(self, level: int, views: list[torch.Tensor], temp: torch.Tensor) -> list[torch.Tensor]:
        """``views`` (slots of ``level - 1``) with each blocked parameter's replaced by its place in ``temp``."""
        blocked, layout = self._blocked[level]
        views = list(views)
        for i, view in zip(blocked, layout.views(temp)):
            views[i] = view
        return views

    def owned_gather(self, level: int, pieces: list[torch.Tensor], temps: list) -> tuple | None:
        """For a gather from ``level``: (the gathered regions, this rank's region holding its owned matrices),
        temporaries appended to ``temps``; ``None`` without owned matrices."""
        if not self.owned:
            return None
        axis, region, dtype = self.axes[level - 1], self.owned_region, pieces[0].dtype
        new = self.take if self.streams.graph_safe else self.new
        mine, gathered = new(region, dtype), new(axis.size * region, dtype)
        temps += [mine, gathered]
        outs, ins = [], []
        for i, offset in zip(self.owned, self.owned_offsets):
            p = self.params[i]
            if p.mine:
                start = offset - axis.index * region
                outs.append(mine[start : start + p.numel_whole])
                ins.append(pieces[i][: p.numel_whole])
        _copy(outs, ins)
        return gathered, mine

    def owned_unpack_gather(self, gathered: torch.Tensor, parents: list[torch.Tensor]) -> None:
        """Each owned matrix from its owner's region of ``gathered`` into its slot of the level below."""
        _copy([parents[i][: self.params[i].numel_whole] for i in self.owned],
              [gathered[o : o + self.params[i].numel_whole] for i, o in zip(self.owned, self.owned_offsets)])

    def owned_reduce(self, level: int, parents: list[torch.Tensor], staged: list) -> tuple | None:
        """For a reduce-scatter to ``level``: (every owned matrix in its owner's region, this rank's region
        to receive), staged in ``staged``; ``None`` without owned matrices. Padding is zero."""
        if not self.owned:
            return None
        axis, region, dtype = self.axes[level - 1], self.owned_region, parents[0].dtype
        packed, mine = self.take(axis.size * region, dtype), self.take(region, dtype)
        staged += [packed, mine]
        packed, mine = packed[: axis.size * region], mine[:region]
        if sum(self.params[i].numel_whole for i in self.owned) < packed.numel():
            packed.zero_()
        _copy([packed[o : o + self.params[i].numel_whole] for i, o in zip(self.owned, self.owned_offsets)],
              [parents[i][: self.params[i].numel_whole] for i in self.owned])
        return packed, mine

    def owned_unpack_reduce(self, level: int, mine: torch.Tensor, pieces: list[torch.Tensor]) -> None:
        """This rank's owned matrices from its reduced region into their slots of ``level``."""
        axis, region = self.axes[level - 1], self.owned_region
        outs, ins = [], []
        for i, offset in zip(self.owned, self.owned_offsets):
            p = self.params[i]
            if p.mine:
                start = offset - axis.index * region
                outs.append(pieces[i][: p.numel_whole])
                ins.append(mine[start : start + p.numel_whole])
        _copy(outs, ins)

    # ------------------------------------------------------------- new buffers
    def empty(self, level: int, dtype: torch.dtype) -> "DistributedBuffer":
        """A buffer of ``level`` on the device, uninitialized (``EMPTY``)."""
        return DistributedBuffer(self, level, self.new(self.layouts[level].total, dtype), BufferState.EMPTY)

    def zeros(self, level: int, dtype: torch.dtype) -> "DistributedBuffer":
        return DistributedBuffer(self, level, self.new(self.layouts[level].total, dtype).zero_())

    def new(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat device tensor (uninitialized) from where the collectives want their buffers
        (``Collectives.buffers``): every device allocation of a group's buffers goes through here,
        ``take`` or ``DistributedBuffer.alloc``."""
        with self.collectives.buffers():
            return torch.empty(numel, dtype=dtype, device=self.device)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A staging-pool temporary of ``numel`` elements (allocated as :meth:`new` where the pool has no spare)."""
        with self.collectives.buffers():
            return self.streams.pool.take(numel, dtype, self.device)

    def staged(self, level: int, dtype: torch.dtype, staged: list) -> "DistributedBuffer":
        """A buffer of ``level`` on a staging-pool temporary (appended to ``staged``: it goes back to the
        pool once the compute stream has waited for what reads it)."""
        total = self.layouts[level].total
        buffer = self.take(total, dtype)
        staged.append(buffer)
        return DistributedBuffer(self, level, buffer[:total], BufferState.EMPTY)


def _owner_regions(owned: Sequence[ShardedParam]) -> tuple[int, list[int]]:
    """The size of one rank's region (its owned matrices one after the other, the largest region's size) and
    each owned matrix's offset in the rank-major buffer of every region."""
    used: dict[int, int] = {}
    within = []
    for p in owned:
        within.append(used.get(p.owner, 0))
        used[p.owner] = within[-1] + p.numel_whole
    region = max(used.values(), default=0)
    return region, [p.owner * region + w for p, w in zip(owned, within)]


def _copy(outs: Sequence[torch.Tensor], ins: Sequence[torch.Tensor]) -> None:
    """``outs[i] = ins[i]`` in one kernel, skipping pairs that are the same memory."""
    pairs = [(o, i) for o, i in zip(outs, ins) if o.data_ptr() != i.data_ptr()]
    if pairs:
        torch._foreach_copy_([o for o, _ in pairs], [i for _, i in pairs])


def _move(collective: Callable, outs: list[torch.Tensor], ins: list[torch.Tensor], axis) -> None:
    """One transition's per-parameter collective over ``axis``; over an axis of one rank, where each
    output is its input, a copy."""
    if axis.size > 1:
        collective(outs, ins, axis)
    else:
        _copy(outs, ins)


class DistributedBuffer:
    """One level of every parameter of a group: a flat local tensor of padded slots.

    ``flat`` is ``None`` for a level that lives inside the gathered slots of the
    level above it (``own_pieces``: fp32 main weights that are this rank's
    pieces of the model shard); such a buffer has slots but no storage of its own.
    """

    __slots__ = ("levels", "level", "flat", "state", "_views")

    def __init__(
        self,
        levels: Levels,
        level: int,
        flat: torch.Tensor | None,
        state: BufferState = BufferState.HOLDS,
        views: list[torch.Tensor] | None = None,
    ):
        self.levels = levels
        self.level = level
        self.flat = flat
        self.state = state
        self._views = views

    def own_pieces(self) -> "DistributedBuffer":
        """The next level, in place: this rank's pieces inside this buffer's slots."""
        level = self.level + 1
        views = [p.own_piece(v, level) for p, v in zip(self.levels.params, self.views())]
        return DistributedBuffer(self.levels, level, None, views=views)

    # ------------------------------------------------------------------ slots
    @property
    def layout(self) -> LevelLayout:
        return self.levels.layouts[self.level]

    def views(self) -> list[torch.Tensor]:
        """Every parameter's slot (1-D views of ``flat``, padding included)."""
        if self._views is None:
            self._views = self.layout.views(self.flat)
        return self._views

    def local(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s real rows at this level, shaped like the parameter (``ShardedParam.local``)."""
        return self.levels.params[i].local(self.views()[i], self.level)

    def locals(self) -> list[torch.Tensor]:
        return [p.local(v, self.level) for p, v in zip(self.levels.params, self.views())]

    def dtensors(self) -> list[DTensor]:
        """Every parameter's rows as a DTensor of the global parameter (optimizer level only)."""
        return [p.dtensor(p.local(v, self.level)) for p, v in zip(self.levels.params, self.views())]

    # ------------------------------------------------------------------ values
    def fill(self, fulls: Sequence[torch.Tensor]) -> None:
        """This rank's rows of each parameter's full (model-parallel-local) value; no communication."""
        for p, view, full in zip(self.levels.params, self.views(), fulls):
            p.local(view, self.level).copy_(p.shard_of(full, self.level))
        self.state = BufferState.HOLDS

    def load(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Copy each parameter's rows (zeros where ``None``) into its slot and zero the padding:
        one kernel for the copies."""
        targets, sources = [], []
        for local, t in zip(self.locals(), tensors):
            if t is None:
                local.zero_()
            else:
                targets.append(local)
                sources.append(t)
        flat = self.flat
        for start, end in self.levels.gaps(self.level):
            flat[start:end].zero_()
        if sources:
            torch._foreach_copy_(targets, sources)
        self.state = BufferState.HOLDS

    def accumulate(self, other: "DistributedBuffer") -> None:
        """Add ``other`` (same level and size) into this buffer; an ``EMPTY`` one is overwritten instead."""
        if self.state is BufferState.EMPTY:
            self.flat.copy_(other.flat)
            self.state = BufferState.HOLDS
        else:
            self.flat.add_(other.flat)

    def copy_from(self, other: "DistributedBuffer", non_blocking: bool = False) -> None:
        self.flat.copy_(other.flat, non_blocking=non_blocking)
        self.state = BufferState.HOLDS

    def copy_to(self, flat: torch.Tensor) -> "DistributedBuffer":
        """This buffer's values copied (``non_blocking``) into ``flat`` (another device), as a buffer."""
        flat.copy_(self.flat, non_blocking=True)
        return DistributedBuffer(self.levels, self.level, flat)

    def to(self, device: torch.device, dtype: torch.dtype, non_blocking: bool = False) -> "DistributedBuffer":
        """This buffer on ``device`` in ``dtype`` (itself when it already is)."""
        flat = self.flat.to(device, dtype, non_blocking=non_blocking)
        return self if flat is self.flat else DistributedBuffer(self.levels, self.level, flat)

    def cast(self, dtype: torch.dtype, staged: list) -> "DistributedBuffer":
        """This buffer cast into a staging-pool temporary (appended to ``staged``)."""
        numel = self.flat.numel()
        buffer = self.levels.take(numel, dtype)
        staged.append(buffer)
        source = buffer[:numel]
        source.copy_(self.flat)
        return DistributedBuffer(self.levels, self.level, source)

    # ----------------------------------------------------------------- storage
    def free(self) -> None:
        """Release the storage; the views (and parameters viewing them) keep their shapes."""
        self.flat.untyped_storage().resize_(0)
        self.state = BufferState.FREED

    def alloc(self) -> None:
        """Take the storage back (uninitialized) after ``free``."""
        flat = self.flat
        with self.levels.collectives.buffers():
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
        self.state = BufferState.EMPTY

    def storage_bytes(self) -> int:
        return self.flat.untyped_storage().nbytes()

    # ------------------------------------------------------------- transitions
    def gather_into(self, target: "DistributedBuffer") -> list[torch.Tensor]:
        """All-gather every parameter's pieces from this level down into ``target``'s slots, one
        collective per axis on the current stream.

        Returns the temporaries of the levels in between, which the stream still reads (in graph-safe mode
        staging-pool buffers, for the caller to give back once the stream that reads them is waited on).
        """
        levels, bottom = self.levels, target.level
        if levels.same_layout(bottom, self.level):  # one buffer in all but name: a copy (a cast), or nothing
            if self.flat is not None:
                target.flat.copy_(self.flat)
            else:  # pieces inside another buffer's slots: nothing to move when that buffer is the target
                _copy(target.views(), self.views())
            target.state = BufferState.HOLDS
            return []
        views, temps = self.views(), []
        for level in range(self.level, bottom, -1):
            if level - 1 == bottom:
                out_views = target.views()
            else:
                total, dtype = levels.layouts[level - 1].total, views[0].dtype
                if levels.streams.graph_safe:  # static addresses: the pool's (given back with the flight)
                    temp = levels.take(total, dtype)
                else:
                    temp = levels.new(total, dtype)
                temps.append(temp)
                out_views = levels.layouts[level - 1].views(temp)
            blocked = levels.blocked(level)
            if blocked:  # Shard(d > 0): gathered as blocks into a temporary, then FSDP2's copy-out
                dtype = views[0].dtype
                temp = levels.take(levels.blocks_total(level), dtype) if levels.streams.graph_safe else \
                    levels.new(levels.blocks_total(level), dtype)
                temps.append(temp)
                gathered = levels.with_blocks(level, out_views, temp)
            else:
                gathered = out_views
            outs, ins = levels.paired(level, gathered, views)
            owned = levels.owned_gather(level, views, temps)
            if owned:
                outs, ins = outs + [owned[0]], ins + [owned[1]]
            _move(levels.collectives.gather, outs, ins, levels.axes[level - 1])
            if owned:
                levels.owned_unpack_gather(owned[0], out_views)
            for i in blocked:
                levels.params[i].unblock(gathered[i], out_views[i], level)
            views = out_views
        target.state = BufferState.HOLDS
        return temps

    def start_gather(self, source: "DistributedBuffer | Callable[[list], DistributedBuffer]") -> InFlight:
        """Take this buffer's storage back, then all-gather ``source`` into it on the gather stream.

        ``source`` may be a function of the staged list that makes the buffer to
        gather on the gather stream, right before the gather (a cast, an upload).
        On CUDA this returns at once: the compute stream waits on the result's
        event before it reads this buffer; the flight keeps the temporaries alive
        until then and gives the staged buffers back to the pool.
        """
        if self.state is BufferState.FREED:  # graph-safe mode never frees it: the same storage every step
            self.alloc()  # on the compute stream, like every other allocation of the buffer
        streams = self.levels.streams
        staged: list = []
        with streams.on(streams.gather), torch.autograd._unsafe_preserve_version_counter(self.flat):
            if callable(source):
                source = source(staged)
            temps = source.gather_into(self)
        if streams.graph_safe:  # the temporaries are the pool's: back once the compute stream has waited
            staged, temps = staged + temps, []
        return InFlight(streams.record(streams.gather), keepalive=tuple(temps), staged=tuple(staged), pool=streams.pool)

    def reduce_scatter(self, top: int, staged: list, into: "DistributedBuffer | None" = None) -> "DistributedBuffer":
        """Average this level's values up to level ``top`` over the axes in between, into staging-pool
        temporaries (appended to ``staged``); itself when it is already at ``top`` (or one buffer with it in
        all but name, ``Levels.same_layout``).

        ``into`` (an ``EMPTY`` buffer of level ``top`` and this dtype) takes the
        last level's result directly, instead of a temporary that would only be
        copied into it (returned, now ``HOLDS``).

        Slot rows past a piece's real rows hold whatever the padding summed to;
        nothing reads them.
        """
        levels = self.levels
        if into is not None and not (top > self.level and into.takes(top, self.flat.dtype)):
            raise ValueError(f"reduce_scatter into a {into.state.name} level-{into.level} {into.flat.dtype} buffer; "
                             f"it takes only an EMPTY level-{top} {self.flat.dtype} one above level {self.level}")
        if levels.same_layout(self.level, top):  # one buffer in all but name: the average is the values
            if into is None:
                return self  # (the same rows and layout as level ``top``)
            into.flat.copy_(self.flat)
            into.state = BufferState.HOLDS
            return into
        flat, views = self.flat, self.views()
        for level in range(self.level + 1, top + 1):
            blocked = levels.blocked(level)
            if blocked:  # Shard(d > 0): FSDP2's copy-in, the parent pieces as blocks in a temporary
                temp = levels.take(levels.blocks_total(level), flat.dtype)
                staged.append(temp)
                parents, views = views, levels.with_blocks(level, views, temp)
                for i in blocked:
                    levels.params[i].block(parents[i], views[i], level)
            if level == top and into is not None:
                out, out_views = into.flat, into.views()
            else:
                total = levels.layouts[level].total
                buffer = levels.take(total, flat.dtype)
                staged.append(buffer)
                out = buffer[:total]
                out_views = levels.layouts[level].views(out)
            ins, outs = levels.paired(level, views, out_views)
            owned = levels.owned_reduce(level, views, staged)
            if owned:
                ins, outs = ins + [owned[0]], outs + [owned[1]]
            _move(levels.collectives.reduce_scatter, outs, ins, levels.axes[level - 1])
            if owned:
                levels.owned_unpack_reduce(level, owned[1], out_views)
            flat, views = out, out_views
        if into is not None:
            into.state = BufferState.HOLDS
            return into
        if flat is self.flat:
            return self
        return DistributedBuffer(levels, top, flat, views=views)

    def takes(self, level: int, dtype: torch.dtype) -> bool:
        """Whether a result of ``level`` and ``dtype`` may be written straight into this buffer (it is ``EMPTY``,
        of that dtype, and of that level or one buffer with it in all but name): no temporary and no copy."""
        same = self.levels.same_layout(level, self.level)
        return self.state is BufferState.EMPTY and same and self.flat.dtype == dtype

    def all_reduce(self, axes: Sequence, average: bool = True) -> None:
        """Average (or sum) the whole buffer in place over each of ``axes`` (those of one rank change nothing)."""
        axes = [axis for axis in axes if axis.size > 1]
        if axes:
            self.levels.collectives.all_reduce(self.flat, axes, average=average)

    def broadcast(self, axis) -> None:
        """Give every rank of ``axis`` the values of the axis's first rank (from the host through the device
        when the buffer lives on the host)."""
        if self.flat.numel():
            broadcast_from_first_rank(self.flat, [axis.group], self.levels.device)
