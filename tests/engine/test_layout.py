"""The row arithmetic of ``shardwise.engine.layout``, single process, against torch.chunk itself."""

from __future__ import annotations

import itertools

import pytest
import torch

from shardwise.engine.layout import ALIGN, LevelLayout, nested_chunks, row_numel, slot_rows

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


# Worlds beyond SIZES: one axis up to 16, uneven pairs, three levels; many row counts each.
WORLDS = [(5,), (7,), (8,), (16,), (3, 5), (5, 3), (4, 4), (2, 2, 2), (2, 3, 4), (3, 1, 2), (1, 1)]
ROWS = list(range(0, 40)) + [63, 64, 65, 100, 127, 1000]


def _coords(sizes):
    return list(itertools.product(*(range(s) for s in sizes)))


@pytest.mark.parametrize("sizes", WORLDS, ids=lambda s: "x".join(map(str, s)))
def test_every_level_is_torch_chunk_over_many_worlds(sizes):
    """Every level's piece (not only the last) is torch.chunk's, and the last pieces of all
    ranks, in rank order (outer axes most significant), are the parameter's rows once each."""
    for rows in ROWS:
        covered = []
        for coords in _coords(sizes):
            pieces = nested_chunks(rows, list(zip(sizes, coords)))
            assert len(pieces) == len(sizes)
            parent_rows = rows
            for level, piece in enumerate(pieces):
                expected = _torch_pieces(rows, sizes[: level + 1], coords[: level + 1])
                got = list(range(piece.start, piece.start + piece.rows))
                assert got == expected.tolist(), (rows, sizes, coords, level)
                assert (piece.count, piece.index) == (sizes[level], coords[level])
                assert piece.chunk == -(-parent_rows // piece.count)  # torch.chunk's chunk size
                assert 0 <= piece.rows <= piece.chunk
                parent_rows = piece.rows
            covered += got
        assert covered == list(range(rows)), (rows, sizes)


@pytest.mark.parametrize("sizes", WORLDS, ids=lambda s: "x".join(map(str, s)))
def test_slot_rows_fit_the_piece_and_the_gathered_level_below(sizes):
    for rows in ROWS:
        for coords in _coords(sizes):
            pieces = nested_chunks(rows, list(zip(sizes, coords)))
            assert slot_rows(rows, pieces, 0) == max(rows, sizes[0] * pieces[0].chunk)
            for level in range(1, len(sizes) + 1):
                slot = slot_rows(rows, pieces, level)
                own = pieces[level - 1].chunk  # as a gather input: one full chunk
                below = sizes[level] * pieces[level].chunk if level < len(sizes) else 0
                assert slot == max(own, below)
                assert slot >= pieces[level - 1].rows


@pytest.mark.parametrize("axes", [[(0, 0)], [(2, 2)], [(2, -1)], [(2, 0), (3, 3)]])
def test_nested_chunks_rejects_coordinates_off_the_axis(axes):
    with pytest.raises(ValueError, match="no coordinate"):
        nested_chunks(10, axes)


def test_row_numel():
    assert row_numel(torch.Size([7])) == 1
    assert row_numel(torch.Size([7, 3, 5])) == 15
    assert row_numel(torch.Size([0, 4])) == 4
    with pytest.raises(ValueError, match="0-dim"):
        row_numel(torch.Size([]))


@pytest.mark.parametrize("seed", range(20))
def test_level_layout_slots_are_aligned_disjoint_views_and_gaps_are_the_rest(seed):
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 9, (), generator=gen))
    numels = torch.randint(0, 3 * ALIGN, (n,), generator=gen).tolist()
    used = [int(torch.randint(0, k + 1, (), generator=gen)) for k in numels]
    layout = LevelLayout(numels)
    assert all(o % ALIGN == 0 for o in layout.offsets)
    ends = [o + k for o, k in zip(layout.offsets, numels)]
    assert all(end <= nxt for end, nxt in zip(ends, layout.offsets[1:]))  # disjoint, in order
    assert all(nxt - end < ALIGN for end, nxt in zip(ends, layout.offsets[1:]))  # no more padding than alignment
    assert layout.total == (ends[-1] if numels else 0)
    flat = torch.zeros(layout.total)
    views = layout.views(flat)
    for i, v in enumerate(views):
        assert v.numel() == numels[i] and (v.numel() == 0 or v.data_ptr() == flat[layout.offsets[i]:].data_ptr())
        v[: used[i]] = 1  # writes through to flat
    gaps = layout.gaps(used)
    assert all(a < b for a, b in gaps) and all(b1 <= a2 for (_, b1), (a2, _) in zip(gaps, gaps[1:]))
    in_gaps = torch.zeros(layout.total, dtype=torch.bool)
    for a, b in gaps:
        in_gaps[a:b] = True
    assert torch.equal(in_gaps, flat == 0)  # the gaps are exactly what no slot uses
