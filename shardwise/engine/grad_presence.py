"""Which parameters of a group get a ``.grad``: those that received a gradient, on some rank, in the window.

FSDP2 gives a parameter whose unsharded gradient is ``None`` no sharded
gradient: it leaves ``.grad`` as it was (``None`` after ``zero_grad``), so
AdamW's weight decay and momentum leave an unused parameter alone. The engine
reduces a group as one flat buffer (an unused parameter's slot as zeros, so
every rank runs the same collectives whatever each one used) and hands out
``.grad`` by this rule instead:

- a parameter gets ``.grad`` when it received a gradient in the window (any
  micro-batch since the last installation) on *some* rank of the group's
  data-parallel axes. The ranks agree through one small ``MAX`` all-reduce of
  the flags per group and step, at the window's end. (FSDP2 decides per rank
  and reduce-scatters only the parameters with a gradient, so ranks that
  disagree run collectives of different sizes: a hang or a wrong sum; with
  the agreement every rank installs the same set, and the values are the
  mean with the non-users' zeros, what ``set_reduce_scatter_unused_params(True)``
  reduces in FSDP2.)
- ``install_all`` (FSDP2's ``set_reduce_scatter_unused_params(True)``,
  graph-safe mode whose captured step writes the same tensors every replay, and
  the Megatron face, whose optimizer reads every parameter's gradient buffer):
  every parameter gets ``.grad``, zeros where nothing was used; no collective.

A rank reads the agreed flags (a host sync on a GPU) only where it did not use
every parameter itself: a rank that used them all installs them all.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["GradPresence"]


class GradPresence:
    """The flags of one group's window: ``used`` on this rank, then agreed over ``axes`` at the window's end."""

    def __init__(self, size: int):
        self.size = size
        self.install_all = False
        self.used: list[bool] = [False] * size
        self._agreed: torch.Tensor | None = None  # the MAX over the axes, while in flight

    def reset(self) -> None:
        """A new window: nothing used yet."""
        self.used = [False] * self.size
        self._agreed = None

    def note(self, used: Sequence[bool]) -> None:
        """Parameters that brought a gradient into the window (this rank)."""
        self.used = [a or bool(b) for a, b in zip(self.used, used)]

    def agree(self, axes: Sequence, device: torch.device) -> None:
        """Start the agreement over the data-parallel ``axes`` (on the current stream; those of one rank are
        skipped). Every rank of the axes calls it at the same point: the window's end."""
        axes = [a for a in axes if a.size > 1]
        if self.install_all or not axes:
            return
        if all(self.used):  # a fill on the device: no copy from the host, so no wait for the stream
            flags = torch.ones(self.size, dtype=torch.int32, device=device)
        else:  # from page-locked memory: a copy from pageable memory would make the host wait for the stream
            host = torch.tensor(self.used, dtype=torch.int32)
            flags = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
        for axis in axes:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=axis.group)
        self._agreed = flags

    def present(self) -> list[bool]:
        """Which parameters get ``.grad`` at this window's installation."""
        agreed, self._agreed = self._agreed, None
        if self.install_all:
            return [True] * self.size
        if agreed is None or all(self.used):
            return list(self.used)
        return [bool(v) for v in agreed.tolist()]
