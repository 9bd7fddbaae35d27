"""``plan_fn``'s ``"local_expert"``: each EP rank's own expert tensor, a DTensor over its expert-data-parallel peers.

4 gloo processes, expert mesh ``(dp_shard, ep)`` of 2 x 2: rank ``r`` holds expert ``r % 2`` (a different
tensor on each EP rank, the same on its two expert-dp peers). Its DTensor's mesh is the expert-dp group
only, its global shape the one expert's, and torch's own tools agree: ``full_tensor`` is this EP rank's
expert, ``redistribute`` to Replicate too, and ``DTensor.from_local`` of the shard on that mesh is the
same DTensor. The stacked ``"expert"`` answer keeps its ``(ep, dp_shard)`` DTensor of all experts.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate

import shardwise
from shardwise.engine.mesh import EXPERT, LOCAL_EXPERT

from tests.helpers.distributed import run_distributed


class _Experts(nn.Module):
    def __init__(self, ep_rank: int):
        super().__init__()
        torch.manual_seed(100 + ep_rank)  # a different expert on each EP rank
        self.local = nn.Linear(4, 6, bias=False)  # one expert of its own
        self.stacked = nn.Parameter(torch.randn(3, 4))  # this EP rank's rows of stacked experts
        torch.manual_seed(0)
        self.dense = nn.Linear(4, 4)


def _local_experts() -> dict:
    ep_rank = dist.get_rank() % 2
    model = _Experts(ep_rank)
    expected = model.local.weight.detach().clone()
    stacked = [None, None]
    torch.manual_seed(100)
    stacked[0] = (nn.Linear(4, 6, bias=False), torch.randn(3, 4))[1]
    torch.manual_seed(101)
    stacked[1] = (nn.Linear(4, 6, bias=False), torch.randn(3, 4))[1]
    expert_mesh = shardwise.build_expert_mesh(2)

    def plan_fn(fqn, param):
        return {"local.weight": LOCAL_EXPERT, "stacked": EXPERT}.get(fqn, "dense")

    shardwise.fully_shard(model, expert_mesh=expert_mesh, plan_fn=plan_fn)
    local, dense, stacked_param = model.local.weight, model.dense.weight, model.stacked
    assert isinstance(local, DTensor)
    peers = dist.get_process_group_ranks(expert_mesh.get_group("dp_shard"))
    assert local.device_mesh.mesh.tolist() == peers and local.device_mesh.mesh_dim_names == ("dp_shard",)
    assert local.shape == (6, 4)
    assert torch.equal(local.full_tensor(), expected)
    assert torch.equal(local.redistribute(local.device_mesh, [Replicate()]).to_local(), expected)
    again = DTensor.from_local(local.to_local(), local.device_mesh, local.placements, run_check=False,
                               shape=local.shape, stride=local.stride())
    assert torch.equal(again.full_tensor(), expected)
    # the stacked answer: one DTensor of every EP rank's rows, over (ep, dp_shard)
    assert stacked_param.shape == (6, 4) and torch.equal(stacked_param.full_tensor(), torch.cat(stacked))
    assert dense.device_mesh.mesh.flatten().tolist() == [0, 1, 2, 3]
    return peers


@pytest.mark.slow
def test_local_expert_dtensors_are_true_in_torchs_terms():
    assert run_distributed(_local_experts, 4) == [[0, 2], [1, 3], [0, 2], [1, 3]]
