"""Gradients reduced in a 16-bit compute dtype (``param_dtype`` set, ``reduce_dtype=None``) are FSDP2's bits.

FSDP2 averages fp32 and bf16 in one step (``ReduceOp.AVG``), but splits the division for a dtype with
overflow risk (fp16): it divides by about the square root of the data-parallel size before a SUM and
by the rest after it (``_get_gradient_divide_factors``). A plain sum-then-divide overflows where FSDP2's
does not, and rounds differently where a halved gradient is subnormal, so torch's
``test_fully_shard_mixed_precision.py::test_compute_dtype`` saw different fp16 parameters. Each case
runs torch's FSDP2 and shardwise on the same model and data in the same worker and compares the
sharded gradients bit for bit after every step (same additions in the same order: no tolerance).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from tests.helpers.distributed import device, run_distributed

DIM, STEPS = 16, 3


def _grads_differ(dtype: torch.dtype, loss_scale: float, mesh_shape=None, reduce_dtype=None) -> list[str]:
    """Per step and parameter, where shardwise's sharded gradient differs from FSDP2's on this rank (HSDP over a
    named 2-D ``mesh_shape``: replicas, then shards)."""
    mesh = None if mesh_shape is None else init_device_mesh(device().type, mesh_shape,
                                                            mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.ReLU(), nn.Linear(4 * DIM, DIM))
                           for _ in range(2)]).to(device())
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype)
    models = []
    for fully_shard in (torch_fully_shard, shardwise.fully_shard):
        model = copy.deepcopy(base)
        for block in model:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        models.append(fully_shard(model, mesh=mesh, mp_policy=policy))
    optims = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in models]
    torch.manual_seed(1 + torch.distributed.get_rank())
    differ = []
    for step in range(STEPS):
        x = torch.randn(4, DIM, device=device(), dtype=dtype)
        for model, optim in zip(models, optims):
            optim.zero_grad()
            (model(x).sum() * loss_scale).backward()
        for (name, ref), got in zip(models[0].named_parameters(), models[1].parameters()):
            if not torch.equal(ref.grad.to_local(), got.grad.to_local()):
                differ.append(f"step {step} {name}")
        for optim in optims:
            optim.step()
    return differ


@pytest.mark.parametrize("world, dtype, loss_scale", [
    (2, torch.bfloat16, 1.0),
    (2, torch.float16, 1.0),
    (2, torch.float16, 1e4),  # each rank's gradients fit fp16, their sum does not: FSDP2 halves first
    (2, torch.float16, 1e-4),  # halved gradients subnormal: rounded before the SUM, as FSDP2 rounds them
    (4, torch.float16, 1e-4),  # divided by 2 before the SUM and by 2 after it
])
def test_16bit_reduce_matches_fsdp2_bitwise(world, dtype, loss_scale):
    assert run_distributed(_grads_differ, world, dtype, loss_scale) == [[]] * world


@pytest.mark.parametrize("mesh_shape, dtype, reduce_dtype, loss_scale", [
    ((2, 2), torch.float16, None, 1.0),
    ((2, 2), torch.float16, None, 1e4),  # halved before the reduce-scatter, halved after the replicas' SUM
    ((2, 2), torch.float16, None, 1e-4),
    ((2, 2), torch.bfloat16, torch.float16, 1e-4),  # fp16 as reduce_dtype only
    ((4, 1), torch.float16, None, 1e-4),  # no reduce-scatter: the replicas' all-reduce divides before and after
    ((1, 4), torch.float16, None, 1e-4),  # no replicas: the 1-D split
    ((2, 2), torch.float32, None, 1.0),  # one average per axis, as before
])
def test_hsdp_16bit_reduce_divides_over_the_whole_data_parallel_size_as_fsdp2(mesh_shape, dtype, reduce_dtype,
                                                                              loss_scale):
    """HSDP (torch's ``_get_gradient_divide_factors`` with an all-reduce group): FSDP2 splits the division of an
    fp16 mean over shards times replicas (world 4: by 2 before the reduce-scatter's SUM, by 2 after the
    all-reduce's SUM), where shardwise averaged each axis on its own; now FSDP2's bits. (bf16 keeps one average
    per axis, the replicas' in the fp32 main-gradient dtype: not FSDP2's bits, unchanged by this.)"""
    assert run_distributed(_grads_differ, 4, dtype, loss_scale, mesh_shape, reduce_dtype) == [[]] * 4
