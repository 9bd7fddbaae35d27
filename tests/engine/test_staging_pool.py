"""The staging pool reuses a unit's buffers for the next unit of the same shape, and lets others go."""

from __future__ import annotations

import torch

from shardwise.engine.collectives import StagingPool

CPU = torch.device("cpu")


def test_a_buffer_of_the_same_size_and_dtype_is_reused():
    pool = StagingPool()
    first = pool.take(10, torch.float32, CPU)
    pool.give(first)
    assert pool.take(10, torch.float32, CPU) is first
    assert pool.take(10, torch.float32, CPU) is not first  # taken already: a new one
    pool.give(first)
    assert pool.take(10, torch.bfloat16, CPU) is not first  # another dtype never aliases it


def test_layer_after_layer_reuses_three_buffers_and_other_sizes_go():
    pool = StagingPool()
    # the output head's reduction: flat gradients and the reduce-scatter output
    head = [pool.take(1000, torch.float32, CPU), pool.take(500, torch.float32, CPU)]
    cast = pool.take(60, torch.bfloat16, CPU)  # the next layer's gather, prefetched
    for b in head:
        pool.give(b)  # landed when the layer's reduction starts
    layer = [pool.take(120, torch.float32, CPU), pool.take(60, torch.float32, CPU)]
    held = [t for ts in pool._free.values() for t in ts]
    assert not any(t is h for t in held for h in head), "a bigger unit's buffers must not linger"
    # steady state: each later layer takes back exactly what the previous one gave
    for _ in range(4):
        pool.give(cast)
        for b in layer:
            pool.give(b)
        again = [pool.take(60, torch.bfloat16, CPU), pool.take(120, torch.float32, CPU), pool.take(60, torch.float32, CPU)]
        assert again[0] is cast and again[1] is layer[0] and again[2] is layer[1]
    pool.clear()
    assert pool.take(120, torch.float32, CPU) is not layer[0]


def test_a_new_size_lets_the_spares_of_other_sizes_go_before_it_is_allocated():
    pool = StagingPool()
    layer = [pool.take(120, torch.float32, CPU), pool.take(60, torch.float32, CPU)]
    for b in layer:
        pool.give(b)  # the last layer's reduction landed: spares now
    embedding = pool.take(1000, torch.float32, CPU)  # the embedding's backward: a size never seen
    assert pool._free == {}, "the layers' spares must not sit beside the embedding's buffer"
    pool.give(embedding)
    assert pool.take(1000, torch.float32, CPU) is embedding
