"""NCCL user buffers: a group's device buffers from one memory pool registered with NCCL.

NCCL reads and writes a registered buffer in place, which lets it pick its
zero-copy and NVLink SHARP / symmetric-memory kernels: collectives that take
fewer SMs away from the compute they overlap (Megatron-FSDP's ``nccl_ub``). With
PyTorch's own API:

- ``ProcessGroupNCCL.mem_allocator``: an allocator over ``ncclMemAlloc`` / ``ncclMemFree``;
- ``torch.cuda.MemPool(allocator)``: a pool of the caching allocator that takes its
  segments from it; ``torch.cuda.use_mem_pool(pool)``: allocations of this thread go there;
- ``ProcessGroupNCCL.register_mem_pool(pool, symm=...)``: registers the pool's segments
  with that group's communicator; PyTorch's allocator hook registers the segments the
  pool grows by afterwards.

:class:`NcclUserBuffers` is a :class:`Collectives` whose ``buffers()`` is that pool,
so every device buffer a group allocates (``distributed_buffer.Levels.new`` / ``take``
and ``DistributedBuffer.alloc``) comes from it; the collectives themselves are the
default ones. Pass it as ``fully_shard(collectives=NcclUserBuffers(groups))`` with
the NCCL groups the model's collectives run over. NCCL only (a CUDA build of PyTorch):
on another backend there is nothing to register and the caller keeps the default
``Collectives``. The values are the same either way; only where the bytes live differs.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import torch.distributed as dist

from .collectives import Collectives

__all__ = ["NcclUserBuffers", "unwrapped_backend"]


def unwrapped_backend(group: dist.ProcessGroup, device: torch.device):
    """``group``'s backend on ``device``, inside the checking wrapper ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` puts
    around it (the wrapper has no memory-pool methods of its own)."""
    backend = group._get_backend(device)
    return getattr(backend, "wrapped_pg", backend)


class NcclUserBuffers(Collectives):
    """The default collectives, over buffers allocated from one ``torch.cuda.MemPool`` of NCCL memory.

    ``groups``: the NCCL process groups the buffers travel over (each data-parallel axis of the
    model's meshes); the pool is registered with each. ``register_now``: register at once (the
    group's communicator is created first, one tiny all-reduce each, since PyTorch registers only
    with an existing communicator); ``False`` leaves it to :meth:`register`, after a warm-up step
    has allocated the buffers (Megatron-FSDP's ``fsdp_manual_registration``). ``symmetric``: NCCL
    window (symmetric) registration, Megatron-FSDP's default, instead of plain user-buffer
    registration. ``device``: the groups' device (the current CUDA device by default).
    """

    def __init__(self, groups: Sequence[dist.ProcessGroup], *, register_now: bool = True, symmetric: bool = True,
                 device: torch.device | None = None):
        unique = list({id(g): g for g in groups}.values())
        if not unique:
            raise ValueError("NcclUserBuffers needs at least one NCCL process group to register its pool with")
        self.device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.groups = unique
        self.symmetric = symmetric
        self._backends = [unwrapped_backend(group, self.device) for group in unique]
        self.pool = torch.cuda.MemPool(self._backends[0].mem_allocator)
        self.registered = False
        if register_now:
            self.register()

    def buffers(self) -> contextlib.AbstractContextManager:
        return torch.cuda.use_mem_pool(self.pool)

    def register(self) -> None:
        """Register the pool with every group's NCCL communicator (once; a second call is a ``RuntimeError``).

        A collective over each group, in the order given: every rank of the model calls it at the same point.
        """
        if self.registered:
            raise RuntimeError("NcclUserBuffers.register(): the pool is already registered with its groups")
        for group, backend in zip(self.groups, self._backends):
            dist.all_reduce(torch.zeros(1, device=self.device), group=group)  # the communicator exists
            if self.symmetric:
                backend.register_mem_pool(self.pool, symm=True)
            else:
                backend.register_mem_pool(self.pool)
        self.registered = True
