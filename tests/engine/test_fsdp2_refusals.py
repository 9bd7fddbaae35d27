"""What FSDP2's ``fully_shard`` refuses at wrap time, refused by shardwise's where and as FSDP2 does (issue 54:
torch's ``test_2d_mesh_without_mesh_dim_names`` and ``test_raise_noncontiguous_parameter``); each case runs
torch's ``fully_shard`` and shardwise's on the same input in the same test. shardwise's own placement
arguments (``placements=`` / ``strategy=``, the Megatron face and the one-call form) keep taking both.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from tests.helpers.distributed import device, run_distributed


def _outcome(call) -> tuple:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the class and words are what is compared
        return type(e), str(e)
    return None, ""


def _channels_last_conv() -> nn.Module:
    return nn.Conv2d(8, 8, 3).to(device()).to(memory_format=torch.channels_last)


def _refusals() -> dict:
    world = dist.get_world_size()
    unnamed = init_device_mesh(device().type, (2, world // 2))
    out = {}
    for which, fully_shard in (("fsdp2", torch_fully_shard), ("shardwise", shardwise.fully_shard)):
        out[which, "mesh"] = _outcome(lambda: fully_shard(nn.Linear(4, 4).to(device()), mesh=unnamed))
        out[which, "noncontiguous"] = _outcome(lambda: fully_shard(_channels_last_conv()))
        conv = nn.Sequential(_channels_last_conv(), nn.Linear(4, 4).to(device()))
        out[which, "ignored"] = _outcome(lambda: fully_shard(conv, ignored_params=set(conv[0].parameters())))
    # shardwise's own placement arguments read the axes themselves: still taken, and computing the same output
    torch.manual_seed(0)
    reference = nn.Sequential(_channels_last_conv(), nn.Linear(6, 4).to(device()))
    reference[0].to(memory_format=torch.contiguous_format)  # the gathered weight's layout: the same kernel
    torch.manual_seed(0)
    model = nn.Sequential(_channels_last_conv(), nn.Linear(6, 4).to(device()))
    shardwise.fully_shard(model, mesh=unnamed, strategy="optim_grads_params")
    out["native_shapes"] = [tuple(p.full_tensor().shape) for p in model.parameters()]
    out["reference_shapes"] = [tuple(p.shape) for p in reference.parameters()]
    x = torch.randn(2, 8, 8, 8, device=device())
    out["native"], out["reference"] = model(x).detach().cpu(), reference(x).detach().cpu()
    return out


def test_unnamed_2d_mesh_and_noncontiguous_parameter_refused_as_fsdp2():
    out = run_distributed(_refusals, 4)[0]
    for case in ("mesh", "noncontiguous"):
        theirs, ours = out["fsdp2", case], out["shardwise", case]
        assert theirs[0] is not None, case
        assert ours[0] is theirs[0], (case, ours, theirs)  # AssertionError / NotImplementedError, FSDP2's classes
    assert "Please init the 2D mesh for HSDP with mesh_dim_names specified" in out["shardwise", "mesh"][1]
    assert "mesh_dim_names=(" in out["shardwise", "mesh"][1]  # what to do
    assert "FSDP does not support non-contiguous parameters" in out["shardwise", "noncontiguous"][1]
    assert "'weight'" in out["shardwise", "noncontiguous"][1] and ".contiguous()" in out["shardwise", "noncontiguous"][1]
    # FSDP2 does not look at a parameter it does not manage: neither does shardwise
    assert out["fsdp2", "ignored"] == out["shardwise", "ignored"] == (None, "")
    assert out["native_shapes"] == out["reference_shapes"]
    torch.testing.assert_close(out["native"], out["reference"], rtol=0, atol=0)
