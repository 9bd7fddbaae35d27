"""Which parameters of a group get a ``.grad``: those that received a gradient, on some rank, in the window.

FSDP2 gives a parameter whose unsharded gradient is ``None`` no sharded
gradient: it leaves ``.grad`` as it was (``None`` after ``zero_grad``), so
AdamW's weight decay and momentum leave an unused parameter alone. The engine
reduces a group as one flat buffer (an unused parameter's slot as zeros, so
every rank runs the same collectives whatever each one used) and hands out
``.grad`` by this rule instead:

- a parameter gets ``.grad`` when it received a gradient in the window (any
  micro-batch since the last installation) on this rank, or on some other rank
  of the group's data-parallel axes. No collective says which: a rank that used
  every parameter installs them all; one that did not use a parameter looks at
  this rank's rows of its reduced gradient (one host read, only then): rows
  that are not all zero mean another rank used it, so it installs it too, as
  that rank does. (FSDP2 decides per rank and reduce-scatters only the
  parameters with a gradient, so ranks that disagree run collectives of
  different sizes: a hang or a wrong sum. Here every rank reduces the whole
  group, and the values are the mean with the non-users' zeros, what
  ``set_reduce_scatter_unused_params(True)`` reduces in FSDP2.) What this
  cannot see: another rank's gradient that is exactly zero on all of this
  rank's rows, or a rank holding no rows of the parameter; there the ranks
  may differ on a ``.grad`` whose values here are zeros.
- ``install_all`` (FSDP2's ``set_reduce_scatter_unused_params(True)``,
  graph-safe mode whose captured step writes the same tensors every replay, and
  the Megatron face, whose optimizer reads every parameter's gradient buffer):
  every parameter gets ``.grad``, zeros where nothing was used.
- a matrix owned by another rank (``owner_layout``: ``elsewhere``) never gets ``.grad`` here, whatever the
  above says: this rank holds none of it, so an optimizer skips it here (torch's optimizers pass over a
  parameter without ``.grad``) and only its owner does its arithmetic.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["GradPresence"]


class GradPresence:
    """The flags of one group's window: ``used`` on this rank; ``shared``: whether the group's gradients are
    reduced over more than one rank (else ``used`` is the whole answer)."""

    def __init__(self, size: int, elsewhere: Sequence[bool] = ()):
        self.size = size
        self.elsewhere = list(elsewhere) or [False] * size  # owned by another rank: never a .grad here
        self.install_all = False
        self.shared = False
        self.used: list[bool] = [False] * size

    def reset(self) -> None:
        """A new window: nothing used yet."""
        self.used = [False] * self.size

    def note(self, used: Sequence[bool]) -> None:
        """Parameters that brought a gradient into the window (this rank)."""
        self.used = [a or bool(b) for a, b in zip(self.used, used)]

    def reduced_over(self, axes: Sequence) -> None:
        """The data-parallel ``axes`` the window's gradients were reduced over (at its end)."""
        self.shared = any(a.size > 1 for a in axes)

    def present(self, reduced: Sequence[torch.Tensor]) -> list[bool]:
        """Which parameters get ``.grad`` at this window's installation; ``reduced``: this rank's rows of each
        parameter's reduced gradient."""
        return [p and not e for p, e in zip(self._present(reduced), self.elsewhere)]

    def _present(self, reduced: Sequence[torch.Tensor]) -> list[bool]:
        if self.install_all or all(self.used):
            return [True] * self.size
        if not self.shared:
            return list(self.used)
        unused = [i for i, u in enumerate(self.used) if not u]
        seen = [reduced[i].ne(0).any() if reduced[i].numel() else torch.zeros((), dtype=torch.bool,
                                                                               device=reduced[i].device)
                for i in unused]
        out = list(self.used)
        for i, nonzero in zip(unused, torch.stack(seen).tolist()):  # one host read
            out[i] = bool(nonzero)
        return out
