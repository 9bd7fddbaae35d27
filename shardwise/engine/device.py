"""Where a process group's tensors live: the one device rule every module asks.

``device_for(x)`` answers with the device the collectives of ``x`` run on, so
the engine's buffers, meta-materialized parameters, meshes and the
application's model all land on the same device:

- a ``DeviceMesh``: its device type (DTensor keeps its local tensors there);
  ``cuda`` means this process's current CUDA device;
- a ``ProcessGroup`` or a backend name (``"nccl"``, ``"gloo"``,
  ``"cpu:gloo,cuda:nccl"``): NCCL means the current CUDA device; any other
  backend (gloo) means the CPU, whatever hardware is present: a gloo run on a
  CUDA host keeps everything on the CPU;
- nothing (``None``): the default process group's backend when one is
  initialized; with no process group yet (one process, no distributed), the
  current CUDA device where CUDA is available, else the CPU.
"""

from __future__ import annotations

from typing import Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["device_for"]

DeviceSource = Union[DeviceMesh, "dist.ProcessGroup", str, None]


def _cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _for_backend(backend: str) -> torch.device:
    return _cuda() if "nccl" in str(backend).lower() else torch.device("cpu")


def device_for(source: DeviceSource = None) -> torch.device:
    """The ``torch.device`` the collectives of ``source`` (a mesh, a process group, a backend name,
    or ``None`` for the default process group) run on; see the module docstring for the rules."""
    if isinstance(source, DeviceMesh):
        return _cuda() if source.device_type == "cuda" else torch.device(source.device_type)
    if isinstance(source, str):
        return _for_backend(source)
    if isinstance(source, dist.ProcessGroup):
        return _for_backend(dist.get_backend(source))
    if source is not None:
        raise TypeError(f"device_for takes a DeviceMesh, a ProcessGroup, a backend name or None, got {type(source).__name__}")
    if dist.is_available() and dist.is_initialized():
        return _for_backend(dist.get_backend())
    return _cuda() if torch.cuda.is_available() else torch.device("cpu")
