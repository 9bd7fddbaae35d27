"""Start one worker process per rank on this machine (what ``torchrun`` would do)."""

from __future__ import annotations

import os
import socket
import sys
from typing import Callable

__all__ = ["free_port", "launch_local", "under_launcher"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_launcher() -> bool:
    """True when torchrun (or another launcher) already set this process's rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _worker(local_rank: int, world: int, port: int, fn: Callable, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(local_rank),
                      LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    fn(*args)


def launch_local(fn: Callable, world: int, args: tuple, prog: str) -> int:
    """Run ``fn(*args)`` in ``world`` spawned processes with the env torchrun sets; an exit code."""
    import torch.multiprocessing as mp

    try:
        mp.start_processes(_worker, args=(world, free_port(), fn, args), nprocs=world, start_method="spawn")
    except mp.ProcessRaisedException as e:
        print(f"{prog}: a worker failed:\n{e}", file=sys.stderr)
        return 1
    except mp.ProcessExitedException as e:
        print(f"{prog}: a worker exited: {e}", file=sys.stderr)
        return 1
    return 0
