"""Whole matrices on one owner rank: the layout Muon's per-matrix Newton-Schulz step needs.

``shard_placement_fn`` returning :class:`Owned` for a 2-D parameter asks for it:
instead of ``torch.chunk`` rows on every rank of the shard axis, the whole
matrix lives in the optimizer shard of one rank (its owner) and nowhere else,
so an optimizer that needs the whole matrix (Muon's orthogonalisation) runs on
exactly one rank, once, with no extra collective: the reduce-scatter brings the
owner the reduced gradient and the next all-gather takes the updated weights
to every rank, as for any other parameter.

Owners are picked greedily (largest first, onto the rank with the least work
so far, counted over every group of the call) by Newton-Schulz FLOPs, ties by
bytes, so no rank does much more than its share of either.

The DTensor face: the owner's matrix is ``Replicate()`` on a one-rank mesh of
the owner (``owner_mesh``). torch's DTensor treats a rank outside a tensor's
mesh as not taking part: every op there is a no-op on an empty local tensor,
so ``torch.optim.Muon`` over such parameters runs unchanged, doing its
arithmetic on the owner only and nothing elsewhere, with no collective. State
dicts convert them to ``Shard(0)`` over the data-parallel mesh (``owner_state``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["Owned", "is_owned", "ns_flops", "OwnerBalancer", "owner_mesh", "NS_STEPS", "OWNER_SUM_GROUP"]

NS_STEPS = 5  # torch.optim.Muon's default ns_steps
# Set on an owned sharded parameter: the process group whose ranks' local tensors together are the matrix (the
# owner's whole, the others' empty), over which a norm of its gradient sums (``clip_grad_norm_``).
OWNER_SUM_GROUP = "_shardwise_owner_sum_group"


@dataclass(frozen=True)
class Owned:
    """``shard_placement_fn``'s answer for a parameter laid out whole on one owner rank (2-D parameters only)."""

    def __repr__(self) -> str:
        return "Owned()"


def is_owned(answer) -> bool:
    return isinstance(answer, Owned)


def ns_flops(shape: Sequence[int], steps: int = NS_STEPS) -> int:
    """Floating-point operations of ``steps`` quintic Newton-Schulz iterations on a matrix of ``shape``
    (torch.optim.Muon's: with ``m <= n`` after the transpose, per step ``X X^T`` (2 m^2 n), ``A A``
    (2 m^3) and ``B X`` (2 m^2 n))."""
    m, n = sorted(shape[:2])
    return steps * (4 * m * m * n + 2 * m ** 3)


@dataclass
class OwnerBalancer:
    """Running per-rank totals of one ``fully_shard`` call's owned matrices, by shard axis size."""

    flops: dict[int, list[int]] = field(default_factory=dict)
    numels: dict[int, list[int]] = field(default_factory=dict)

    def assign(self, shapes: Sequence[torch.Size], ranks: int) -> list[int]:
        """An owner (a coordinate on the shard axis) for each shape, largest first onto the least loaded rank."""
        flops = self.flops.setdefault(ranks, [0] * ranks)
        numels = self.numels.setdefault(ranks, [0] * ranks)
        owners = [0] * len(shapes)
        order = sorted(range(len(shapes)), key=lambda i: (-ns_flops(shapes[i]), -math.prod(shapes[i]), i))
        for i in order:
            r = min(range(ranks), key=lambda k: (flops[k], numels[k], k))
            owners[i] = r
            flops[r] += ns_flops(shapes[i])
            numels[r] += math.prod(shapes[i])
        return owners


_MESHES: dict[tuple[str, int], DeviceMesh] = {}


def owner_mesh(device_type: str, global_rank: int) -> DeviceMesh:
    """The one-rank mesh of ``global_rank`` (made once per process, with no process group: a DTensor
    replicated over one rank never communicates)."""
    key = (device_type, global_rank)
    mesh = _MESHES.get(key)
    if mesh is None:
        mesh = _MESHES[key] = DeviceMesh(device_type, [global_rank], _init_backend=False)
    return mesh
