"""The dry run against a real run (issue 56's GPU check): at world 1 and 2, ``shardwise bench`` trains the
0.9b size with shardwise (eager, ZeRO-3, micro-batch 2, seq 4096), and ``shardwise plan --dry-run`` runs rank 0
of the same job on one GPU; the dry run's peak allocated must be within 1% of the bench's and its tokens/s
within 5%. Prints one row per world and writes them to ``--out``/dry_run_check.json.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    python scripts/dry_run_check.py --out $OUT            # needs 2 GPUs for world 2

The bench's peak counts from its wrapped model on (its reset point), so the dry run's figure beside it is
``all_steps_peak_allocated`` (the first step included); the steady steps' peak is printed too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

GIB = 2**30


def _run(argv: list[str]) -> str:
    done = subprocess.run([sys.executable, "-m", "shardwise", *argv], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"shardwise {' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return done.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/dry_run_check")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--size", default="0.9b", help="the bench size (its model: --preset)")
    p.add_argument("--preset", default="1b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the script's own smoke test")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = "H100"
    if args.device == "cuda":
        import torch

        gpu = "H200" if "H200" in torch.cuda.get_device_name() else "H100"
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        bench_dir = out / f"bench-w{world}"
        _run(["bench", "--sizes", args.size, "--nproc", str(world), "--wrappers", "shardwise", "--compile", "off",
              "--device", args.device, "--steps", str(args.steps), "--out", str(bench_dir)])
        real = json.loads((bench_dir / "bench.json").read_text())["runs"][0]
        plan = json.loads(_run([
            "plan", "--preset", args.preset, "--gpus", str(world), "--gpu", gpu, "--seq", str(args.seq),
            "--global-batch", str(world * args.micro_batch), "--micro-batch", str(args.micro_batch), "--eager",
            "--no-fp8", "--no-hybrid", "--strategy", "optim_grads_params", "--activation-checkpointing", "off",
            "--reshard-after-forward", "on", "--dry-run", "--dry-run-steps", str(args.steps), "--json"]))
        dry = plan["dry_run"]
        dry_peak = (dry["all_steps_peak_allocated"] or dry["traced_peak"]) / GIB
        row = {"world": world, "device": dry["device"], "bench_peak_gib": real["peak_alloc_gib"],
               "dry_peak_gib": dry_peak, "dry_steady_peak_gib": (dry["peak_allocated"] or dry["traced_peak"]) / GIB,
               "static_peak_gib": plan["recommended"]["peak_gib"],
               "bench_tokens_per_s": real["tokens_per_s_per_gpu"], "dry_tokens_per_s": dry["tokens_per_s_per_gpu"],
               "static_tokens_per_s": plan["recommended"]["tokens_per_s_per_gpu"]}
        row["peak_ratio"] = row["dry_peak_gib"] / row["bench_peak_gib"]
        row["tokens_ratio"] = row["dry_tokens_per_s"] / row["bench_tokens_per_s"]
        row["passes"] = abs(row["peak_ratio"] - 1) <= 0.01 and abs(row["tokens_ratio"] - 1) <= 0.05
        rows.append(row)
        print(f"world {world} on {row['device']}: peak allocated bench {row['bench_peak_gib']:.3f} GiB, dry run "
              f"{row['dry_peak_gib']:.3f} (steady {row['dry_steady_peak_gib']:.3f}), static {row['static_peak_gib']:.3f}: "
              f"{row['peak_ratio']:.4f}; tokens/s bench {row['bench_tokens_per_s']:,.0f}, dry run "
              f"{row['dry_tokens_per_s']:,.0f}, static {row['static_tokens_per_s']:,.0f}: {row['tokens_ratio']:.3f}; "
              f"{'passes' if row['passes'] else 'MISSES'} (1% / 5%)", flush=True)
    (out / "dry_run_check.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["passes"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
