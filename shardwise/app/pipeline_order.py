"""The order in which torch's pipeline schedules run one rank's forwards and backwards, and what it keeps in flight.

A micro-batch's activations on a stage live from its forward to its backward,
so a rank's activation peak is the most (stage, micro-batch) chunks whose
forward ran and whose backward has not. That depends only on the schedule's
order, derived here from the rules of ``torch.distributed.pipelining.schedules``
(read from torch 2.13, ``tests/app/test_pipeline_order.py`` compares with
torch's own action lists):

* ``gpipe``: every forward, then every backward: all ``m`` micro-batches in flight.
* ``1f1b``: ``min(m, pp - rank)`` warm-up forwards, then a backward before each
  further forward: at most ``min(m, pp - rank)`` in flight.
* ``interleaved`` (``v`` stages per rank, ``m`` split into rounds of
  ``m // max(1, m // pp)``): ``W = min((v - 1) * round + 2 * (pp - 1 - rank), v m)``
  warm-up forwards cycling over the local stages a round at a time, then a
  forward *before* each backward (backwards from the last local stage down):
  at most ``min(W + 1, v m)`` chunks in flight.
* ``looped_bfs``: every micro-batch through the first local stage, then the next,
  then the backwards in reverse: all ``v m`` chunks in flight.

Nothing here imports torch.distributed: the memory estimate and the benchmark
read it before any process group exists.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["PIPELINE_SCHEDULES", "rank_order", "in_flight_peak", "textbook_bubble"]

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved", "looped_bfs")  # not yet: shardwise.engine.pipeline's zero-bubble ones
_ONE_STAGE = ("gpipe", "1f1b")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _check(schedule: str, pp: int, pp_rank: int, n_microbatches: int, virtual: int) -> None:
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is not one of {list(PIPELINE_SCHEDULES)}")
    _positive("pp", pp)
    _positive("n_microbatches", n_microbatches)
    _positive("virtual", virtual)
    if not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank!r} must be in [0, pp={pp})")
    if schedule in _ONE_STAGE and virtual != 1:
        raise ValueError(f"schedule={schedule!r} runs one stage per rank, got virtual={virtual}")
    if schedule == "interleaved":
        rounds = max(1, n_microbatches // pp)
        if n_microbatches % rounds:
            raise ValueError(f"n_microbatches={n_microbatches}: the interleaved schedule needs a multiple of its "
                             f"number of rounds, max(1, n_microbatches // pp) = {rounds}")


def rank_order(schedule: str, pp: int, pp_rank: int, n_microbatches: int,
               virtual: int = 1) -> list[tuple[str, int, int]]:
    """This rank's computations in order: ``("F" | "B", local stage, micro-batch)``.

    Local stage ``j`` is global stage ``pp_rank + j * pp`` (torch's looped numbering).
    """
    _check(schedule, pp, pp_rank, n_microbatches, virtual)
    m, v = n_microbatches, virtual
    if schedule == "gpipe":
        return [("F", 0, i) for i in range(m)] + [("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        warm = min(m, pp - pp_rank)
        order = [("F", 0, i) for i in range(warm)]
        for i in range(m):
            order.append(("B", 0, i))
            if warm + i < m:
                order.append(("F", 0, warm + i))
        return order
    if schedule == "looped_bfs":
        return ([("F", j, i) for j in range(v) for i in range(m)]
                + [("B", j, i) for j in reversed(range(v)) for i in reversed(range(m))])
    per_round = m // max(1, m // pp)
    total = v * m
    warm = min((v - 1) * per_round + 2 * (pp - 1 - pp_rank), total)
    next_f, next_b = [0] * v, [0] * v
    order = []

    def forward(op: int) -> None:
        j = (op // per_round) % v
        order.append(("F", j, next_f[j]))
        next_f[j] += 1

    def backward(op: int) -> None:
        j = v - 1 - ((op - warm) // per_round) % v
        order.append(("B", j, next_b[j]))
        next_b[j] += 1

    for op in range(total + warm):
        if op < total:
            forward(op)
        if op >= warm:
            backward(op)
    return order


def in_flight_peak(order: Sequence[tuple[str, int, int]],
                   chunk_bytes: Sequence[float] | None = None) -> tuple[float, list[int]]:
    """The largest sum over chunks in flight of ``chunk_bytes[local stage]`` (1 each when ``None``), and how
    many chunks of each local stage are in flight at that moment (the first such moment)."""
    stages = 1 + max((j for _, j, _ in order), default=0)
    weight = list(chunk_bytes) if chunk_bytes is not None else [1] * stages
    if len(weight) < stages:
        raise ValueError(f"chunk_bytes has {len(weight)} entries, the order has {stages} local stages")
    live, best, at_best, now = [0] * stages, 0.0, [0] * stages, 0.0
    for kind, j, _ in order:
        if kind == "F":
            live[j] += 1
            now += weight[j]
            if now > best:
                best, at_best = now, list(live)
        else:
            live[j] -= 1
            now -= weight[j]
            if live[j] < 0:
                raise ValueError(f"the order runs a backward of local stage {j} before its forward")
    return best, at_best


def textbook_bubble(pp: int, n_microbatches: int, virtual: int = 1) -> float:
    """The idle share of a step, ``(pp - 1) / (v m + pp - 1)``, with backward a fixed multiple of forward and
    no communication time (GPipe, 1F1B; interleaved and looped BFS with ``v`` stages per rank)."""
    _positive("pp", pp)
    _positive("n_microbatches", n_microbatches)
    _positive("virtual", virtual)
    return (pp - 1) / (virtual * n_microbatches + pp - 1)
