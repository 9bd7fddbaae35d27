"""Resuming ``shardwise train`` from its latest checkpoint: the step, the global batch, the tokens and the schedule."""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint import CheckpointManager, CheckpointMismatchError
from .config import TrainConfig
from .data import TokenLoader
from .errors import ConfigError, say
from .lr import LRSchedule, lr_schedule, resumed_schedule

__all__ = ["global_batch_plan", "restore", "describe_mismatch"]


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


def describe_mismatch(error: CheckpointMismatchError, out_dir: str, model_settings: dict | None) -> str:
    """What differs between a checkpoint and the model a resumed run built, and what to do, in one line.

    The shapes come from the error; the settings from the run folder's ``config.json`` (the run that
    saved the checkpoint), compared with ``model_settings`` (this run's model fields).
    """
    shapes = [f"{name} {tuple(saved)} in the checkpoint, {tuple(now)} now" for name, saved, now in error.mismatched]
    parts = []
    if shapes:
        more = f" and {len(shapes) - 3} more" if len(shapes) > 3 else ""
        parts.append(f"{len(shapes)} tensor shapes differ ({'; '.join(shapes[:3])}{more})")
    for what, names in (("missing from the checkpoint", error.missing), ("only in the checkpoint", error.unexpected)):
        if names:
            more = f" and {len(names) - 3} more" if len(names) > 3 else ""
            parts.append(f"{len(names)} tensors {what} ({', '.join(names[:3])}{more})")
    if error.mismatched or error.missing or error.unexpected:
        differs = "the checkpoint holds another model: " + "; ".join(parts)
    else:  # the optimizer's state does not fit
        differs = " ".join(str(error).split()).removesuffix(
            "(pass strict=False to load the keys that fit and skip the rest)").strip()
    saved = _saved_model_settings(out_dir)
    changed = [f"--{k.replace('_', '-')} {saved[k]} (now {v})" for k, v in (model_settings or {}).items()
               if k in saved and saved[k] != v]
    settings = f"; it was saved with {', '.join(changed)}" if changed else ""
    return (f"{differs}{settings}. Resume with the settings the checkpoint was saved with, or start a new run "
            f"(another --out-dir / --name, or --overwrite to replace this one)")


def _saved_model_settings(out_dir: str) -> dict:
    """The model fields of the run folder's ``config.json`` (written by the run that saved its checkpoints)."""
    try:
        return dict(json.loads((Path(out_dir) / "config.json").read_text()).get("model") or {})
    except (OSError, ValueError, AttributeError):
        return {}


def restore(cfg: TrainConfig, checkpoints: CheckpointManager, model, optimizer, loader: TokenLoader,
             world: int, rank: int, model_settings: dict | None = None) -> tuple[int, int, int, LRSchedule]:
    """Load the latest checkpoint (with --resume); (first step, grad_accum, tokens so far, lr schedule).

    ``model_settings``: this run's model fields (``GPTConfig.to_dict()``), named where a checkpoint of
    another model is refused."""
    grad_accum, schedule = cfg.grad_accum, lr_schedule(cfg)
    try:
        restored = checkpoints.load_latest(model, optimizer) if cfg.resume else None  # also restores the RNG
    except CheckpointMismatchError as e:  # another model: one line saying what differs, not a traceback
        raise ConfigError(f"--resume={cfg.resume}", "", describe_mismatch(e, cfg.out_dir, model_settings)) from None
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

