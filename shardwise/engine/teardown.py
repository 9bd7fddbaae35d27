"""The end of a training script: process groups destroyed so that their threads end before the interpreter."""

from __future__ import annotations

import contextlib
import gc

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["destroy_process_groups"]


def destroy_process_groups() -> None:
    """Destroy every process group, its threads joined now rather than during interpreter shutdown.

    ``dist.destroy_process_group()`` alone frees nothing here: DTensor's sharding-propagation caches keep
    the DeviceMeshes of every parameter, each mesh keeps its ProcessGroups (``_pg_registry``), and
    the groups keep their threads (gloo's transport loop and workers, the TCPStore server, NCCL's
    watchdog) running into interpreter shutdown, where they race with the process's own teardown
    (the occasional ``terminate called without an active exception`` / SIGABRT after a finished
    run). Dropping those references lets every group's destructor join its threads now. Call it
    instead of ``dist.destroy_process_group()`` at the end of a training script, after the
    model and optimizer are gone (out of scope or ``del``-ed). Without a process group it does nothing.
    """
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    with contextlib.suppress(Exception):
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()
    gc.collect()
    for obj in gc.get_objects():
        if issubclass(type(obj), DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()
    gc.collect()
