"""Units first called inside a ``torch.func`` transform (torch's ``test_no_warmup_jvp_reshard_after_forward_false``):
the gather runs on plain tensors, outside the transform, and the forward-mode result is FSDP2's.

``torch.func.jvp`` wraps what it traces in functorch tensors, which have no storage; the engine's buffer work
(gather, refresh, free) is not part of the function being differentiated, so it runs outside the transform, as
FSDP2's collectives do. Run with torch's ``fully_shard`` and shardwise's in the same test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import distribute_tensor

import shardwise
from tests.helpers.distributed import device, run_distributed


def _jvp(which: str, dtype: torch.dtype) -> dict:
    fully_shard = torch_fully_shard if which == "fsdp2" else shardwise.fully_shard
    mesh = init_device_mesh(device().type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
    with torch.device("meta"):
        enc, dec = nn.Linear(16, 32, bias=False), nn.Linear(32, 24, bias=False)
    for module in (enc, dec):
        fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for seed, module in enumerate((enc, dec)):  # every rank draws the whole weight, keeps its shard
        module.to_empty(device=device())
        full = torch.randn(module.weight.shape, generator=torch.Generator().manual_seed(42 + seed))
        with torch.no_grad():
            module.weight.copy_(distribute_tensor(full.to(device()), module.weight.device_mesh,
                                                  module.weight.placements, src_data_rank=None))
    g = torch.Generator().manual_seed(0)
    x, tangent = torch.randn(16, generator=g).to(dtype), torch.randn(16, generator=g).to(dtype)
    # no forward before the transform: the units gather for the first time inside it
    output, tangent_output = torch.func.jvp(lambda inp: dec(enc(inp)), (x.to(device()),), (tangent.to(device()),))
    return {"output": output.detach().cpu(), "tangent": tangent_output.detach().cpu()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_units_first_gathered_inside_jvp_give_fsdp2s_output_and_tangent(dtype):
    theirs = run_distributed(_jvp, 2, "fsdp2", dtype)
    ours = run_distributed(_jvp, 2, "shardwise", dtype)
    for t, o in zip(theirs, ours):
        assert o["output"].dtype == dtype and o["output"].shape == (24,)
        # the same gathered weights through the same kernels: equal, not close
        assert torch.equal(o["output"], t["output"])
        assert torch.equal(o["tangent"], t["tangent"])
        assert t["tangent"].abs().sum() > 0  # the tangent is not trivially zero
