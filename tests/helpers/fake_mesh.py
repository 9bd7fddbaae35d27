"""A stand-in for ``DeviceMesh`` in single-process tests of the sharding arithmetic."""

from __future__ import annotations

import math

import torch


class FakeMesh:
    """What ``ShardingPlan`` reads of a ``DeviceMesh``: names, sizes, coordinates, groups."""

    def __init__(self, sizes: dict[str, int], coords: dict[str, int] | None = None, device_type: str = "cpu"):
        self.mesh_dim_names = tuple(sizes)
        self.sizes = list(sizes.values())
        self.coords = coords or {n: 0 for n in sizes}
        self.device_type = device_type
        self.mesh = torch.arange(math.prod(self.sizes)).reshape(self.sizes)

    def size(self, i: int) -> int:
        return self.sizes[i]

    def get_group(self, name: str) -> str:
        return f"group:{name}"

    def get_local_rank(self, name: str) -> int:
        return self.coords[name]
