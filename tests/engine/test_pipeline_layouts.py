"""Pipeline x FSDP on the layouts and schedules the plain (pp, dp_shard) tests leave out.

``(pp, dp_shard, tp)``: each stage of a tensor-parallel GPT is sharded on its
``(dp_shard, tp)`` sub-mesh, TP inside; ``(pp, dp_outer, dp_shard)``: each stage
HSDP; the zero-bubble schedules, whose backward is split into an input and a
weight pass. Every step's loss and gradient norm (clipped by the norm over all
stages and TP ranks), and every parameter at the end, match the unsplit TP=1
GPT trained on the whole batch by one process.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

import shardwise
from shardwise.engine.model_ops import sharded_state
from shardwise.engine.pipeline import ShardedPipelineStage
from tests.helpers.counting import CountingCollectives
from tests.helpers.distributed import run_distributed
from tests.helpers.gpt_stages import MICRO_BATCHES, Pipeline, Reference
from tests.helpers.parity import assert_close_states

STEPS = 3
MAX_NORM = 0.5  # below every step's gradient norm here: clipping bites (asserted)


def _parity(schedule, pp, strategy, outer=0, tp=1, collectives=None):
    pipe = Pipeline(schedule, pp, strategy, outer=outer, tp=tp, collectives=collectives)
    if tp > 1:  # TP inside the stage: the stage's DTensors say so in torch's terms
        wq = next(p for n, p in pipe.parts[0].named_parameters() if n.endswith("attention.wq.weight"))
        names = wq.device_mesh.mesh_dim_names
        assert isinstance(wq, DTensor) and "tp" in names and "pp" not in names, names
        assert wq.placements[names.index("tp")] == Shard(0) and wq.shape == (32, 32), (wq.placements, wq.shape)
    ref = Reference()
    got, expected, own, expected_own = [], [], [], []
    for step in range(STEPS):  # step by step, so the reference fills time a rank waits in collectives
        got.append(pipe.step(step, MAX_NORM))
        own.append(pipe.own_losses)
        expected_own.append(ref.micro_losses(step, pipe.rows) if pipe.last else [])
        expected.append(ref.step(step, MAX_NORM))
    # this rank's own losses, before the all-reduce: its rows of the batch, not just the right mean
    torch.testing.assert_close(torch.tensor(own, dtype=torch.float64),
                               torch.tensor(expected_own, dtype=torch.float64), rtol=1e-5, atol=0)
    got, expected = torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)  # losses and norms
    assert expected[:, 1].min() > MAX_NORM, expected
    assert_close_states(pipe.full_state(), ref.state(), rtol=1e-5)
    return sum(len(losses) for losses in own)


def _assert_every_last_stage_rank_checked(checked: list[int], pp: int = 2) -> None:
    """Each rank holding the last stage (dp x tp of them) checked all its micro-batch losses; no other held any."""
    assert sum(checked) == len(checked) // pp * STEPS * MICRO_BATCHES, checked


@pytest.mark.slow
@pytest.mark.parametrize("schedule,strategy", [("1f1b", "optim_grads_params"), ("interleaved", "optim")])
def test_pp2_dp1_tp2_trains_as_one_process(schedule, strategy):
    _assert_every_last_stage_rank_checked(run_distributed(_parity, 4, schedule, 2, strategy, tp=2))


@pytest.mark.slow
def test_pp2_hsdp_1x2_trains_as_one_process():
    # a (pp, dp_outer, dp_shard) = (2, 1, 2) mesh: each stage HSDP, sharded over dp_shard
    _assert_every_last_stage_rank_checked(run_distributed(_parity, 4, "gpipe", 2, "optim_grads_params", outer=1))


def _zero_bubble(schedule, strategy):
    """Parity, with every backward of a stage that is not the first split in two (the first stage has no input
    gradient: torch runs its whole backward in the weight step); returns the passes each kind ran and the
    number of its own losses this rank checked."""
    passes = Counter()
    whole = ShardedPipelineStage.backward_maybe_with_nosync

    def counted(self, backward_type, bwd_kwargs, last_backward=False):
        passes[(self.stage_index == 0, backward_type)] += 1
        return whole(self, backward_type, bwd_kwargs, last_backward)

    ShardedPipelineStage.backward_maybe_with_nosync = counted
    try:
        checked = _parity(schedule, 2, strategy)
    finally:
        ShardedPipelineStage.backward_maybe_with_nosync = whole
    return dict(passes), checked


@pytest.mark.parametrize("schedule,strategy,world", [
    ("zbv", "optim_grads_params", 2),
    ("zbv", "optim_grads", 4),
    ("interleaved_zb", "optim_grads_params", 4),
])
def test_zero_bubble_schedules_train_as_one_process(schedule, strategy, world):
    split = 3 * 4  # steps x micro-batches: one input and one weight pass each, per stage
    results = run_distributed(_zero_bubble, world, schedule, strategy)
    _assert_every_last_stage_rank_checked([checked for _, checked in results])
    for rank, (passes, _) in enumerate(results):
        first = rank < world // 2  # pp rank 0 holds stage 0 (and stage 3 or 2)
        assert passes == ({(True, "full"): split, (False, "input"): split, (False, "weight"): split} if first
                          else {(False, "input"): 2 * split, (False, "weight"): 2 * split}), (rank, passes)


def _reductions_per_step():
    counting = CountingCollectives()
    pipe = Pipeline("zbv", 2, "no_shard", collectives=counting)
    groups = sum(1 for part in pipe.parts for g in sharded_state(part).groups if g.requires_grad)
    counts = []
    for step in range(2):
        counting.calls.clear()
        pipe.step(step, 1e9)
        counts.append(dict(counting.calls))
    return groups, counts


@pytest.mark.slow
def test_a_zero_bubble_stage_reduces_its_gradients_once_per_step():
    # no_shard keeps gradients Partial: the weight passes accumulate, one all-reduce per group and step
    for groups, counts in run_distributed(_reductions_per_step, 4):
        assert counts == [{"all_reduce": groups}] * 2, (groups, counts)
