"""The row arithmetic of ``shardwise.layout``, single process, against torch.chunk itself."""

from __future__ import annotations

import itertools

import pytest
import torch

from shardwise.layout import LevelLayout, nested_chunks, slot_rows

SIZES = [(1,), (2,), (3,), (4,), (2, 2), (2, 3), (3, 2), (4, 2)]


def _torch_pieces(rows: int, sizes, coords) -> torch.Tensor:
    """The rows a rank at ``coords`` holds when torch.chunk splits dim 0 once per axis."""
    piece = torch.arange(rows)
    for size, index in zip(sizes, coords):
        chunks = torch.chunk(piece, size)
        piece = chunks[index] if index < len(chunks) else piece[:0]
    return piece


@pytest.mark.parametrize("sizes", SIZES)
def test_nested_chunks_are_torch_chunk_level_after_level(sizes):
    for rows in range(0, 13):
        for coords in itertools.product(*(range(s) for s in sizes)):
            pieces = nested_chunks(rows, list(zip(sizes, coords)))
            expected = _torch_pieces(rows, sizes, coords)
            last = pieces[-1]
            assert last.rows == len(expected), (rows, sizes, coords)
            if len(expected):
                assert last.start == expected[0].item(), (rows, sizes, coords)


@pytest.mark.parametrize("sizes", SIZES)
def test_gathered_slots_hold_the_parent_rows_contiguously(sizes):
    """Concatenating every member's padded slot of one level gives the parent's rows first."""
    for rows in range(0, 13):
        for coords in itertools.product(*(range(s) for s in sizes)):
            pieces = nested_chunks(rows, list(zip(sizes, coords)))
            for level in range(1, len(sizes) + 1):
                piece = pieces[level - 1]
                parent_rows = rows if level == 1 else pieces[level - 2].rows
                gathered = []
                for member in range(piece.count):  # the members of this axis group
                    member_coords = list(coords)
                    member_coords[level - 1] = member
                    mine = nested_chunks(rows, list(zip(sizes, member_coords)))[level - 1]
                    assert mine.chunk == piece.chunk  # every member sends the same count
                    gathered += [mine.start + r for r in range(mine.rows)] + [None] * (mine.chunk - mine.rows)
                parent_start = 0 if level == 1 else pieces[level - 2].start
                assert gathered[:parent_rows] == list(range(parent_start, parent_start + parent_rows))
                assert all(r is None for r in gathered[parent_rows:])
                assert slot_rows(rows, pieces, level - 1) >= len(gathered)


def test_level_layout_aligns_slots_and_lists_what_is_padding():
    layout = LevelLayout([5, 40, 0, 7], align=8)
    assert layout.offsets == [0, 8, 48, 48] and layout.total == 55
    flat = torch.arange(layout.total)
    assert [v.numel() for v in layout.views(flat)] == [5, 40, 0, 7]
    assert layout.gaps([3, 40, 0, 7]) == [(3, 8)]
    assert layout.gaps([5, 30, 0, 2]) == [(5, 8), (38, 48), (50, 55)]
