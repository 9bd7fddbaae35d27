"""``shardwise train`` runs on the gloo pool: the worker body of the command, without a new launcher.

Starting ``python -m shardwise train`` costs a fresh interpreter and torch import per process; tests whose
property lives in the training itself (not in the command line or the launcher) run the same
``resolve_config`` + ``train`` on the pool's ranks instead.
"""

from __future__ import annotations

import json
from pathlib import Path


def train_records(argv: list[str]) -> list[dict] | None:
    """On every rank: train with these flags; the run's metrics records (None where none were written)."""
    from shardwise.app.train import resolve_config, train

    cfg, model_cfg = resolve_config(argv)
    train(cfg, model_cfg)
    metrics = Path(cfg.out_dir) / "metrics.jsonl"
    return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else None
