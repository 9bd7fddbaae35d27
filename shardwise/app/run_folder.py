"""The run folder of ``shardwise train`` (``--out-dir``): one run per folder, checked before any worker starts.

A folder holding an earlier run's metrics or checkpoints is refused unless
``--resume`` continues it or ``--overwrite`` replaces it (deleting
:data:`RUN_FILES` and :data:`RUN_FOLDERS` first).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from ..checkpoint import CheckpointManager
from .config import TrainConfig
from .errors import ConfigError, say

__all__ = ["prepare_run_folder", "RUN_FILES", "RUN_FOLDERS"]

RUN_FILES = ("metrics.jsonl", "summary.json", "loss.png", "config.json", "wandb-run-id")  # what --overwrite deletes
RUN_FOLDERS = ("checkpoints", "tensorboard", "wandb")  # and these folders


def _folder_flag(cfg: TrainConfig) -> tuple[str, str, str]:
    """The flag that named the run folder, its value, and how a message names the folder."""
    if cfg.name and cfg.out_dir == str(Path("runs") / cfg.name):
        return "name", cfg.name, f"{cfg.out_dir} "
    return "out_dir", cfg.out_dir, ""


def _earlier_run(out_dir: Path) -> list[str]:
    """What an earlier run left in ``out_dir`` that a new run would mix with (empty: nothing)."""
    found = []
    metrics = out_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append(f"metrics.jsonl with {len(metrics.read_text().splitlines())} steps")
    if (out_dir / "summary.json").is_file():
        found.append("summary.json")
    ckpt = out_dir / "checkpoints"
    if ckpt.is_dir():
        entries = [p.name for p in ckpt.iterdir() if p.name.startswith("step_")]
        if entries:
            found.append(f"{len(entries)} checkpoint folder(s) in checkpoints/")
    return found


def _check_writable(folder: Path) -> str | None:
    """Why files cannot be written into ``folder`` (created if missing), or ``None``."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".shardwise-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except FileExistsError:
        return "a file is in the way (not a folder)"
    except OSError as e:
        where = f" ({e.filename})" if e.filename and Path(e.filename) != folder else ""
        return f"cannot write there: {e.strerror or e}{where}"
    return None


def prepare_run_folder(cfg: TrainConfig, rank0: bool = True, announce: bool = True) -> None:
    """Check (and with --overwrite, clear) the run folder before any worker starts; ``ConfigError`` if unusable.

    One run per folder: a folder holding an earlier run's metrics or checkpoints is refused
    unless ``--resume`` continues it or ``--overwrite`` replaces it. The checkpoint folder is
    created and written to now, so a file in the way or a read-only disk is found before
    training, not at the first save. With ``--resume`` and no checkpoint, one line says the run
    starts at step 1 (``--resume=required`` fails instead).
    """
    out_dir = Path(cfg.out_dir)
    flag, value, folder = _folder_flag(cfg)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(flag, value, f"{out_dir} is a file, not a folder")
    earlier = _earlier_run(out_dir) if out_dir.is_dir() else []
    if earlier and not cfg.resume and not cfg.overwrite:
        raise ConfigError(flag, value, f"{folder}already holds a run ({', '.join(earlier)}); add --resume to "
                          f"continue it or --overwrite to replace it")
    if earlier and cfg.overwrite and rank0:
        for name in RUN_FILES:
            with contextlib.suppress(FileNotFoundError):
                (out_dir / name).unlink()
        for name in RUN_FOLDERS:
            shutil.rmtree(out_dir / name, ignore_errors=True)
        if announce:
            say(f"--overwrite: deleted the earlier run in {out_dir} ({', '.join(earlier)})")
    ckpt_dir = out_dir / "checkpoints"
    made = [p for p in (ckpt_dir, out_dir) if not p.exists()]  # removed again (if empty) when the run is refused
    why = _check_writable(out_dir)
    if why:
        raise ConfigError(flag, value, f"{folder}{why}")
    if cfg.save_every or cfg.resume:
        why = _check_writable(ckpt_dir)
        if why:
            raise ConfigError(flag, value, f"checkpoint folder {ckpt_dir}: {why}")
    if cfg.resume:
        manager = CheckpointManager(ckpt_dir, keep_last=cfg.keep_checkpoints)
        try:
            latest = manager.latest(report=False)  # incomplete folders are reported when the workers load
        except TypeError:
            latest = manager.latest()
        if latest is None and cfg.resume == "required":
            for path in made:
                with contextlib.suppress(OSError):
                    path.rmdir()
            raise ConfigError("--resume=required", "", f"no complete checkpoint in {ckpt_dir}")
        if latest is None and announce:
            metrics = [item for item in earlier if item.startswith("metrics.jsonl")]
            replacing = f" (its {metrics[0]} is replaced)" if metrics else ""
            say(f"--resume: no complete checkpoint in {ckpt_dir}; starting at step 1{replacing}")

