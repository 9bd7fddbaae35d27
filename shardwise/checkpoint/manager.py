"""Atomic checkpoints in one folder: save, keep the last K, find, verify and load the latest complete one.

Layout of ``directory``::

    step_00000100/          a complete checkpoint: DCP files (__<rank>_0.distcp,
        .metadata           .metadata), shardwise.json (what info/export read,
        shardwise.json      with each file's size and sha256) and the COMPLETE
        COMPLETE            marker (with shardwise.json's sha256)
    step_00000200.tmp/      a save in progress, or one that died: ignored on load
    step_00000050.pruned/   an old checkpoint being deleted: ignored, removed by the next save

A save: rank 0 creates ``step_XXXXXXXX.tmp`` and a token file in it, which
every rank must see (the folder must be one shared folder, not a copy per
node); every rank writes its shard (DCP); the ranks hash the files (each its
own shard files); rank 0 writes ``shardwise.json`` and ``COMPLETE``, then
renames the folder to its final name (an atomic rename on POSIX file systems).
Anything that dies before the rename leaves only a ``.tmp`` folder, which
``load_latest`` skips and reports. Keep-last-K pruning renames a checkpoint
away from its step name before deleting it, so a kill during pruning never
leaves a folder that looks complete but lacks files.

A load checks that every rank sees the same checkpoint, verifies every
file's size and sha256 (the ranks share the reading; ``verify=False`` skips
it), then reads. Every failure is one ``CheckpointError`` (or
``CheckpointMismatchError``), raised on every rank, whose message names the
path and what is wrong.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from .dcp_state import load_state, merge_descriptions, save_state
from .integrity import (
    COMPLETE_MARKER,
    FORMAT,
    META_FILE,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointSaveError,
    complete_text,
    file_problems,
    hash_files,
    my_share,
    read_dcp_metadata,
    read_meta,
    structure_problems,
)

__all__ = ["CheckpointManager", "Restored", "META_FILE", "COMPLETE_MARKER", "is_complete", "read_meta"]

log = logging.getLogger(__name__)

TOKEN_FILE = ".shardwise-save-token"
_NAME = re.compile(r"^step_(\d+)(\.tmp|\.old|\.pruned)?$")


@dataclass
class Restored:
    """What ``load`` / ``load_latest`` found."""

    step: int
    path: Path
    extra: Any  # the dict given to save (this rank's, or rank 0's when the world size changed)
    rng_restored: bool
    skipped: list  # model keys not loaded (strict=False)


def is_complete(path: Path) -> bool:
    """A committed checkpoint: its step name and its COMPLETE marker (whether its files are intact is
    for verification to say)."""
    path = Path(path)
    match = _NAME.match(path.name)
    return match is not None and match.group(2) is None and (path / COMPLETE_MARKER).is_file()


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


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _cause(e: BaseException) -> str:
    """One line for an exception, DCP's per-rank failures unpacked."""
    if isinstance(e, CheckpointException):
        parts = [f"rank {rank}: {_cause(failure[0] if isinstance(failure, tuple) else failure)}"
                 for rank, failure in sorted(e.failures.items())]
        return "; ".join(parts)
    text = f"{type(e).__name__}: {e}".splitlines()[0]
    if isinstance(e, OSError) and e.errno in (errno.EFBIG, errno.ENOSPC, errno.EDQUOT):
        text += " (the file system refused the write: file size limit, quota or full disk)"
    elif "unexpected pos" in text:
        text += " (a short write: file size limit, quota or full disk?)"
    return text


class CheckpointManager:
    """Save and resume a sharded model, its optimizer, the caller's ``extra`` dict and RNG state.

    Every method that reads or writes checkpoints is a collective over
    ``process_group`` (default: the world): call it on every rank.

        manager = CheckpointManager("runs/x/checkpoints", keep_last=3)
        restored = manager.load_latest(model, optimizer)      # None on a fresh start
        start = restored.step + 1 if restored else 1
        ...
        manager.save(step, model, optimizer, extra={"data": loader.state_dict()})

    ``verify`` (default on) checks every file's sha256 before a load: one
    more read of the checkpoint, shared by the ranks. ``part_group``: the
    ranks of that group hold different parts of one model, each under the
    whole model's names (a pipeline's stages): the checkpoint is the whole
    model's, and loads into the whole model or into other parts.
    """

    def __init__(self, directory: str | os.PathLike, keep_last: int | None = 3, *,
                 process_group=None, save_rng: bool = True, verify: bool = True, part_group=None):
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last={keep_last!r} must be a whole number of at least 1 (or None to keep every "
                             f"checkpoint)")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.process_group = process_group
        self.save_rng = save_rng
        self.verify = verify
        self.part_group = part_group

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

    def _from_rank0(self, value):
        """``value`` as rank 0 computed it (rank 0 passes the value, every rank gets it back)."""
        if not self._distributed:
            return value
        box = [value]
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.process_group)
        return box[0]

    def _all_gather(self, value) -> list:
        if not self._distributed:
            return [value]
        out = [None] * self.world_size
        dist.all_gather_object(out, value, group=self.process_group)
        return out

    # ----------------------------------------------------------------- listing
    def path_for(self, step: int) -> Path:
        return self.directory / f"step_{step:08d}"

    def scan(self) -> tuple[list[tuple[int, Path]], list[Path]]:
        """(complete checkpoints oldest first, other step folders) as this process sees them."""
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
        """The newest complete checkpoint (rank 0 decides), reporting unfinished saves it skips."""
        found = None
        if self.rank == 0:
            complete, incomplete = self.scan()
            unfinished = [p for p in incomplete if _NAME.match(p.name).group(2) in (None, ".tmp")]
            if unfinished and report:
                names = ", ".join(str(p) for p in unfinished)
                message = (f"ignoring {len(unfinished)} incomplete checkpoint folder(s) (a save that did not "
                           f"finish): {names}")
                log.warning(message)
                warnings.warn(message, stacklevel=3)
            found = complete[-1][1].name if complete else None
        found = self._from_rank0(found)  # a name: each rank finds it in its own view of the folder
        return self.directory / found if found is not None else None

    # -------------------------------------------------------------------- save
    def save(self, step: int, model: nn.Module, optimizer=None, extra: Any = None) -> Path:
        """Write checkpoint ``step`` atomically; keep the last ``keep_last``. Returns its folder."""
        if int(step) != step or step < 0:
            raise ValueError(f"step={step!r} must be a non-negative integer")
        step = int(step)
        started = time.perf_counter()
        final = self.path_for(step)
        tmp = final.with_name(final.name + ".tmp")
        error = token = None
        if self.rank == 0:
            try:
                if tmp.exists():
                    shutil.rmtree(tmp)
                tmp.mkdir(parents=True)
                token = f"{secrets.token_hex(16)} {socket.gethostname()}"
                _write_durably(tmp / TOKEN_FILE, token.encode())
            except OSError as e:
                error = f"cannot create {tmp}: {e}"
        error, token = self._from_rank0((error, token))
        if error:
            raise CheckpointSaveError(error, tmp)
        self._check_shared(tmp, token)

        try:
            written = save_state(tmp, model, optimizer, extra, save_rng=self.save_rng,
                                 process_group=self.process_group, part_group=self.part_group)
        except (Exception, CheckpointException) as e:  # DCP raises the same on every rank
            # The .tmp folder stays (reported on load, removed by the next save), as after a crash.
            raise CheckpointSaveError(f"could not save checkpoint step {step}: writing {tmp} failed: {_cause(e)}",
                                      tmp) from (e if isinstance(e, Exception) else None)
        manifest = self._hash(tmp, written)
        described = None  # what shardwise.json says of the model: rank 0 writes it (all the parts' ranks gather it)
        if self.part_group is not None or self.rank == 0:
            described = merge_descriptions(model, optimizer, self.part_group)
        error = None
        if self.rank == 0:
            try:
                self._commit(step, tmp, final, described, time.perf_counter() - started, manifest)
                self._prune(step)
            except Exception as e:  # tell the other ranks before raising here
                error = f"rank 0 could not complete checkpoint {final}: {type(e).__name__}: {e}"
                log.debug(error, exc_info=True)  # the error says it in one line; the traceback only for debugging
        error = self._from_rank0(error)
        if error:
            raise CheckpointSaveError(error, final)
        log.info("saved checkpoint step %d to %s in %.1fs", step, final, time.perf_counter() - started)
        return final

    def _check_shared(self, tmp: Path, token: str) -> None:
        """Every rank must see the token rank 0 just wrote: one folder shared by all, not one per node."""
        try:
            seen = (tmp / TOKEN_FILE).read_text()
        except OSError:
            seen = None
        looked = None if seen == token else f"{tmp / TOKEN_FILE}"
        results = self._all_gather((looked, socket.gethostname(), str(self.directory), str(tmp)))
        bad = [(r, host, where) for r, (where, host, _, _) in enumerate(results) if where]
        if bad:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            _, host0, folder0, tmp0 = results[0]
            missing = "; ".join(f"rank {r} ({host}) does not see it as {where}" for r, host, where in bad)
            raise CheckpointSaveError(
                f"checkpoint folder {folder0} is not one folder shared by every rank: rank 0 ({host0}) created "
                f"{tmp0} with a token file, but {missing}. Every rank must save into the same shared file "
                "system folder (a node-local path gives each node its own partial checkpoint)", self.directory)

    def _hash(self, tmp: Path, written) -> dict[str, dict]:
        """``{file: {"bytes", "sha256"}}`` of the DCP files, each rank hashing its share (a collective)."""
        if not written.storage_data:  # torch 2.11's dcp.save returns metadata without the storage index
            written = FileSystemReader(str(tmp)).read_metadata()
        names = sorted({info.relative_path for info in (written.storage_data or {}).values()} | {".metadata"})
        problem, mine = None, {}
        try:
            mine = hash_files(tmp, my_share(names, self.rank, self.world_size))
        except OSError as e:
            problem = f"cannot read back {e.filename or tmp}: {e.strerror or e}"
        results = self._all_gather((mine, problem))
        bad = [f"rank {r}: {p}" for r, (_, p) in enumerate(results) if p]
        if bad:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointSaveError(f"could not save checkpoint {tmp}: {'; '.join(bad)}", tmp)
        return {name: row for part, _ in results for name, row in part.items()}

    def _commit(self, step, tmp: Path, final: Path, described: dict, seconds: float, manifest: dict) -> None:
        (tmp / TOKEN_FILE).unlink(missing_ok=True)
        meta = {
            "format": FORMAT,
            "step": step,
            "world_size": self.world_size,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "torch": torch.__version__,
            "save_seconds": round(seconds, 3),
            **described,
            "optimizer": described.get("optimizer"),
            "files_bytes": sum(row["bytes"] for row in manifest.values()),
            "checksum": "sha256",
            "files": dict(sorted(manifest.items())),
        }
        raw = (json.dumps(meta, indent=1) + "\n").encode()
        _write_durably(tmp / META_FILE, raw)
        _write_durably(tmp / COMPLETE_MARKER, complete_text(step, raw).encode())
        _fsync_dir(tmp)
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
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
        doomed += [p for p in incomplete if _NAME.match(p.name).group(2) == ".pruned"
                   or int(_NAME.match(p.name).group(1)) < step]
        for path in doomed:
            log.info("removing checkpoint folder %s", path)
            if _NAME.match(path.name).group(2) is None:
                # Un-mark first: once renamed no load takes it, so a kill while deleting leaves no
                # folder with a step name and COMPLETE that lacks files.
                gone = path.with_name(path.name + ".pruned")
                if gone.exists():
                    shutil.rmtree(gone)
                os.rename(path, gone)
                _fsync_dir(self.directory)
                path = gone
            shutil.rmtree(path, ignore_errors=True)

    # -------------------------------------------------------------------- load
    def load(self, path: str | os.PathLike | int, model: nn.Module, optimizer=None, *,
             strict: bool = True, restore_rng: bool = True, verify: bool | None = None) -> Restored:
        """Load one checkpoint (a folder, or a step number in this manager's folder)."""
        path = self.path_for(path) if isinstance(path, int) else Path(path)
        started = time.perf_counter()
        meta = self._check_readable(path)
        if self.verify if verify is None else verify:
            self._verify(path, meta)
        try:
            loaded = load_state(path, model, optimizer, strict=strict, restore_rng=restore_rng and self.save_rng,
                                meta=meta, process_group=self.process_group, part_group=self.part_group)
        except CheckpointException as e:  # DCP's per-rank read failures (raised on every rank)
            raise CheckpointCorruptError(f"reading checkpoint {path} failed: {_cause(e)}", path) from None
        log.info("loaded checkpoint %s in %.1fs", path, time.perf_counter() - started)
        return Restored(step=int(meta["step"]), path=path, extra=loaded.extra,
                        rng_restored=loaded.rng_restored, skipped=loaded.skipped)

    def _check_readable(self, path: Path) -> dict:
        """``shardwise.json`` of ``path``, once every rank has read it and found the same one (a collective)."""
        problem, seen, meta = None, None, None
        if not path.is_dir():
            problem = f"{path} does not exist"
        elif not is_complete(path):
            problem = (f"{path} is not a complete shardwise checkpoint (no {COMPLETE_MARKER} marker under a "
                       "step_XXXXXXXX name: a save that did not finish)")
        else:
            try:
                meta = read_meta(path)
                seen = hashlib.sha256((path / META_FILE).read_bytes()).hexdigest()
            except (CheckpointError, OSError) as e:
                problem = str(e)
        results = self._all_gather((problem, seen, socket.gethostname()))
        shared = "The checkpoint folder must be one folder shared by every rank, not a copy per node"
        bad = [(r, p) for r, (p, _, _) in enumerate(results) if p]
        if bad and len(bad) < len(results):
            good = [r for r, (p, _, _) in enumerate(results) if not p]
            raise CheckpointCorruptError(
                f"checkpoint {self._rank0_path(path)} differs across ranks: "
                + "; ".join(f"rank {r} ({results[r][2]}): {p}" for r, p in bad)
                + f", while rank(s) {', '.join(map(str, good))} read it. {shared}", path)
        if bad:
            text = bad[0][1] if len({p for _, p in bad}) == 1 else "; ".join(f"rank {r}: {p}" for r, p in bad)
            if problem is not None and ("does not exist" in problem or "not a complete" in problem):
                raise FileNotFoundError(text)
            raise (CheckpointCorruptError if "damaged" in text else CheckpointError)(text, path)
        if len({s for _, s, _ in results}) > 1:
            groups: dict[str, list[str]] = {}
            for r, (_, s, host) in enumerate(results):
                groups.setdefault(s, []).append(f"{r} ({host})")
            described = "; ".join(f"rank(s) {', '.join(rs)} see {META_FILE} with sha256 {s[:12]}"
                                  for s, rs in groups.items())
            raise CheckpointCorruptError(
                f"checkpoint {self._rank0_path(path)} differs across ranks: {described}. {shared}", path)
        return meta

    def _rank0_path(self, path: Path) -> Path:
        """Rank 0's name for ``path`` (so that every rank raises the same message)."""
        return Path(self._from_rank0(str(path)))

    def _verify(self, path: Path, meta: dict) -> None:
        """Every file's size and sha256 against ``shardwise.json``, the ranks sharing the reading (a collective)."""
        started = time.perf_counter()
        manifest = meta.get("files")
        problems: list[str] = []
        try:
            if manifest:
                problems = file_problems(path, manifest, my_share(manifest, self.rank, self.world_size))
            elif self.rank == 0:
                problems = structure_problems(path, read_dcp_metadata(path))
        except CheckpointError as e:
            problems = [str(e)]
        gathered = self._all_gather(problems)
        found = list(dict.fromkeys(p for part in gathered for p in part))
        if found:
            if len(found) == 1 and found[0].startswith(f"checkpoint {path}"):
                raise CheckpointCorruptError(found[0], path)
            raise CheckpointCorruptError(
                f"checkpoint {path} is damaged: {'; '.join(found)}. Restore the file(s), or move {path} away "
                "to resume from the previous checkpoint", path)
        if manifest:
            log.info("verified %d files (%.1f MB) of %s in %.2fs", len(manifest),
                     sum(r["bytes"] for r in manifest.values()) / 1e6, path, time.perf_counter() - started)
        else:
            log.info("%s has no checksums (format %s): checked its files' presence and sizes only",
                     path, meta.get("format"))

    def load_latest(self, model: nn.Module, optimizer=None, *, strict: bool = True,
                    restore_rng: bool = True, verify: bool | None = None) -> Restored | None:
        """Load the newest complete checkpoint; ``None`` when there is none (incomplete ones are reported)."""
        path = self.latest()
        if path is None:
            return None
        return self.load(path, model, optimizer, strict=strict, restore_rng=restore_rng, verify=verify)
