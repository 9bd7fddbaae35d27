"""Where a benchmark step's GPU time goes: kernel time per step by category, for each wrapper, in one job.

    torchrun --nproc-per-node 1 scripts/step_kernels.py --size 0.9b --wrappers shardwise,none --out k.json

Each wrapper trains the size's model (layers compiled, as ``shardwise bench --compile``) for 4 warm-up
steps, then ``torch.profiler`` records 3; kernels are grouped by name into GEMM, attention, optimizer,
compiled (triton), copy/cast, fill, communication and other. Used to tell GPU work a wrapper adds
(docs/performance.md, "CUDA graphs") from host time, which graphs remove.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from shardwise.app.bench.runner import _make_batches, _train_step
from shardwise.app.bench.sizes import SIZES, model_config
from shardwise.app.bench.wrappers import WRAPPERS
from shardwise.models import GPT

CATEGORIES = [("communication", r"nccl"), ("optimizer", r"adam|FusedOptimizer"), ("attention", r"flash|fmha|sdpa"),
              ("gemm", r"gemm|nvjet|cutlass|cublas|xmma"), ("triton", r"triton"),
              ("copy/cast", r"copy|Memcpy|cast|convert|TensorListMetadata"), ("fill", r"Memset|fill|zero")]
WARMUP, PROFILED = 4, 3


def kernel_times(model, optimizer, batches) -> dict[str, float]:
    """Milliseconds per step of each CUDA kernel over the profiled steps."""
    for batch in batches[:WARMUP]:
        _train_step(model, optimizer, batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for batch in batches[WARMUP:WARMUP + PROFILED]:
            _train_step(model, optimizer, batch)
        torch.cuda.synchronize()
    per_kernel = collections.Counter()
    for event in prof.events():  # device events only: CPU ranges would count their kernels twice
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name] += event.device_time_total / 1e3 / PROFILED
    return dict(per_kernel)


def by_category(per_kernel: dict[str, float]) -> dict[str, float]:
    totals = collections.Counter()
    for name, ms in per_kernel.items():
        totals[next((c for c, rx in CATEGORIES if re.search(rx, name, re.I)), "other")] += ms
    return {c: round(ms, 3) for c, ms in totals.most_common()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="0.9b", choices=sorted(SIZES))
    p.add_argument("--wrappers", default="shardwise,none")
    p.add_argument("--out", default="step_kernels.json")
    args = p.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    device = torch.device("cuda", torch.cuda.current_device())
    size = SIZES[args.size]
    config = model_config(size)
    config.max_seq_len = max(config.max_seq_len, size.seq_len)
    batches = _make_batches(config.vocab_size, size.micro_batch, size.seq_len, WARMUP + PROFILED, 0, 0, device)
    out = {}
    for name in args.wrappers.split(","):
        torch.manual_seed(0)
        with torch.device(device):
            model = GPT(config)
        model, optimizer = WRAPPERS[name](model, device, compile={"backend": "inductor", "fullgraph": True,
                                                                  "dynamic": False})
        per_kernel = kernel_times(model, optimizer, batches)
        out[name] = {"kernel_ms_per_step": round(sum(per_kernel.values()), 3), "categories": by_category(per_kernel),
                     "top": sorted(((round(ms, 3), k[:120]) for k, ms in per_kernel.items()), reverse=True)[:30]}
        print(name, json.dumps({k: out[name][k] for k in ("kernel_ms_per_step", "categories")}), flush=True)
        del model, optimizer
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
