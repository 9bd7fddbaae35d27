"""Run a test body on N gloo processes, reusing a pool of live workers.

Spawning and importing torch costs seconds per process on a 2-core CI
machine, so each world size keeps one pool of processes with the gloo group
already initialized; a test sends a module-level function and gets back what
every rank returned. A failure on any rank (or a timeout, which means some
rank hung in a collective) tears the pool down so the next test starts
clean.
"""

from __future__ import annotations

import atexit
import os
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

from shardwise.app.launch import free_port

TASK_TIMEOUT_S = float(os.environ.get("SHARDWISE_TEST_TIMEOUT", "240"))
# SHARDWISE_TEST_BACKEND=nccl runs the same tests on GPUs (one process per GPU).
BACKEND = os.environ.get("SHARDWISE_TEST_BACKEND", "gloo")
_POOLS: dict[int, "_WorkerPool"] = {}
# In a worker: the process groups that outlive a cleanup (see destroy_groups_made_since_mark).
_MARKED_GROUPS: set = set()


def _worker_main(rank: int, world_size: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    if BACKEND == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        BACKEND, rank=rank, world_size=world_size, timeout=timedelta(seconds=TASK_TIMEOUT_S / 2)
    )
    mark_groups()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion errors
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class _WorkerPool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.task_queues = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, self.task_queues[rank], self.results),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, args, kwargs):
        for q in self.task_queues:
            q.put((fn, args, kwargs))
        outcomes = {}
        import queue

        try:
            while len(outcomes) < self.world_size:
                rank, ok, value = self.results.get(timeout=TASK_TIMEOUT_S)
                outcomes[rank] = (ok, value)
                if not ok:
                    break  # other ranks may now be stuck in a collective
        except queue.Empty:
            missing = sorted(set(range(self.world_size)) - set(outcomes))
            raise TimeoutError(f"ranks {missing} did not finish {fn.__name__} in {TASK_TIMEOUT_S}s")
        failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
        if failures:
            raise AssertionError(
                "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
            )
        return [outcomes[r][1] for r in range(self.world_size)]

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self.task_queues:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


def mark_groups() -> None:
    """In a worker: remember the process groups alive now; a later cleanup keeps them."""
    from torch.distributed import distributed_c10d

    _MARKED_GROUPS.clear()
    _MARKED_GROUPS.update(distributed_c10d._world.pg_map)


def destroy_groups_made_since_mark(max_threads: int, settle_s: float = 10.0) -> int:
    """In a worker: destroy every process group made since :func:`mark_groups`; the worker's thread count after
    (waited for, up to ``settle_s``, to fall to ``max_threads``).

    Megatron-Core's ``destroy_model_parallel`` drops its dozens of groups (gloo copies included) without
    destroying them, so their threads would live as long as the worker. Destroying them by hand (and
    forgetting them in shardwise's group cache, so the next test makes fresh ones on every rank alike)
    lets the pool outlive a Megatron test file instead of paying a fresh start of every worker.
    """
    import gc
    import sys

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    made = [pg for pg in list(distributed_c10d._world.pg_map) if pg not in _MARKED_GROUPS]
    for pg in made:
        dist.destroy_process_group(pg)
    cached = getattr(sys.modules.get("shardwise.megatron.process_groups"), "_GROUP_CACHE", {})
    for key in [key for key, pg in cached.items() if any(pg is m for m in made)]:
        del cached[key]
    del made  # the last references: the groups' threads end with them
    try:  # DTensor's sharding-propagation cache keeps meshes, and they their groups
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
    except ImportError:
        pass
    gc.collect()
    mark_groups()
    # a shut-down group's threads end a moment later: wait for them (a bounded while)
    deadline = time.monotonic() + settle_s
    while _thread_count() > max_threads and time.monotonic() < deadline:
        time.sleep(0.05)
    return _thread_count()


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def live_pools() -> list[int]:
    """World sizes of the pools whose workers are all alive."""
    return [n for n, pool in _POOLS.items() if all(p.is_alive() for p in pool.procs)]


def close_pool(world_size: int) -> None:
    """Stop the pool of this world size (the next test of that size starts a fresh one)."""
    pool = _POOLS.pop(world_size, None)
    if pool is not None:
        pool.close()


def device() -> "torch.device":
    """The device a test body should put its tensors on (inside a worker)."""
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if BACKEND == "nccl" else torch.device("cpu")


def run_distributed(fn, world_size: int, *args, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a gloo group; return per-rank results."""
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close(graceful=False)
        pool = _POOLS[world_size] = _WorkerPool(world_size)
    try:
        return pool.run(fn, args, kwargs)
    except BaseException:
        pool.close(graceful=False)
        del _POOLS[world_size]
        raise


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()
