"""Where a parameter's rows live on each rank: torch.chunk, level after level.

A parameter is sharded along dim 0 over an ordered chain of mesh axes (the
axes its optimizer state is sharded over). Level 0 is the whole parameter;
level ``j`` is this rank's piece after splitting level ``j - 1`` with
``torch.chunk`` into ``n_j`` pieces and taking the one at this rank's
coordinate. That is exactly what ``Shard(0)`` on consecutive DTensor mesh
dimensions means, so the pieces are honest DTensor shards.

Collectives need every member of an axis group to send the same number of
elements, so each level's piece lives in a *slot* padded to the level's chunk
size (rows after the real ones are padding). Because ``torch.chunk`` pieces
are full except the last non-empty one, the gathered slots of level ``j``
hold level ``j - 1``'s rows contiguously, followed by padding: a gather lands
each parameter in one piece with no copy-out, and a reduce-scatter reads one.

A group's slots of one level are packed into one flat buffer (``LevelLayout``);
ranks of different axis groups may pack differently sized slots, which is fine
because every collective runs per parameter inside one axis group, whose
members share the parent piece and so the slot sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["RowPiece", "chunk_size", "chunk_range", "nested_chunks", "slot_rows", "LevelLayout", "row_numel"]

# Slot starts are aligned to this many elements (64 bytes in bf16, 128 in fp32).
ALIGN = 32


@dataclass(frozen=True)
class RowPiece:
    """One level of a parameter's sharding as this rank sees it."""

    count: int  # pieces at this level (the axis size)
    index: int  # this rank's piece (its coordinate on the axis)
    chunk: int  # rows per full piece: ceil(parent rows / count)
    start: int  # first row of this rank's piece, in the parameter's rows
    rows: int  # real rows in this rank's piece (0 for empty tail pieces)


def chunk_size(n: int, parts: int) -> int:
    """Rows of a full ``torch.chunk`` piece when ``n`` rows are cut into ``parts``: ``ceil(n / parts)``; the
    pieces after the last full one are short, then empty. The one statement of the row rule."""
    return -(-n // parts)


def chunk_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of ``torch.chunk``'s piece ``index`` of ``n`` rows cut into ``parts``."""
    size = chunk_size(n, parts)
    start = min(index * size, n)
    return start, min(start + size, n)


def nested_chunks(rows: int, axes: Sequence[tuple[int, int]]) -> list[RowPiece]:
    """``torch.chunk`` along dim 0, once per ``(count, index)`` in ``axes`` (outermost first)."""
    pieces, start, length = [], 0, rows
    for count, index in axes:
        if count < 1 or not 0 <= index < count:
            raise ValueError(f"axis of size {count} has no coordinate {index}")
        chunk = chunk_size(length, count)
        first, stop = chunk_range(length, count, index)
        length = stop - first
        start += first
        pieces.append(RowPiece(count, index, chunk, start, length))
    return pieces


def slot_rows(rows: int, pieces: Sequence[RowPiece], level: int) -> int:
    """Rows of a level's slot: room for its piece (as a gather input) and for the
    gathered pieces of the level below (as a gather output)."""
    own = rows if level == 0 else pieces[level - 1].chunk
    if level < len(pieces):
        below = pieces[level]
        own = max(own, below.count * below.chunk)
    return own


def row_numel(shape: torch.Size) -> int:
    if len(shape) == 0:
        raise ValueError("0-dim parameters have no rows to shard")
    return math.prod(shape[1:])


class LevelLayout:
    """Offsets of a group's slots of one level in one flat buffer."""

    def __init__(self, slot_numels: Sequence[int], align: int = ALIGN):
        offsets, cursor = [], 0
        for numel in slot_numels:
            cursor = -(-cursor // align) * align
            offsets.append(cursor)
            cursor += numel
        self.offsets: list[int] = offsets
        self.numels: list[int] = list(slot_numels)
        self.total = cursor

    def gaps(self, used_numels: Sequence[int]) -> list[tuple[int, int]]:
        """Flat ranges outside the first ``used_numels[i]`` elements of every slot."""
        out, ends = [], self.offsets[1:] + [self.total]
        cursor = 0
        for offset, used, end in zip(self.offsets, used_numels, ends):
            if offset > cursor:
                out.append((cursor, offset))
            cursor = offset + used
            if end > cursor:
                out.append((cursor, end))
            cursor = end
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The slots of ``flat`` (1-D views)."""
        return [flat[o : o + n] for o, n in zip(self.offsets, self.numels)]
