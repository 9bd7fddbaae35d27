"""Run a test body on N gloo processes, reusing a pool of live workers.

Starting a process and importing torch costs seconds on a 2-core CI
machine, so each world size keeps one pool of processes with the gloo group
already initialized (and the processes fork from a server that imported
torch, shardwise and Megatron-Core once); a test sends a module-level function and gets back what
every rank returned. A failure on any rank (or a timeout, which means some
rank hung in a collective) tears the pool down so the next test starts
clean.
"""

from __future__ import annotations

import atexit
import os
import queue
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

from shardwise.app.launch import free_port

TASK_TIMEOUT_S = float(os.environ.get("SHARDWISE_TEST_TIMEOUT", "240"))
# SHARDWISE_TEST_BACKEND=nccl runs the same tests on GPUs (one process per GPU).
BACKEND = os.environ.get("SHARDWISE_TEST_BACKEND", "gloo")
_POOLS: dict[int, "_WorkerPool"] = {}
# How often a test waiting for its ranks checks that none of them died (one that cannot unpickle the task,
# or that exits, would otherwise cost the whole TASK_TIMEOUT_S), and an idle worker that the test process
# is still there (a killed pytest used to leave its workers behind, hundreds of gloo threads each).
_POLL_S = 2.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _worker_main(rank: int, world_size: int, port: int, tasks, results, owner: int) -> None:
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
    while True:
        try:
            task = tasks.get(timeout=_POLL_S)
        except queue.Empty:
            if not _alive(owner):  # the test process was killed: leave, gloo threads and all
                os._exit(0)
            continue
        except (EOFError, OSError):
            raise  # the test process is gone: so is this worker
        except Exception:  # the task did not unpickle (its module changed since?): say so, wait for the next
            results.put((rank, False, traceback.format_exc()))
            continue
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion errors
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


# Workers are forked from one server process (multiprocessing's forkserver) that imported these once: a
# spawned worker is a fresh interpreter importing torch and Megatron-Core, seconds per worker on 2 cores
# (a pool of four importing Megatron-Core took ~13 s to start), and the Megatron files start fresh pools
# per file (tests/megatron/conftest.py). The server imports no more than the pytest process itself has
# imported by then (collection imports every test module); a module missing here is skipped by the
# server and imported by the worker as before. CUDA wants spawned processes: the NCCL runs keep "spawn".
_PRELOAD = [
    "torch", "torch.distributed", "shardwise", "shardwise.models", "shardwise.megatron", "shardwise.app.train",
    "megatron.core", "megatron.core.distributed", "megatron.core.optimizer", "megatron.core.transformer",
    "megatron.core.models.gpt",
]


def process_context():
    """The multiprocessing context the pools start their workers with (tests starting processes of their
    own use it too)."""
    if BACKEND == "nccl":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class _WorkerPool:
    def __init__(self, world_size: int):
        ctx = process_context()
        self.world_size = world_size
        self.results = ctx.Queue()
        self.task_queues = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_worker_main,
                args=(rank, world_size, port, self.task_queues[rank], self.results, os.getpid()),
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
        deadline = time.monotonic() + TASK_TIMEOUT_S
        while len(outcomes) < self.world_size:
            try:  # wake up now and then to notice a worker that died (the others would wait for it)
                rank, ok, value = self.results.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                dead = {r: self.procs[r].exitcode for r in missing if self.procs[r].exitcode is not None}
                if dead:
                    raise RuntimeError(f"ranks {sorted(dead)} exited (exit codes {list(dead.values())}) during "
                                       f"{fn.__name__}; ranks {missing} did not finish it")
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"ranks {missing} did not finish {fn.__name__} in {TASK_TIMEOUT_S}s")
                continue
            outcomes[rank] = (ok, value)
            if not ok:
                break  # other ranks may now be stuck in a collective
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


# Process groups pile up in a worker: a test's DeviceMeshes and Megatron set-ups make them and rarely destroy
# them, and each gloo group keeps 3 threads whose loop wakes 100 times a second. An idle pool of 4 whose workers
# held about 160 groups each took over one of CI's 2 cores. A worker past this many threads (a fresh one has
# about 25) has its pool replaced at the end of a test file (tests/conftest.py): the next file forks a new one.
_CROWDED_THREADS = 64


def _threads(pid: int) -> int:
    """How many threads process ``pid`` runs (0 where ``/proc`` cannot tell: such a pool is kept)."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def close_crowded_pools() -> None:
    """Kill the pools any of whose workers runs more than ``_CROWDED_THREADS`` threads (left-over gloo groups)."""
    for world, pool in list(_POOLS.items()):
        if any(_threads(p.pid) > _CROWDED_THREADS for p in pool.procs if p.pid is not None):
            pool.close(graceful=False)
            del _POOLS[world]


@atexit.register
def _close_pools(graceful: bool = True) -> None:
    for pool in _POOLS.values():
        pool.close(graceful)
    _POOLS.clear()
