"""Gradients a unit keeps unsharded between reductions, accumulated in the reduction's dtype, as FSDP2 does.

With ``set_requires_gradient_sync(False)`` (or a post-backward that does not
reduce: a unit whose forward ran again before this backward, a chunked loss's
head between its chunks) the gathered parameters' gradients wait for a later
reduction. Autograd would add each backward's gradient into ``.grad`` in the
compute dtype (bf16). FSDP2 instead moves the gradient, at each post-backward
that does not reduce, into an accumulator of ``reduce_dtype`` (its
``unsharded_accumulated_grad``: ``grad.to(reduce_dtype)`` the first time, ``+=``
after) and reduces that accumulator plus the last backward's gradient. This does
the same into one flat level-0 buffer of the group's comm dtype (the reduction's
input), so the sums are FSDP2's to the bit. Where the gradients already have the
comm dtype (fp32 throughout, or ``reduce_dtype`` equal to ``param_dtype``) autograd's
own accumulation in ``.grad`` is FSDP2's too, and nothing moves.

Memory: while gradients wait, the group holds its unsharded gradients in the
comm dtype (fp32: twice a bf16 ``.grad``), as FSDP2 does.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .distributed_buffer import DistributedBuffer

__all__ = ["UnsyncedGrads"]


class UnsyncedGrads:
    """One group's waiting gradients: ``buffer`` (level 0, comm dtype; ``None`` when nothing waits) and
    ``held`` (the parameters that put something in it)."""

    def __init__(self):
        self.buffer: DistributedBuffer | None = None
        self.held: list[bool] = []

    @property
    def waiting(self) -> bool:
        return self.buffer is not None

    def stash(self, params: Sequence[torch.nn.Parameter], comm_dtype: torch.dtype, new_buffer) -> None:
        """Move every gradient of ``params`` not of ``comm_dtype`` into the buffer (made by ``new_buffer()``, an
        ``EMPTY`` level-0 buffer of that dtype, at the first stash) and drop it from ``.grad``."""
        grads = [p.grad for p in params]
        moving = [g is not None and g.dtype != comm_dtype for g in grads]
        if not any(moving):
            return
        if self.buffer is None:
            self.buffer = new_buffer()
            self.buffer.load([g if m else None for g, m in zip(grads, moving)])  # zeros elsewhere
            self.held = moving
        else:
            self.add([g if m else None for g, m in zip(grads, moving)])
            self.held = [a or b for a, b in zip(self.held, moving)]
        for param, m in zip(params, moving):
            if m:
                param.grad = None

    def add(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Add each gradient (in its own dtype, promoted) into its slot of the buffer."""
        pairs = [(self.buffer.local(i), g) for i, g in enumerate(grads) if g is not None]
        for slot, grad in pairs:  # one add per parameter: FSDP2's ``+=``, so the same roundings
            slot.add_(grad)

    def take(self, grads: Sequence[torch.Tensor | None]) -> tuple[DistributedBuffer, list[bool]]:
        """The buffer with the last backward's ``grads`` added (the reduction's input), and who put something in
        it before them; nothing waits afterwards."""
        self.add(grads)
        buffer, held = self.buffer, self.held
        self.drop()
        return buffer, held

    def drop(self) -> None:
        self.buffer, self.held = None, []
