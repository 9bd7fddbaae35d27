"""``shardwise plan --calibrate``: this machine's numbers for the step model, measured and stored.

Two gloo processes time ``all_gather_into_tensor`` of bf16 payloads from 64 KiB to 16 MiB (median of a few
calls each) and fit ``latency + (n - 1) / n x bytes / bandwidth`` by least squares; one process times a
reference transformer layer's bf16 forward and backward at the shape of ``--preset tiny`` (FLOPs per second:
the machine's whole compute rate for such a layer, so the efficiencies become 1 and the elementwise term 0).
The file (JSON) holds a ``gpu`` row (``GpuSpec`` fields: the CPU as one "device" per process, its links the
measured gloo ring) and ``efficiency``; ``shardwise plan --calibration FILE`` uses both. On GPUs the same
measurements belong to NCCL and a GPU layer; this module measures what the machine it runs on has.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

__all__ = ["calibrate", "measure_layer", "fit_alpha_beta"]

SIZES = [2**16, 2**18, 2**20, 2**22, 2**24]  # bytes of the gathered payload


def fit_alpha_beta(points: list[tuple[float, float]], n: int) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of ``t = a + (n - 1) / n x bytes / bw`` through ``(bytes, seconds)``."""
    xs = [(n - 1) / n * b for b, _ in points]
    ys = [t for _, t in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return max(my - slope * mx, 0.0), 1.0 / slope


def _gather_worker(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    points = []
    for nbytes in SIZES:
        inp = torch.empty(nbytes // 2 // world, dtype=torch.bfloat16)
        full = torch.empty(inp.numel() * world, dtype=torch.bfloat16)
        times = []
        gather(full, inp)  # the first call of a size sets up buffers
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            gather(full, inp)
            times.append(time.perf_counter() - t0)
        points.append((nbytes, statistics.median(times)))
    if rank == 0:
        out.put(points)
    dist.destroy_process_group()


def measure_gather(world: int = 2) -> list[tuple[float, float]]:
    import torch.multiprocessing as mp

    from ..launch import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_gather_worker, args=(r, world, port, out)) for r in range(world)]
    for p in procs:
        p.start()
    points = out.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return points


def measure_layer(seq: int = 128, micro_batch: int = 4, repeats: int = 5) -> float:
    """FLOP/s of one reference layer's bf16 forward and backward at ``--preset tiny``'s width (one thread per
    process, as ``shardwise bench`` runs each rank)."""
    from ...models import GPTConfig, TransformerLayer
    from ...models.norm_rope import rope_tables
    from ..presets import PRESETS

    shape = {k: v for k, v in PRESETS["tiny"].items() if k in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads")}
    cfg = GPTConfig(**shape, max_seq_len=seq)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        layer = TransformerLayer(cfg).to(torch.bfloat16)
        x = torch.randn(micro_batch, seq, cfg.dim, dtype=torch.bfloat16, requires_grad=True)
        cos, sin = rope_tables(seq, cfg.head_dim, cfg.rope_theta)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            layer(x, cos, sin).float().sum().backward()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    n = sum(p.numel() for p in layer.parameters())
    flops = 3 * (2 * n + 4 * cfg.dim * seq) * micro_batch * seq
    return flops / statistics.median(times[1:])


def calibrate(path: str | os.PathLike, world: int = 2) -> Path:
    """Measure and write the calibration file; returns its path."""
    points = measure_gather(world)
    latency, bw = fit_alpha_beta(points, world)
    rate = measure_layer()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    data = {
        "measured": {"all_gather_points": points, "world": world, "layer_flops_per_s": rate,
                     "when": time.strftime("%Y-%m-%d %H:%M:%S")},
        "gpu": {"name": "cpu (calibrated)", "bf16_flops": rate, "fp8_flops": rate, "hbm_bytes": memory / world,
                "hbm_bw": 1e12, "nvlink_bw": bw, "net_bw": bw, "nvlink_latency": latency, "net_latency": latency,
                "source": f"shardwise plan --calibrate ({world} gloo processes, this machine)"},
        "efficiency": {"matmul": 1.0, "elementwise_compiled": 0.0, "elementwise_eager": 0.0, "hbm": 1.0},
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1))
    return out
