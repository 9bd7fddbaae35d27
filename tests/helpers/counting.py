"""The default collectives, counted by kind: an injected object sees every transition a group makes."""

from __future__ import annotations

from collections import Counter

import shardwise


class CountingCollectives(shardwise.Collectives):
    """``calls["gather" | "reduce_scatter" | "all_reduce"]``: how often each ran."""

    def __init__(self):
        self.calls = Counter()

    def gather(self, outs, ins, axis):
        self.calls["gather"] += 1
        super().gather(outs, ins, axis)

    def reduce_scatter(self, outs, ins, axis):
        self.calls["reduce_scatter"] += 1
        super().reduce_scatter(outs, ins, axis)

    def all_reduce(self, t, axes, average=True):
        self.calls["all_reduce"] += 1
        super().all_reduce(t, axes, average)


class CollectiveLaunches:
    """Collectives launched (``calls`` by kind) until ``close()``, for comparing FSDP2 and shardwise:
    FSDP2's through ``torch.distributed`` (one flat buffer per group), shardwise's through its
    ``Collectives`` object (one call per group and axis: one coalesced launch on NCCL; gloo has no
    coalescing, so the engine then loops over the pieces inside that one call)."""

    def __init__(self, impl: str):
        import torch.distributed as dist

        import shardwise

        self.calls = {"gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        if impl == "fsdp2":
            owner, names = dist, {"all_gather_single": "gather", "all_gather_into_tensor": "gather",
                                  "reduce_scatter_single": "reduce_scatter",
                                  "reduce_scatter_tensor": "reduce_scatter", "all_reduce": "all_reduce"}
        else:
            owner, names = shardwise.Collectives, {"gather": "gather", "reduce_scatter": "reduce_scatter",
                                                   "all_reduce": "all_reduce"}
        self.saved = []
        for name, kind in names.items():
            fn = getattr(owner, name, None)
            if fn is None:
                continue
            self.saved.append((owner, name, fn))
            setattr(owner, name, self._counting(fn, kind))

    def _counting(self, fn, kind):
        def counted(*args, **kwargs):
            self.calls[kind] += 1
            return fn(*args, **kwargs)
        return counted

    def close(self) -> dict:
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)
        return dict(self.calls)


class GatherGroupSizes:
    """The group size of every all-gather launched until ``take()`` (which also resets), for comparing the
    groups FSDP2 and shardwise gather over: FSDP2's ``all_gather_single`` / ``all_gather_into_tensor``
    (its ``group=``), shardwise's ``Collectives.gather`` (its axis). ``close()`` puts the originals back."""

    def __init__(self, impl: str):
        import torch.distributed as dist

        import shardwise

        self.sizes: list[int] = []
        self.saved = []
        if impl == "fsdp2":
            for name in ("all_gather_single", "all_gather_into_tensor"):
                fn = getattr(dist, name, None)
                if fn is not None:
                    self.saved.append((dist, name, fn))
                    setattr(dist, name, self._sized(fn, lambda args, kwargs: dist.get_world_size(
                        kwargs.get("group", args[2] if len(args) > 2 else None))))
        else:
            fn = shardwise.Collectives.gather
            self.saved.append((shardwise.Collectives, "gather", fn))
            shardwise.Collectives.gather = self._sized(fn, lambda args, kwargs: kwargs.get("axis", args[-1]).size)

    def _sized(self, fn, size_of):
        def recorded(*args, **kwargs):
            self.sizes.append(size_of(args, kwargs))
            return fn(*args, **kwargs)
        return recorded

    def take(self) -> list[int]:
        out, self.sizes = sorted(self.sizes), []
        return out

    def close(self) -> None:
        for owner, name, fn in self.saved:
            setattr(owner, name, fn)
