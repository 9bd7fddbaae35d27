"""FSDP2's ``set_allocate_memory_from_process_group_for_comm``: a unit's buffers from its process groups' memory.

FSDP2 takes a unit's collective buffers from the process group's backend where it
can allocate tensors (``supports_tensor_alloc``): on NCCL that is memory NCCL
allocated and registered with its communicator, which its zero-copy and SHARP
collectives need; elsewhere (gloo) plain ``torch.empty``, so nothing changes.

Every device buffer of an engine group is allocated inside its
``Collectives.buffers()`` (``Levels.new`` / ``take``, ``DistributedBuffer.alloc``),
so the switch is the group's collectives: :func:`comm_collectives` gives a
:class:`ProcessGroupAlloc` (the default collectives over ``NcclUserBuffers``' pool
of ``ncclMemAlloc`` memory, registered plainly: what ``ProcessGroupNCCL.allocate_tensor``
hands out) where every data-parallel group the buffers travel over allocates tensors,
and the default ``Collectives`` elsewhere. Values never change; only where bytes live.

One pool per device and set of groups in the process, shared by the units that ask
(``ProcessGroupNCCL`` keeps one per group): a pool per unit would cache each unit's
freed gathered weights apart from the next unit's. The first ask makes it, with one
tiny all-reduce per group (a pool registers only with an existing communicator), so
every rank must call at the same point, as FSDP2's clients do.

Differences from FSDP2: every buffer the group makes after the call comes from the
pool (gathered weights, staging, gradients: FSDP2's staging buffers and the gradients
viewing its reduce-scatter output, plus the engine's intermediate levels); buffers made
before (the main weights) stay put. The pool is registered with every data-parallel
group (HSDP's replicas too) where FSDP2 uses one group's; axes of one rank move nothing
and are left out. A backend that allocates but has no NCCL pool keeps the default, with
one warning. NCCL itself needs GPUs: the CPU tests run this against a fake backend.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Sequence

import torch
import torch.distributed as dist

from .collectives import Collectives
from .nccl_buffers import NcclUserBuffers, unwrapped_backend

__all__ = ["ProcessGroupAlloc", "comm_collectives", "refuse_custom"]


class ProcessGroupAlloc(NcclUserBuffers):
    """The default collectives over a pool of the process groups' NCCL memory, registered plainly with each group
    now (FSDP2's allocation from the process group, as ``fully_shard``'s units get it from
    ``set_allocate_memory_from_process_group_for_comm(True)``)."""

    def __init__(self, groups: Sequence[dist.ProcessGroup], device: torch.device):
        super().__init__(groups, register_now=True, symmetric=False, device=device)


# (device, ids of the groups) -> (weak references to the groups, their pool): one per set of live groups
_POOLS: dict[tuple, tuple[list, ProcessGroupAlloc]] = {}
_WARNED: set[str] = set()


def refuse_custom(method: str, current: Collectives) -> None:
    """``AssertionError`` naming ``method`` where ``current`` is a user's own collectives (not the default class nor
    one made here): they choose their buffers themselves, as FSDP2 refuses a custom all-gather or reduce-scatter."""
    if type(current) not in (Collectives, ProcessGroupAlloc):
        raise AssertionError(
            f"cannot call {method}() on a unit whose collectives are custom: {type(current).__name__} (passed as "
            "fully_shard(collectives=...)) decides where its buffers come from in its buffers()")


def comm_collectives(current: Collectives, enable: bool, groups: Sequence[dist.ProcessGroup],
                     device: torch.device) -> Collectives:
    """What a parameter group's collectives (``current``, checked by :func:`refuse_custom`) become: with ``enable``
    a :class:`ProcessGroupAlloc` over ``groups`` (the process groups they run over) where each backend allocates
    tensors on ``device``, else the default collectives."""
    default = current if type(current) is Collectives else Collectives()
    if not enable or not groups or not all(_allocates(group, device) for group in groups):
        return default
    pool = _pool(groups, device)
    return default if pool is None else pool


def _allocates(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group``'s backend allocates its own tensors on ``device`` (FSDP2's test)."""
    return bool(unwrapped_backend(group, device).supports_tensor_alloc(device))


def _pool(groups: Sequence[dist.ProcessGroup], device: torch.device) -> ProcessGroupAlloc | None:
    """The process's pool over ``groups`` on ``device``, made at the first ask; ``None`` (with one warning) where a
    backend allocates tensors but has no memory pool to register (only NCCL's has)."""
    for key in [k for k, (refs, _) in _POOLS.items() if any(ref() is None for ref in refs)]:
        del _POOLS[key]  # groups destroyed since: their pool goes with them
    key = (str(device), tuple(sorted({id(g) for g in groups})))
    made = _POOLS.get(key)
    if made is not None:
        return made[1]
    backends = [unwrapped_backend(group, device) for group in groups]
    odd = [type(b).__name__ for b in backends if not hasattr(b, "register_mem_pool")]
    if odd:
        name = odd[0]
        if name not in _WARNED:
            _WARNED.add(name)
            warnings.warn(f"set_allocate_memory_from_process_group_for_comm(True): the {name} backend allocates "
                          "tensors but has no memory pool to register, which the engine's buffers need (NCCL's "
                          "has); its units keep PyTorch's allocator (the values are the same)", stacklevel=3)
        return None
    pool = ProcessGroupAlloc(groups, device)
    _POOLS[key] = ([weakref.ref(g) for g in pool.groups], pool)  # pool.groups: each group once
    return pool
