"""Time a checkpoint save, a resharded load and an export for a preset; report peak host memory.

    python -m benchmarks.checkpoint --preset 1b --dir /tmp/ckpt            # one process per GPU
    python -m benchmarks.checkpoint --preset tiny --nproc 2 --dir /tmp/c    # CPU, gloo

Each rank builds the preset's GPT, shards it (``--strategy``), takes one AdamW
step so optimizer state exists, saves, then builds a fresh model sharded with
``--load-strategy`` and loads the checkpoint into it, checking that every main
weight and optimizer value came back. Then one process with no process group
exports the model to bf16 safetensors. Prints one JSON line per phase.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import fields

import torch
import torch.distributed as dist

from shardwise import destroy_process_groups
from shardwise.app.launch import launch_local
from shardwise.app.host_memory import host_peak_bytes, host_resident_bytes, reset_host_peak
from shardwise.engine.model_ops import parameter_groups

MIB = 2**20


def _build(args, strategy: str, device: torch.device):
    import shardwise
    from shardwise.models import GPT, GPTConfig
    from shardwise.app.presets import PRESETS

    names = {f.name for f in fields(GPTConfig)}
    config = GPTConfig(**{k: v for k, v in PRESETS[args.preset].items() if k in names})
    config.max_seq_len = max(config.max_seq_len, args.seq_len)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config)
    bf16 = PRESETS[args.preset].get("precision") == "bf16"
    model = shardwise.fully_shard(
        model, strategy=strategy, unit_modules=list(dict.fromkeys(type(m) for m in model.layers)),
        mixed_precision=shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4), config

def _checksum(model, optimizer) -> torch.Tensor:
    """Sums over every main weight and optimizer value (identical whatever the sharding)."""
    params = [p for group, _ in parameter_groups(model) for p in group]
    total = torch.zeros(3, dtype=torch.float64, device=params[0].to_local().device)
    for param in params:
        state = optimizer.state.get(param, {})
        total[0] += param.to_local().double().square().sum()
        for i, key in enumerate(("exp_avg", "exp_avg_sq"), start=1):
            if key in state:
                total[i] += state[key].to_local().double().abs().sum()
    return total

def _worker(args) -> None:
    from shardwise.checkpoint import CheckpointManager

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available() and not args.cpu
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            device_id=device if cuda else None)

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    base = [0.0]

    def start() -> float:
        sync()
        reset_host_peak()
        base[0] = host_resident_bytes() / MIB
        return time.perf_counter()

    def report(phase: str, seconds: float, **more) -> None:
        mem = torch.tensor([host_peak_bytes() / MIB, base[0]], dtype=torch.float64, device=device)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(json.dumps({"phase": phase, "seconds": round(seconds, 2), "world": world,
                              "peak_host_rss_mib_max_rank": round(mem[0].item()),
                              "rss_before_mib_max_rank": round(mem[1].item()), **more}), flush=True)

    model, optimizer, config = _build(args, args.strategy, device)
    tokens = torch.randint(0, config.vocab_size, (1, args.seq_len + 1), device=device)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()
    n_params = sum(p.numel() for p in model.parameters())
    saved_sum = _checksum(model, optimizer)
    dist.all_reduce(saved_sum)
    manager = CheckpointManager(args.dir, keep_last=1)
    t0 = start()
    path = manager.save(1, model, optimizer, extra={"step": 1})
    sync()
    report("save", time.perf_counter() - t0, params=n_params, strategy=args.strategy,
           bytes_on_disk=sum(f.stat().st_size for f in path.iterdir()))
    del model, optimizer
    if cuda:
        torch.cuda.empty_cache()

    model, optimizer, _ = _build(args, args.load_strategy, device)
    t0 = start()
    manager.load_latest(model, optimizer)
    sync()
    seconds = time.perf_counter() - t0
    loaded_sum = _checksum(model, optimizer)
    dist.all_reduce(loaded_sum)
    replicated = "no_shard" in (args.strategy, args.load_strategy)  # replicas would count twice
    same = None if replicated else bool(torch.allclose(saved_sum, loaded_sum, rtol=1e-9))
    report("load", seconds, strategy=args.load_strategy, checksum_equal=same)
    del model, optimizer
    destroy_process_groups()  # every group's threads joined now, not raced by the interpreter's exit

_EXPORT = r"""
import json, sys, time
from shardwise.checkpoint.export import export_safetensors
def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
try:
    open("/proc/self/clear_refs", "w").write("5")
except OSError:
    pass
base = status("VmRSS:")
t0 = time.perf_counter()
files = export_safetensors(sys.argv[1], sys.argv[2], dtype="bf16", max_shard_size="2GB")
print(json.dumps({"phase": "export bf16", "seconds": round(time.perf_counter() - t0, 2),
                  "rss_before_mib": round(base), "peak_host_rss_mib": round(status("VmHWM:")),
                  "files": len(files), "bytes": sum(f.stat().st_size for f in files)}), flush=True)
"""

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.checkpoint",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--dir", required=True, help="checkpoint folder (use a local disk)")
    parser.add_argument("--nproc", type=int, default=0, help="processes (default: one per GPU, 2 on CPU)")
    parser.add_argument("--strategy", default="optim_grads_params")
    parser.add_argument("--load-strategy", default="optim")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--no-export", action="store_true")
    args = parser.parse_args(argv)
    world = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() and not args.cpu else 2)
    if launch_local(_worker, world, (args,), "benchmarks.checkpoint"):
        return 1
    if not args.no_export:
        subprocess.run([sys.executable, "-c", _EXPORT, args.dir, os.path.join(args.dir, "export")], check=True)
    return 0

if __name__ == "__main__":
    sys.exit(main())
