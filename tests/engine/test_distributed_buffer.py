"""``shardwise.engine.distributed_buffer``: one sharding level of a group's parameters as one flat buffer, and its transitions.

Single process. Two settings:

- a simulated 2 x 3 mesh (no process group): ``ShardingPlan`` reads only names,
  sizes, coordinates and groups of its mesh, so a fake mesh gives this rank
  the coordinates (1, 2), and an injected ``Collectives`` plays the other
  ranks: a gather checks the piece this rank sends and writes what the whole
  axis would (the parent rows, from the full tensors), a reduce-scatter and an
  all-reduce see every rank send the same values. The offsets, the per-axis
  order and the one-call-per-axis unit of work are checked against
  ``ShardedParam``;
- a real 1-process gloo group with a (1, 1) mesh and the default collectives,
  for the buffers and a ``ParamGroup`` made of them.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import shardwise
from shardwise.engine.collectives import StreamSet
from shardwise.engine.distributed_buffer import BufferState, DistributedBuffer, Levels
from shardwise.engine.param_group import GradState, ModuleParams, ParamGroup, RefreshState, WeightState
from shardwise.engine.mesh import ShardingPlan
from shardwise.engine.sharded_param import ParamRef, ShardedParam
from shardwise.engine.placements import AxisPlacements
from tests.helpers.fake_mesh import FakeMesh

CPU = torch.device("cpu")
S = Shard(0)
ZERO3 = AxisPlacements(S, S, S)
SHAPES = [(7, 15), (1, 4), (10,), (9, 3), (2, 5)]  # uneven rows, fewer rows than ranks, 1-D


def _fulls(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


# ------------------------------------------------------------ simulated 2 x 3 mesh
class AxisOracle(shardwise.Collectives):
    """The other ranks of each axis, played from the full tensors; every call recorded."""

    def __init__(self, params: list[ShardedParam], fulls: list[torch.Tensor], axes):
        self.params, self.fulls, self.axes = params, fulls, list(axes)
        self.calls: list[tuple] = []

    def _level(self, axis) -> int:
        return [a.name for a in self.axes].index(axis.name) + 1

    def _taking_part(self, level: int):
        return [(p, f) for p, f in zip(self.params, self.fulls) if p.piece_numel(level)]

    def gather(self, outs, ins, axis):
        level = self._level(axis)
        self.calls.append(("gather", axis.name, len(outs)))
        parts = self._taking_part(level)
        assert len(parts) == len(outs) == len(ins)
        for (p, full), out, inp in zip(parts, outs, ins):
            assert inp.numel() == p.piece_numel(level) and out.numel() == p.gathered_numel(level)
            first, rows = p.real_rows(level)
            sent = inp[: rows * p.row_numel]
            mine = full[first : first + rows].reshape(-1).to(sent.dtype)
            assert torch.equal(sent, mine), "a rank sent rows that are not its piece"
            parent_first, parent_rows = p.real_rows(level - 1)
            whole = full[parent_first : parent_first + parent_rows].reshape(-1).to(out.dtype)
            out[whole.numel() :].fill_(-7.0)  # the axis's padding rows: nothing may read them
            out[: whole.numel()].copy_(whole)

    def reduce_scatter(self, outs, ins, axis):
        level = self._level(axis)
        self.calls.append(("reduce_scatter", axis.name, len(outs)))
        parts = self._taking_part(level)
        assert len(parts) == len(outs) == len(ins)
        for (p, _), out, inp in zip(parts, outs, ins):
            assert inp.numel() == p.gathered_numel(level) and out.numel() == p.piece_numel(level)
            out.copy_(p.own_piece(inp, level))  # every rank sent the same: the average is the input

    def all_reduce(self, t, axes, average=True):
        self.calls.append(("all_reduce", tuple(a.name for a in axes), average, t.data_ptr(), t.numel()))
        if not average:
            t.mul_(math.prod(a.size for a in axes))


@pytest.fixture
def sim(monkeypatch):
    """Levels of five parameters on rank (outer 1, inner 2) of a simulated 2 x 3 ZeRO-3 mesh."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    plan = ShardingPlan(FakeMesh({"dp_outer": 2, "dp_shard": 3}, {"dp_outer": 1, "dp_shard": 2}),
                        {"dp_outer": ZERO3, "dp_shard": ZERO3})
    fulls = _fulls()
    params = [ShardedParam(ParamRef(f"p{i}", nn.Parameter(f.clone()), []), plan) for i, f in enumerate(fulls)]
    oracle = AxisOracle(params, fulls, plan.opt_axes)
    levels = Levels(params, plan.opt_axes, oracle, StreamSet(CPU), CPU)
    return levels, fulls, oracle


def _filled(levels: Levels, level: int, fulls, dtype=torch.float32) -> DistributedBuffer:
    buf = levels.zeros(level, dtype)
    buf.fill([f.to(dtype) for f in fulls])
    return buf


def test_slots_and_local_slices_are_the_sharded_params_rows(sim):
    levels, fulls, _ = sim
    assert [a.name for a in levels.axes] == ["dp_outer", "dp_shard"]
    for level in range(3):
        buf = _filled(levels, level, fulls)
        assert buf.flat.numel() == levels.layouts[level].total and buf.state is BufferState.HOLDS
        storage = buf.flat.untyped_storage().data_ptr()
        for i, (p, full) in enumerate(zip(levels.params, fulls)):
            slot, local = buf.views()[i], buf.local(i)
            assert slot.untyped_storage().data_ptr() == storage
            assert slot.storage_offset() == local.storage_offset() == levels.layouts[level].offsets[i]
            assert slot.numel() == p.slot_numel(level)
            expected = p.shard_of(full, level)
            assert local.shape == expected.shape and torch.equal(local, expected)
            assert p.local(slot, level).storage_offset() == local.storage_offset()
        assert all(torch.equal(a, b) for a, b in zip(buf.locals(), [buf.local(i) for i in range(len(fulls))]))
        # everything outside the real rows is untouched padding
        mask = torch.ones_like(buf.flat, dtype=torch.bool)
        for start, end in levels.gaps(level):
            mask[start:end] = False
        assert sum(end - start for start, end in levels.gaps(level)) + sum(
            f.numel() for f in buf.locals()) == buf.flat.numel()
        assert torch.count_nonzero(buf.flat[~mask]) == 0
    # rank (1, 2): the 1-row parameter has no rows at level 1, the 7-row one 1 of 4 at level 1
    top = _filled(levels, 2, fulls)
    assert top.local(1).shape == (0, 4) and top.local(0).shape == (1, 15)
    assert torch.equal(top.local(0), fulls[0][6:7])  # rows 4..6 on outer rank 1, then its third chunk


def test_gather_down_two_levels_lands_every_parameter_whole_one_call_per_axis(sim):
    levels, fulls, oracle = sim
    top = _filled(levels, 2, fulls)
    full = levels.empty(0, torch.float32)
    full.flat.fill_(float("nan"))
    temps = top.gather_into(full)
    assert [f"{c[0]}:{c[1]}" for c in oracle.calls] == ["gather:dp_shard", "gather:dp_outer"]  # innermost first
    taking_part = [sum(1 for p in levels.params if p.piece_numel(level)) for level in (2, 1)]
    assert [c[2] for c in oracle.calls] == taking_part
    assert len(temps) == 1 and temps[0].numel() == levels.layouts[1].total  # the level in between
    assert full.state is BufferState.HOLDS
    for i, f in enumerate(fulls):
        assert torch.equal(full.local(i), f)


def test_gather_in_place_from_own_pieces(sim):
    levels, fulls, oracle = sim
    model = _filled(levels, 1, fulls)
    pieces = model.own_pieces()
    assert pieces.level == 2 and pieces.flat is None
    for i, p in enumerate(levels.params):
        assert torch.equal(pieces.local(i), p.shard_of(fulls[i], 2))
        parent, piece = model.views()[i], pieces.views()[i]
        assert piece.untyped_storage().data_ptr() == model.flat.untyped_storage().data_ptr()
        assert parent.storage_offset() <= piece.storage_offset() <= parent.storage_offset() + parent.numel() - piece.numel()
    model.flat.zero_()
    for i, p in enumerate(levels.params):  # only this rank's pieces hold values before the gather
        pieces.local(i).copy_(p.shard_of(fulls[i], 2))
    assert pieces.gather_into(model) == []
    assert [c[:2] for c in oracle.calls] == [("gather", "dp_shard")]
    for i, p in enumerate(levels.params):
        assert torch.equal(model.local(i), p.shard_of(fulls[i], 1))


def test_reduce_scatter_up_keeps_this_ranks_piece_in_staged_buffers(sim):
    levels, fulls, oracle = sim
    grads = levels.staged(0, torch.float32, staged := [])
    assert grads.state is BufferState.EMPTY and len(staged) == 1
    grads.load(fulls)
    shard = grads.reduce_scatter(2, staged)
    assert [c[:2] for c in oracle.calls] == [("reduce_scatter", "dp_outer"), ("reduce_scatter", "dp_shard")]  # outermost first
    assert shard.level == 2 and len(staged) == 3
    assert shard.flat.data_ptr() == staged[-1].data_ptr()  # lands in the last staged buffer, no copy
    for i, p in enumerate(levels.params):
        assert torch.equal(shard.local(i), p.shard_of(fulls[i], 2))
    assert shard.reduce_scatter(2, staged) is shard and len(staged) == 3  # already there: nothing moves


def test_reduce_scatter_into_a_fresh_buffer_writes_there_without_a_temporary(sim):
    levels, fulls, _ = sim
    grads = levels.staged(0, torch.float32, staged := [])
    grads.load(fulls)
    acc = levels.empty(2, torch.float32)
    assert acc.takes(2, torch.float32) and not acc.takes(1, torch.float32) and not acc.takes(2, torch.bfloat16)
    shard = grads.reduce_scatter(2, staged, into=acc)
    assert shard is acc and acc.state is BufferState.HOLDS
    assert len(staged) == 2, "only the intermediate level takes a staged temporary"
    for i, p in enumerate(levels.params):
        assert torch.equal(acc.local(i), p.shard_of(fulls[i], 2))
    assert not acc.takes(2, torch.float32)  # it holds values now: the next reduction is added, not written over
    with pytest.raises(ValueError, match="HOLDS level-2"):
        grads.reduce_scatter(2, staged, into=acc)


def test_load_zeroes_missing_rows_and_all_padding(sim):
    levels, fulls, _ = sim
    buf = levels.empty(0, torch.float32)
    buf.flat.fill_(float("nan"))
    buf.load([fulls[0], None, fulls[2], None, fulls[4]])
    assert not torch.isnan(buf.flat).any(), "padding or a missing parameter kept stale values"
    assert torch.equal(buf.local(0), fulls[0]) and torch.equal(buf.local(2), fulls[2])
    assert torch.count_nonzero(buf.local(1)) == 0 and torch.count_nonzero(buf.local(3)) == 0


def test_accumulate_copies_into_an_empty_buffer_then_adds(sim):
    levels, fulls, _ = sim
    a, b = _filled(levels, 1, fulls), _filled(levels, 1, _fulls(seed=1))
    acc = levels.empty(1, torch.float32)
    acc.flat.fill_(float("nan"))  # what a fresh allocation may hold
    assert acc.state is BufferState.EMPTY
    acc.accumulate(a)
    assert acc.state is BufferState.HOLDS and torch.equal(acc.flat, a.flat)
    acc.accumulate(b)
    assert torch.equal(acc.flat, a.flat + b.flat)
    held = _filled(levels, 1, fulls)  # a buffer holding values (kept grads) is added to at once
    held.accumulate(b)
    assert torch.equal(held.flat, a.flat + b.flat)


def test_free_and_alloc_keep_views_and_parameters_viewing_them(sim):
    levels, fulls, _ = sim
    buf = levels.empty(0, torch.bfloat16)
    params = [nn.Parameter(buf.local(i)) for i in range(len(fulls))]
    nbytes = levels.layouts[0].total * 2
    assert buf.storage_bytes() == nbytes
    buf.free()
    assert buf.state is BufferState.FREED and buf.storage_bytes() == 0
    assert [tuple(p.shape) for p in params] == [tuple(f.shape) for f in fulls]
    buf.alloc()
    assert buf.state is BufferState.EMPTY and buf.storage_bytes() == nbytes
    buf.load([f.to(torch.bfloat16) for f in fulls])
    for p, f in zip(params, fulls):  # the parameters see the new storage
        assert torch.equal(p.detach(), f.to(torch.bfloat16))


def test_cast_and_start_gather_stage_and_keep_alive_until_waited(sim):
    levels, fulls, oracle = sim
    main = _filled(levels, 2, fulls)
    pool = levels.streams.pool
    unsharded = levels.empty(0, torch.bfloat16)
    unsharded.free()
    flight = unsharded.start_gather(lambda staged: main.cast(torch.bfloat16, staged))
    assert unsharded.state is BufferState.HOLDS and unsharded.storage_bytes() == levels.layouts[0].total * 2
    for i, f in enumerate(fulls):
        assert torch.equal(unsharded.local(i), f.to(torch.bfloat16))
    assert len(flight.keepalive) == 1 and flight.keepalive[0].numel() == levels.layouts[1].total
    (cast,) = flight.staged
    assert cast.dtype == torch.bfloat16 and cast.numel() == main.flat.numel()
    flight.wait()
    assert flight.keepalive == () and flight.staged == ()
    assert pool.take(main.flat.numel(), torch.bfloat16, CPU) is cast  # back in the pool, reused
    # a plain buffer as the source (no staging)
    model = _filled(levels, 2, fulls, torch.bfloat16)
    unsharded.free()
    flight = unsharded.start_gather(model)
    assert flight.staged == () and len(flight.keepalive) == 1
    assert [c[:2] for c in oracle.calls] == [("gather", "dp_shard"), ("gather", "dp_outer")] * 2


def test_all_reduce_is_one_call_on_the_whole_buffer(sim):
    levels, fulls, oracle = sim
    buf = _filled(levels, 2, fulls)
    before = buf.flat.clone()
    buf.all_reduce(levels.axes)
    buf.all_reduce(levels.axes[1:], average=False)
    assert oracle.calls == [
        ("all_reduce", ("dp_outer", "dp_shard"), True, buf.flat.data_ptr(), buf.flat.numel()),
        ("all_reduce", ("dp_shard",), False, buf.flat.data_ptr(), buf.flat.numel()),
    ]
    assert torch.equal(buf.flat, before * 3)  # summed over the 3 ranks of dp_shard


def test_to_and_copy_to_make_buffers_of_the_same_level(sim):
    levels, fulls, _ = sim
    main = _filled(levels, 2, fulls)
    assert main.to(CPU, torch.float32) is main  # nothing to convert
    half = main.to(CPU, torch.bfloat16)
    assert half.level == 2 and half.flat.dtype == torch.bfloat16
    assert torch.equal(half.local(0), fulls[0][6:7].to(torch.bfloat16))
    other = main.copy_to(torch.empty(main.flat.numel()))
    assert other.level == 2 and torch.equal(other.flat, main.flat) and other.flat.data_ptr() != main.flat.data_ptr()


# --------------------------------------------------------- a real 1-process gloo group
class Counting(shardwise.Collectives):
    def __init__(self):
        self.calls: list[tuple] = []

    def gather(self, outs, ins, axis):
        self.calls.append(("gather", axis.name, len(outs)))
        super().gather(outs, ins, axis)

    def reduce_scatter(self, outs, ins, axis):
        self.calls.append(("reduce_scatter", axis.name, len(outs)))
        super().reduce_scatter(outs, ins, axis)

    def all_reduce(self, t, axes, average=True):
        self.calls.append(("all_reduce", tuple(a.name for a in axes), average))
        super().all_reduce(t, axes, average)


@pytest.fixture(scope="module")
def gloo_mesh():
    """A 1-process gloo default group and a (1, 1) mesh over it, destroyed afterwards."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp_outer", "dp_shard"))
    finally:
        dist.destroy_process_group()


def test_a_round_trip_over_axes_of_one_rank_communicates_nothing(gloo_mesh):
    plan = ShardingPlan(gloo_mesh, {"dp_outer": ZERO3, "dp_shard": ZERO3})
    fulls = _fulls(seed=3)
    params = [ShardedParam(ParamRef(f"p{i}", nn.Parameter(f.clone()), []), plan) for i, f in enumerate(fulls)]
    counting = Counting()
    levels = Levels(params, plan.opt_axes, counting, StreamSet(CPU), CPU)
    main = _filled(levels, 2, fulls)
    full = levels.empty(0, torch.float32)
    full.flat.fill_(float("nan"))
    assert main.gather_into(full) == []  # one rank per axis: a copy, no temporaries
    for i, f in enumerate(fulls):
        assert torch.equal(full.local(i), f)
    grads = levels.staged(0, torch.float32, staged := [])
    grads.load([2 * f for f in fulls])
    shard = grads.reduce_scatter(2, staged)
    shard.all_reduce(plan.opt_axes, average=False)
    acc = levels.empty(2, torch.float32)
    acc.accumulate(shard)
    acc.accumulate(shard)
    for i, (p, f) in enumerate(zip(params, fulls)):
        assert torch.equal(acc.local(i), 4 * f)  # one rank: the average and the sum are the value
        dtensor = acc.dtensors()[i]
        assert dtensor.placements == (S, S) and torch.equal(dtensor.full_tensor(), 4 * f)
    assert counting.calls == []


def test_a_group_is_made_of_buffers_and_states(gloo_mesh):
    plan = ShardingPlan(gloo_mesh, {"dp_outer": ZERO3, "dp_shard": ZERO3})
    torch.manual_seed(0)
    module = nn.Linear(6, 5)
    weight, bias = module.weight.detach().clone(), module.bias.detach().clone()
    refs = [ParamRef("weight", module.weight, [(module, "weight")]), ParamRef("bias", module.bias, [(module, "bias")])]
    counting = Counting()
    group = ParamGroup("lin", refs, plan, shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16), CPU,
                       StreamSet(CPU), collectives=counting)
    group.install_sharded_params()
    assert group.casts_on_gather and group.model_shard is None  # ZeRO-3 in bf16: cast at each gather
    assert group.module_params is ModuleParams.SHARDED and module.weight is group.sharded_params[0]
    assert group.weight_state is WeightState.SHARDED and group.storage_bytes_unsharded == 0
    group.finish_unshard()
    group.use_unsharded()
    assert group.weight_state is WeightState.UNSHARDED and module.weight is group.unsharded_params[0]
    assert torch.equal(module.weight.detach(), weight.to(torch.bfloat16))
    assert group.storage_bytes_unsharded == group.layouts[0].total * 2
    # two micro-batches: the first reduction overwrites the fresh buffer, the second adds
    for scale, finalize in ((1.0, False), (2.0, True)):
        module.weight.grad = torch.full_like(module.weight, scale)
        module.bias.grad = None  # missing grads count as zeros
        group.reduce_grads(finalize).wait()
        assert group.grad_state is (GradState.REDUCED if finalize else GradState.ACCUMULATING)
    group.install_grads()
    assert group.grad_state is GradState.IDLE and group.refresh_state is RefreshState.STALE
    grad = group.sharded_params[0].grad
    # the bias received no gradient in the window: no .grad, FSDP2's rule (tests/engine/test_fsdp2_grads.py)
    assert torch.equal(grad.full_tensor(), torch.full((5, 6), 3.0)) and group.sharded_params[1].grad is None
    assert group.resident_bytes()["main_grad"] == group.layouts[2].total * 4
    group.refresh_model_weights()
    assert group.refresh_state is RefreshState.CURRENT
    group.reshard()
    assert group.module_params is ModuleParams.SHARDED and module.weight is group.sharded_params[0]
    assert group.storage_bytes_unsharded == 0 and group.resident_bytes()["unsharded"] == 0
    assert torch.equal(group.sharded_params[1].full_tensor(), bias)
    del grad
    for p in group.sharded_params:
        p.grad = None  # zero_grad: the gradient buffer goes with the last .grad
    assert group.resident_bytes()["main_grad"] == 0
    assert counting.calls == []  # every axis has one rank: copies and casts only
