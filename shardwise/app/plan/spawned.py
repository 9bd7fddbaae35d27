"""The processes ``shardwise plan --calibrate`` measures in: spawned, one per rank, each in the default group.

``run_spawned`` starts them and returns what rank 0 reports; ``join_group`` is a process's first step (its
device: its own GPU under NCCL, one CPU thread under gloo, as ``shardwise bench`` runs each rank).
"""

from __future__ import annotations

import os
import queue
import statistics
import time

import torch

__all__ = ["run_spawned", "join_group", "sync", "median_seconds"]


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a CPU's is done when its call returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run, device: torch.device, repeats: int) -> float:
    """The median wall time of ``repeats`` calls of ``run()`` on ``device``, after two warm-up calls."""
    for _ in range(2):
        run()
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        run()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def join_group(rank: int, world: int, port: int, backend: str) -> torch.device:
    """In a spawned process: its device, and the default process group joined."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":  # one process per local GPU, each on its own device
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:  # gloo: one thread per process, as shardwise bench runs each CPU rank
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, device_id=device if device.type == "cuda" else None)
    return device


def run_spawned(target, backend: str, world: int, args: tuple, timeout: float = 600.0):
    """Run ``target(rank, world, port, backend, *args, out)`` in ``world`` spawned processes; returns what rank 0
    puts on ``out``. A process that dies fails the call at once, one that hangs after ``timeout`` seconds."""
    import torch.multiprocessing as mp

    from ..launch import free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, backend, *args, out)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return out.get(timeout=5)
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    raise RuntimeError(f"calibration: the {backend} processes " + (
                        f"exited with {failed}" if failed else f"gave no result in {timeout:.0f} s")) from None
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
