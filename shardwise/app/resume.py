"""Resuming ``shardwise train`` from its latest checkpoint: the step, the global batch, the tokens and the schedule."""

from __future__ import annotations

from ..checkpoint import CheckpointManager
from .config import TrainConfig
from .data import TokenLoader
from .errors import ConfigError, say
from .lr import LRSchedule, lr_schedule, resumed_schedule

__all__ = ["global_batch_plan", "restore"]


def global_batch_plan(run: dict, cfg: TrainConfig, world: int) -> tuple[int, str]:
    """(grad_accum, one line or "") for resuming checkpoint ``run`` facts on ``world`` ranks.

    The same micro-batch on another number of ranks changes the global batch: said on one
    line, or, with --keep-global-batch, avoided by scaling --grad-accum (refused when the
    checkpoint's global batch is not a multiple of micro-batch x ranks).
    """
    grad_accum = cfg.grad_accum
    old_global = run.get("global_batch")
    new_global = cfg.micro_batch_size * grad_accum * world
    if not old_global or old_global == new_global:
        return grad_accum, ""
    was = f"{run.get('data_ranks', run['world_size'])} ranks x micro-batch {run['micro_batch_size']} x grad-accum {run['grad_accum']}"
    if not cfg.keep_global_batch:
        return grad_accum, (f"global batch changes from {old_global} to {new_global} sequences per step ({was} -> "
                            f"{world} ranks x micro-batch {cfg.micro_batch_size} x grad-accum {grad_accum}); "
                            f"--keep-global-batch keeps it")
    per_micro = cfg.micro_batch_size * world
    if old_global % per_micro:
        raise ConfigError("keep_global_batch", "", f"the checkpoint's global batch of {old_global} sequences "
                          f"({was}) is not a multiple of --micro-batch-size {cfg.micro_batch_size} x {world} ranks")
    grad_accum = old_global // per_micro
    return grad_accum, (f"global batch kept at {old_global} sequences per step: --grad-accum {cfg.grad_accum} -> "
                        f"{grad_accum} on {world} ranks (checkpoint: {was})")


def restore(cfg: TrainConfig, checkpoints: CheckpointManager, model, optimizer, loader: TokenLoader,
             world: int, rank: int) -> tuple[int, int, int, LRSchedule]:
    """Load the latest checkpoint (with --resume); (first step, grad_accum, tokens so far, lr schedule)."""
    grad_accum, schedule = cfg.grad_accum, lr_schedule(cfg)
    restored = checkpoints.load_latest(model, optimizer) if cfg.resume else None  # also restores the RNG
    if restored is None:
        if cfg.resume == "required":
            raise ConfigError("--resume=required", "", f"no complete checkpoint in {checkpoints.directory}")
        return 1, grad_accum, 0, schedule
    extra = restored.extra or {}
    loader.load_state_dict(extra["data"])
    run = extra.get("run") or {}
    say_ = say if rank == 0 else (lambda message: None)
    say_(f"resumed from {restored.path} (step {restored.step})")
    grad_accum, message = global_batch_plan(run, cfg, world)
    if message:
        say_(message)
    tokens = int(run["tokens"]) if "tokens" in run else loader.position * cfg.seq_len
    saved = LRSchedule.from_dict(run["schedule"]) if "schedule" in run else None
    return restored.step + 1, grad_accum, tokens, resumed_schedule(saved, cfg, restored.step)

