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
