"""GPUs: ``set_allocate_memory_from_process_group_for_comm(True)`` on real NCCL, under torch's FSDP2 and shardwise.

The CPU tests (``tests/engine/test_fsdp2_process_group_alloc.py``) fake a backend that allocates; this runs the
real one. Two parts, written to ``--out``:

- ``pool``: the engine's :func:`comm_collectives` over the world group (forced even at one rank, where a unit
  leaves one-rank axes out): whether NCCL says it allocates, the collectives class it gives, and an all-gather and
  a reduce-scatter whose buffers come from the registered pool (``torch.cuda.MemPool`` segments counted), checked
  against the same collectives on plain memory.
- ``train``: a model wrapped per block and at the root, trained ``--steps`` AdamW steps by FSDP2 and shardwise,
  each with and without the call on every module (bf16 compute, fp32 reduction): the losses and the parameters'
  largest difference against FSDP2 without the call (the same kernels in the same order: 0 expected), the
  collectives each shardwise unit ended with, and ms/step.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --nproc-per-node 2 scripts/process_group_alloc_check.py --out $OUT/process-group-alloc.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shardwise  # noqa: E402
from shardwise.engine.collectives import Collectives  # noqa: E402
from shardwise.engine.process_group_alloc import comm_collectives  # noqa: E402

DIM, BLOCKS, BATCH = 1024, 4, 64


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 16)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _pool_bytes(collectives) -> int:
    pool = getattr(collectives, "pool", None)
    return 0 if pool is None else sum(s["total_size"] for s in pool.snapshot())


def _pool_part(device: torch.device) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    collectives = comm_collectives(Collectives(), True, [group], device)
    out = {"allocates": bool(group._get_backend(device).supports_tensor_alloc(device)),
           "collectives": type(collectives).__name__}
    shard = torch.arange(1024, device=device, dtype=torch.float32) + 1000 * rank
    with collectives.buffers():
        gathered = torch.empty(world * 1024, device=device)
        reduced = torch.empty(1024, device=device)
    dist.all_gather_into_tensor(gathered, shard)
    dist.reduce_scatter_tensor(reduced, gathered.repeat(world))
    plain_gathered = torch.empty_like(gathered)
    dist.all_gather_into_tensor(plain_gathered, shard)
    torch.cuda.synchronize()
    out["pool_bytes"] = _pool_bytes(collectives)
    out["gather_equal"] = bool(torch.equal(gathered, plain_gathered))
    out["reduce_scatter_equal"] = bool(torch.equal(reduced, world * gathered[rank * 1024:(rank + 1) * 1024]))
    return out


def _train(which: str, enable: bool, steps: int, device: torch.device) -> dict:
    fully_shard = torch_fully_shard if which == "fsdp2" else shardwise.fully_shard
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    model = _Net().to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    if enable:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_allocate_memory_from_process_group_for_comm(True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, times = [], []
    for step in range(steps):
        torch.manual_seed(100 + step + 10 * dist.get_rank())
        x = torch.randn(BATCH, DIM, device=device)
        target = torch.randint(0, 16, (BATCH,), device=device)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = F.cross_entropy(model(x).float(), target)
        loss.backward()
        optim.step()
        optim.zero_grad()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    params = {n: p.full_tensor().detach().float().cpu() for n, p in model.named_parameters()}
    out = {"losses": losses, "params": params, "ms_per_step": 1000 * sorted(times[2:])[len(times[2:]) // 2]}
    if which == "shardwise":
        out["collectives"] = sorted({type(g.collectives).__name__ for g in model.sharded_state.groups})
        out["pool_bytes"] = max((_pool_bytes(g.collectives) for g in model.sharded_state.groups), default=0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default="process-group-alloc.json")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    report = {"world": dist.get_world_size(), "torch": torch.__version__, "pool": _pool_part(device), "train": {}}
    runs = {(w, e): _train(w, e, args.steps, device) for w in ("fsdp2", "shardwise") for e in (False, True)}
    reference = runs["fsdp2", False]
    for (which, enable), run in runs.items():
        diff = max((run["params"][n] - p).abs().max().item() for n, p in reference["params"].items())
        row = {k: v for k, v in run.items() if k != "params"}
        row["max_param_diff_vs_fsdp2"] = diff
        row["losses_equal_fsdp2"] = run["losses"] == reference["losses"]
        report["train"][f"{which}{'-alloc' if enable else ''}"] = row
    if rank == 0:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
