"""Row-aligned flat layout of one parameter group.

A group's parameters are packed into one flat index space. Every parameter
starts at a multiple of its row size (``numel // shape[0]``) and the shard
size is a multiple of the least common multiple of all row sizes, so every
shard boundary falls between two rows of every parameter: each rank's
contiguous shard of the flat buffer holds whole rows only, which makes each
local piece a plain ``(rows, *shape[1:])`` view and a ``Shard(0)`` DTensor.
The tail is padded so the buffer splits into ``shard_count`` equal shards.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Sequence

import torch

__all__ = ["Slot", "FlatLayout"]


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in the flat buffer."""

    shape: torch.Size
    offset: int
    numel: int
    row_numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel

    def rows_in(self, start: int, end: int) -> tuple[int, int]:
        """The rows [first, last) of this parameter that fall in flat range [start, end)."""
        lo = min(max(start, self.offset), self.end)
        hi = max(min(end, self.end), lo)
        return (lo - self.offset) // self.row_numel, (hi - self.offset) // self.row_numel


def _row_numel(shape: torch.Size) -> int:
    if len(shape) == 0:
        raise ValueError("0-dim parameters have no rows to shard")
    return max(1, math.prod(shape[1:]))


class FlatLayout:
    """Offsets of a group's parameters and the size of each of ``shard_count`` shards."""

    def __init__(self, shapes: Sequence[torch.Size], shard_count: int):
        if shard_count < 1:
            raise ValueError(f"shard_count={shard_count} must be >= 1")
        self.shard_count = shard_count
        slots, offset, row_lcm = [], 0, 1
        for shape in shapes:
            shape = torch.Size(shape)
            row = _row_numel(shape)
            offset = -(-offset // row) * row  # start on a row boundary of this parameter
            slots.append(Slot(shape, offset, shape.numel(), row))
            offset += shape.numel()
            if shard_count > 1 and shape.numel() > 0:
                row_lcm = math.lcm(row_lcm, row)
        self.slots: list[Slot] = slots
        self.used = offset
        per_shard = -(-offset // shard_count)
        self.shard_numel = max(row_lcm, -(-per_shard // row_lcm) * row_lcm) if offset else 0
        self.total = self.shard_numel * shard_count
        padding = self.total - self.used
        if padding > 1 << 20 and padding > self.used // 4:
            warnings.warn(
                f"row-aligned layout pads {padding} elements onto {self.used} "
                f"(rows of sizes {sorted({s.row_numel for s in slots})} have lcm {row_lcm}); "
                "shapes with co-prime row sizes in one unit cost memory",
                stacklevel=3,
            )

    def shard_range(self, index: int, count: int) -> tuple[int, int]:
        """Flat range of shard ``index`` when the buffer is split ``count`` ways."""
        if count < 1 or self.shard_count % count:
            raise ValueError(f"count={count} must divide shard_count={self.shard_count}")
        size = self.total // count
        return index * size, (index + 1) * size

    def gaps(self) -> list[tuple[int, int]]:
        """Flat ranges not covered by any parameter (alignment and tail padding)."""
        out, cursor = [], 0
        for slot in self.slots:
            if slot.offset > cursor:
                out.append((cursor, slot.offset))
            cursor = max(cursor, slot.end)
        if self.total > cursor:
            out.append((cursor, self.total))
        return out
