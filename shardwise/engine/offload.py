"""Main weights and optimizer state in host memory: which groups, and the host buffers.

An offloaded group keeps its main weights (and so the optimizer state the
optimizer creates beside them) and its finished gradient shard in host memory;
the GPU keeps only the compute-dtype weight shard. Gradients stream to the host
as each group's reduction finishes, the optimizer steps on the CPU, and the
updated shard streams back before the group's next gather.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

__all__ = ["OffloadPolicy", "HostMemory", "choose_offloaded"]


@dataclass(frozen=True)
class OffloadPolicy:
    """Which units keep their main weights and optimizer state on the host.

    fraction: share of the model's parameters to offload, taken unit by unit in
        ``unit_modules`` order (then the root); 1.0 offloads everything, 0.5
        keeps the later half of the units on the GPU (faster, more memory).
    units: the unit modules (or their names) to offload instead of a fraction.
    pin_memory: page-locked host buffers, so copies overlap with compute (CUDA).

    One of ``fraction`` and ``units`` is required: a bare ``OffloadPolicy()``
    is refused, because torch's ``OffloadPolicy()`` means no offload (its
    ``CPUOffloadPolicy()`` offloads), so either reading of it would surprise
    someone. No offload is ``offload_policy=None``.
    """

    fraction: float | None = None
    units: Sequence[nn.Module | str] | None = None
    pin_memory: bool = True

    def __post_init__(self):
        if self.fraction is None and self.units is None:
            raise TypeError(
                "shardwise.OffloadPolicy() needs fraction= or units=: fraction=1.0 offloads everything (torch's "
                "CPUOffloadPolicy()), units=[...] the units named; for no offload (torch's OffloadPolicy()) pass "
                "offload_policy=None")
        if self.fraction is not None and self.units is not None:
            raise TypeError("shardwise.OffloadPolicy: give fraction= or units=, not both")
        f = self.fraction if self.units is None else 0.0
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
            raise ValueError(f"OffloadPolicy.fraction={f!r} must be a number in [0, 1]")
        if self.units is not None and (isinstance(self.units, (str, nn.Module)) or not hasattr(self.units, "__iter__")):
            raise TypeError(f"OffloadPolicy.units={self.units!r} must be a list of unit modules or their names")


class HostMemory:
    """The host buffers of one offloaded group, page-locked in place while the group lives.

    torch's pinned allocator rounds every allocation up to a power of two (a
    1.1 GB buffer takes 2 GB: +50% host memory measured at 2.8B parameters),
    so buffers are ordinary allocations registered with CUDA instead. They are
    held here until the group goes, and unregistered before they are freed.
    """

    def __init__(self, pin: bool):
        self.pin = pin and torch.cuda.is_available()
        self._held: list[torch.Tensor] = []
        self._pointers: list[int] = []
        weakref.finalize(self, _unpin, self._pointers)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(numel, dtype=dtype, device="cpu")
        if self.pin and numel:
            status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), numel * buffer.element_size(), 0)
            if int(status) == 0:  # else it stays pageable: copies are only slower
                self._pointers.append(buffer.data_ptr())
                self._held.append(buffer)
        return buffer


def _unpin(pointers: list[int]) -> None:
    for ptr in pointers:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def choose_offloaded(policy: OffloadPolicy | None, units: list[tuple[str, nn.Module, int]]) -> set[int]:
    """ids of the modules whose groups are offloaded, from ``(name, module, parameter count)`` in order.

    ``units`` lists the unit modules in ``unit_modules`` order and the root last.
    """
    if policy is None:
        return set()
    if policy.units is not None:
        by_name = {name: module for name, module, _ in units}
        chosen = set()
        for unit in policy.units:
            if isinstance(unit, str):
                if unit not in by_name:
                    raise ValueError(f"OffloadPolicy.units: {unit!r} is not a unit; units are {sorted(by_name)[:8]}")
                chosen.add(id(by_name[unit]))
            elif any(unit is module for _, module, _ in units):
                chosen.add(id(unit))
            else:
                raise ValueError(f"OffloadPolicy.units: {type(unit).__name__} module is not one of the wrapped units")
        return chosen
    total = sum(count for _, _, count in units)
    chosen, taken = set(), 0
    for _, module, count in units:
        if taken >= policy.fraction * total - 1e-9 * total:
            break
        chosen.add(id(module))
        taken += count
    return chosen
