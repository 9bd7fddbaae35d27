"""Counting host synchronisations in a step, on any device (a CUDA graph capture fails on any).

``count_host_syncs()`` watches the ATen ops that, on a GPU, make the host wait for the device:
reading a value (``.item()``, ``bool(t)``, ``tolist``: ``aten._local_scalar_dense`` / ``is_nonzero``),
ops whose output size depends on values (``nonzero``, ``masked_select``, ``unique``...), and copies
from a device to the host. It works on the CPU too, where none of them waits, so a test on gloo
can hold a step to "no host synchronisation" before anyone captures it on a GPU. On CUDA,
``torch.cuda.set_sync_debug_mode("error")`` is torch's own check (it sees synchronising CUDA API
calls, not ops); the two complement each other.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["count_host_syncs", "HostSyncs"]

_READS_VALUES = {"_local_scalar_dense", "is_nonzero", "item", "equal", "allclose"}
_DATA_DEPENDENT_SIZE = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                        "unique_dim", "bincount", "repeat_interleave", "nonzero_static"}
_COPIES = {"_to_copy", "copy_", "to", "_copy_from"}


def _off_device(name: str, args, kwargs) -> bool:
    """Whether a copy op moves a device tensor to the host."""
    tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
    if not tensors:
        return False
    if name in ("copy_", "_copy_from"):  # copy_(dst, src); _copy_from(src, dst)
        if name == "_copy_from":
            tensors = tensors[::-1]
        return len(tensors) >= 2 and tensors[0].device.type == "cpu" and tensors[1].device.type != "cpu"
    target = kwargs.get("device")
    return target is not None and torch.device(target).type == "cpu" and tensors[0].device.type not in ("cpu", "meta")


class HostSyncs(TorchDispatchMode):
    """The ops seen that synchronise a GPU's host (``events``: op names, in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    @property
    def count(self) -> int:
        return len(self.events)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if name in _READS_VALUES or name in _DATA_DEPENDENT_SIZE:
            self.events.append(name)
        elif name in _COPIES and _off_device(name, args, kwargs):
            self.events.append(f"{name} to the host")
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """``with count_host_syncs() as syncs: step()``; then ``syncs.count`` / ``syncs.events``."""
    mode = HostSyncs()
    with mode:
        yield mode
