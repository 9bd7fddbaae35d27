"""Options of the tiny ``shardwise bench`` runs the app tests make on the gloo pool."""

from __future__ import annotations

from shardwise.app.bench import runner

from tests.helpers.distributed import device

# the tiny size at a quarter of its micro-batch and sequence (2 x 32 tokens, not 4 x 128): what these runs
# check (statuses, report rows, losses agreeing or moving apart) does not need its full shape; CI time does
SMALL_SHAPE = dict(micro_batch=2, seq_len=32)


def tiny_options(wrappers, steps: int, **options) -> runner.BenchOptions:
    """The tiny size at SMALL_SHAPE, ``steps`` timed steps after one warm-up step, on the pool's device."""
    return runner.BenchOptions(sizes=["tiny"], wrappers=list(wrappers), device=device().type, steps={"*": steps},
                               warmup={"*": 1}, **SMALL_SHAPE, **options)
