"""Atomic checkpoints in one folder: save, keep the last K, find and load the latest complete one.

Layout of ``directory``::

    step_00000100/          a complete checkpoint: DCP files (__<rank>_0.distcp,
        .metadata           .metadata), shardwise.json (what info/export read)
        shardwise.json      and the COMPLETE marker
        COMPLETE
    step_00000200.tmp/      a save in progress, or one that died: ignored on load

A save writes into ``step_XXXXXXXX.tmp``; every rank writes its shard; after a
barrier rank 0 writes ``shardwise.json`` and ``COMPLETE``, then renames the
folder to its final name (an atomic rename on POSIX file systems). Anything
that dies before the rename leaves only a ``.tmp`` folder, which ``load_latest``
skips and reports. The folder must be on a file system every rank sees.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .dcp_state import describe_model, describe_optimizer, load_state, save_state

__all__ = ["CheckpointManager", "Restored", "META_FILE", "COMPLETE_MARKER", "is_complete", "read_meta"]

log = logging.getLogger(__name__)

META_FILE = "shardwise.json"
COMPLETE_MARKER = "COMPLETE"
FORMAT = "shardwise-dcp/1"
_NAME = re.compile(r"^step_(\d+)(\.tmp|\.old)?$")


@dataclass
class Restored:
    """What ``load`` / ``load_latest`` found."""

    step: int
    path: Path
    extra: Any  # the dict given to save (this rank's, or rank 0's when the world size changed)
    rng_restored: bool
    skipped: list  # model keys not loaded (strict=False)


def is_complete(path: Path) -> bool:
    path = Path(path)
    return (
        _NAME.match(path.name) is not None
        and _NAME.match(path.name).group(2) is None
        and (path / COMPLETE_MARKER).is_file()
        and (path / ".metadata").is_file()
        and (path / META_FILE).is_file()
    )


def read_meta(path: Path) -> dict:
    with open(Path(path) / META_FILE) as f:
        return json.load(f)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class CheckpointManager:
    """Save and resume a sharded model, its optimizer, the caller's ``extra`` dict and RNG state.

    Every method that reads or writes checkpoints is a collective over
    ``process_group`` (default: the world): call it on every rank.

        manager = CheckpointManager("runs/x/checkpoints", keep_last=3)
        restored = manager.load_latest(model, optimizer)      # None on a fresh start
        start = restored.step + 1 if restored else 1
        ...
        manager.save(step, model, optimizer, extra={"data": loader.state_dict()})
    """

    def __init__(self, directory: str | os.PathLike, keep_last: int | None = 3, *,
                 process_group=None, save_rng: bool = True):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be at least 1 (or None to keep every checkpoint)")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.process_group = process_group
        self.save_rng = save_rng

    # ------------------------------------------------------------ process group
    @property
    def _distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group) if self._distributed else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group) if self._distributed else 1

    def _barrier(self) -> None:
        if self._distributed:
            dist.barrier(group=self.process_group)

    def _from_rank0(self, value):
        """``value`` as rank 0 computed it (rank 0 passes the value, every rank gets it back)."""
        if not self._distributed:
            return value
        box = [value]
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.process_group)
        return box[0]

    # ----------------------------------------------------------------- listing
    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def scan(self) -> tuple[list[tuple[int, Path]], list[Path]]:
        """(complete checkpoints oldest first, incomplete folders) as this process sees them."""
        complete, incomplete = [], []
        if not self.directory.is_dir():
            return complete, incomplete
        for entry in sorted(self.directory.iterdir()):
            match = _NAME.match(entry.name)
            if match is None or not entry.is_dir():
                continue
            if is_complete(entry):
                complete.append((int(match.group(1)), entry))
            else:
                incomplete.append(entry)
        complete.sort()
        return complete, incomplete

    def checkpoints(self) -> list[tuple[int, Path]]:
        return self.scan()[0]

    def latest(self, report: bool = True) -> Path | None:
        """The newest complete checkpoint (rank 0 decides), reporting incomplete folders it skips."""
        found = None
        if self.rank == 0:
            complete, incomplete = self.scan()
            if incomplete and report:
                names = ", ".join(str(p) for p in incomplete)
                message = (f"ignoring {len(incomplete)} incomplete checkpoint folder(s) (a save that did not "
                           f"finish): {names}")
                log.warning(message)
                warnings.warn(message, stacklevel=3)
            found = str(complete[-1][1]) if complete else None
        found = self._from_rank0(found)
        return Path(found) if found is not None else None

    # -------------------------------------------------------------------- save
    def save(self, step: int, model: nn.Module, optimizer=None, extra: Any = None) -> Path:
        """Write checkpoint ``step`` atomically; keep the last ``keep_last``. Returns its folder."""
        if int(step) != step or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative integer")
        step = int(step)
        started = time.perf_counter()
        final = self.path_for(step)
        tmp = final.with_name(final.name + ".tmp")
        error = None
        if self.rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
            except OSError as e:
                error = f"cannot create {tmp}: {e}"
        error = self._from_rank0(error)
        if error:
            raise RuntimeError(error)
        save_state(tmp, model, optimizer, extra, save_rng=self.save_rng, process_group=self.process_group)
        self._barrier()  # every rank has written its shard
        error = None
        if self.rank == 0:
            try:
                self._commit(step, tmp, final, model, optimizer, time.perf_counter() - started)
                self._prune(step)
            except Exception as e:  # tell the other ranks before raising here
                error = f"rank 0 could not complete checkpoint {final}: {type(e).__name__}: {e}"
                log.exception(error)
        error = self._from_rank0(error)
        if error:
            raise RuntimeError(error)
        log.info("saved checkpoint step %d to %s in %.1fs", step, final, time.perf_counter() - started)
        return final

    def _commit(self, step, tmp: Path, final: Path, model, optimizer, seconds: float) -> None:
        meta = {
            "format": FORMAT,
            "step": step,
            "world_size": self.world_size,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__,
            "save_seconds": round(seconds, 3),
            **describe_model(model),
            "optimizer": describe_optimizer(model, optimizer) if optimizer is not None else None,
            "files_bytes": sum(f.stat().st_size for f in tmp.iterdir() if f.is_file()),
        }
        _write_durably(tmp / META_FILE, json.dumps(meta, indent=1) + "\n")
        _write_durably(tmp / COMPLETE_MARKER, f"step {step}\n")
        _fsync_dir(tmp)
        old = final.with_name(final.name + ".old")
        if final.exists():  # saving a step again: swap the new one in, then drop the old
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_dir(self.directory)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)

    def _prune(self, step: int) -> None:
        complete, incomplete = self.scan()
        doomed = [p for _, p in complete[: -self.keep_last]] if self.keep_last else []
        # Leftovers of saves that died before this one finished can never complete.
        doomed += [p for p in incomplete if int(_NAME.match(p.name).group(1)) < step]
        for path in doomed:
            log.info("removing checkpoint folder %s", path)
            shutil.rmtree(path, ignore_errors=True)

    # -------------------------------------------------------------------- load
    def load(self, path: str | os.PathLike | int, model: nn.Module, optimizer=None, *,
             strict: bool = True, restore_rng: bool = True) -> Restored:
        """Load one checkpoint (a folder, or a step number in this manager's folder)."""
        path = self.path_for(path) if isinstance(path, int) else Path(path)
        if not is_complete(path):
            raise FileNotFoundError(f"{path} is not a complete shardwise checkpoint (no {COMPLETE_MARKER} marker)")
        started = time.perf_counter()
        meta = read_meta(path)
        loaded = load_state(path, model, optimizer, strict=strict, restore_rng=restore_rng and self.save_rng,
                            meta=meta, process_group=self.process_group)
        log.info("loaded checkpoint %s in %.1fs", path, time.perf_counter() - started)
        return Restored(step=int(meta["step"]), path=path, extra=loaded.extra,
                        rng_restored=loaded.rng_restored, skipped=loaded.skipped)

    def load_latest(self, model: nn.Module, optimizer=None, *, strict: bool = True,
                    restore_rng: bool = True) -> Restored | None:
        """Load the newest complete checkpoint; ``None`` when there is none (incomplete ones are reported)."""
        path = self.latest()
        if path is None:
            return None
        return self.load(path, model, optimizer, strict=strict, restore_rng=restore_rng)
