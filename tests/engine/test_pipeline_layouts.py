"""Pipeline x FSDP on the mesh layouts the plain (pp, dp_shard) tests leave out (4 gloo processes).

``(pp, dp_shard, tp)``: each stage of a tensor-parallel GPT is sharded on its
``(dp_shard, tp)`` sub-mesh, TP inside; ``(pp, dp_outer, dp_shard)``: each stage
HSDP. Every step's loss and gradient norm (clipped by the norm over all stages
and TP ranks), and every parameter at the end, match the unsplit TP=1 GPT
trained on the whole batch by one process.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from tests.helpers.distributed import run_distributed
from tests.helpers.gpt_stages import Pipeline, Reference
from tests.helpers.parity import assert_close_states

STEPS = 3
MAX_NORM = 0.5  # below every step's gradient norm here: clipping bites (asserted)


def _parity(schedule, pp, strategy, outer=0, tp=1):
    pipe = Pipeline(schedule, pp, strategy, outer=outer, tp=tp)
    if tp > 1:  # TP inside the stage: the stage's DTensors say so in torch's terms
        wq = next(p for n, p in pipe.parts[0].named_parameters() if n.endswith("attention.wq.weight"))
        names = wq.device_mesh.mesh_dim_names
        assert isinstance(wq, DTensor) and "tp" in names and "pp" not in names, names
        assert wq.placements[names.index("tp")] == Shard(0) and wq.shape == (32, 32), (wq.placements, wq.shape)
    ref = Reference()
    got, expected = [], []
    for step in range(STEPS):  # step by step, so the reference fills time a rank waits in collectives
        got.append(pipe.step(step, MAX_NORM))
        expected.append(ref.step(step, MAX_NORM))
    got, expected = torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)  # losses and norms
    assert expected[:, 1].min() > MAX_NORM, expected
    assert_close_states(pipe.full_state(), ref.state(), rtol=1e-5)
    return got[:, 0].tolist()


@pytest.mark.parametrize("schedule,strategy", [("1f1b", "optim_grads_params"), ("interleaved", "optim")])
def test_pp2_dp1_tp2_trains_as_one_process(schedule, strategy):
    losses = run_distributed(_parity, 4, schedule, 2, strategy, tp=2)
    assert all(r == losses[0] for r in losses)


def test_pp2_hsdp_1x2_trains_as_one_process():
    # a (pp, dp_outer, dp_shard) = (2, 1, 2) mesh: each stage HSDP, sharded over dp_shard
    run_distributed(_parity, 4, "gpipe", 2, "optim_grads_params", outer=1)
