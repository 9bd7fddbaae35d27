"""One value of a schedule, for the tests that check it point by point (the app reads the whole schedule)."""

from __future__ import annotations

from shardwise.app.config import TrainConfig
from shardwise.app.lr import lr_schedule
from shardwise.app.pipeline_order import in_flight_peak, rank_order


def lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate of a new run at ``step`` (1-based)."""
    return lr_schedule(cfg)(step)


def in_flight_microbatches(schedule: str, pp: int, pp_rank: int, n_microbatches: int, virtual: int = 1) -> int:
    """The most (stage, micro-batch) chunks this rank holds activations of at once."""
    return int(in_flight_peak(rank_order(schedule, pp, pp_rank, n_microbatches, virtual))[0])
