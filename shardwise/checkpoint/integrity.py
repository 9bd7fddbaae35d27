"""Checkpoint integrity: per-file sha256 written at save, checked at load and by ``shardwise ckpt verify``.

At save, once DCP has written the shards, the ranks hash the folder's files
(each rank the shard files it wrote, rank 0 ``.metadata``) and rank 0 records
them in ``shardwise.json`` as ``"files": {name: {"bytes": n, "sha256": hex}}``.
The ``COMPLETE`` marker, written last, records the sha256 of
``shardwise.json`` itself, so every byte of a checkpoint is covered. At load
the ranks share the hashing again; a file that is missing, shorter or longer,
or holds other bytes is named in one error, raised on every rank.

Checkpoints written before checksums (format ``shardwise-dcp/1``) get the
structural check only: every file that the DCP metadata points into exists
and is long enough for the bytes it should hold.

Every error here is a ``CheckpointError`` whose message names the path and
what is wrong with it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = [
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointSaveError",
    "META_FILE",
    "COMPLETE_MARKER",
    "FORMAT",
    "READABLE_FORMATS",
    "hash_files",
    "my_share",
    "file_problems",
    "structure_problems",
    "read_meta",
    "read_dcp_metadata",
    "complete_text",
    "verify_checkpoint",
]

META_FILE = "shardwise.json"
COMPLETE_MARKER = "COMPLETE"
DCP_METADATA = ".metadata"
FORMAT = "shardwise-dcp/2"  # /2: per-file sha256 in shardwise.json, shardwise.json's in COMPLETE
READABLE_FORMATS = ("shardwise-dcp/1", "shardwise-dcp/2")
_BLOCK = 8 << 20
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: __<rank>_<n>.distcp


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the path and what is wrong."""

    def __init__(self, message: str, path=None):
        super().__init__(message)
        self.path = Path(path) if path is not None else None


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files are missing, truncated, altered or unreadable (or differ across ranks)."""


class CheckpointSaveError(CheckpointError):
    """Writing a checkpoint failed (the message names the folder, the rank and the cause)."""


def _damaged(path: Path, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {path} is damaged: {what}. Restore the file, or move {path} away to resume from the "
        "previous checkpoint", path)


# ------------------------------------------------------------------ hashing
def _sha256(path: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            digest.update(view[:n])  # hashlib releases the GIL on large buffers: threads run in parallel
            size += n
    return size, digest.hexdigest()


def hash_files(folder: Path, names: list[str], threads: int = 4) -> dict[str, dict]:
    """``{name: {"bytes": n, "sha256": hex}}`` of files in ``folder`` (OSError if one cannot be read)."""
    folder = Path(folder)
    with ThreadPoolExecutor(max(1, min(threads, len(names)))) as pool:
        done = list(pool.map(lambda name: _sha256(folder / name), names))
    return {name: {"bytes": size, "sha256": hexdigest} for name, (size, hexdigest) in zip(names, done)}


def my_share(names, rank: int, world: int) -> list[str]:
    """The files this rank hashes: shard files of its own rank number (in its page cache right after
    the save), others (``.metadata``...) spread over the ranks."""
    mine = []
    for i, name in enumerate(sorted(names)):
        match = _RANK_FILE.match(name)
        owner = int(match.group(1)) % world if match else i % world
        if owner == rank:
            mine.append(name)
    return mine


def file_problems(folder: Path, manifest: dict[str, dict], names=None) -> list[str]:
    """What is wrong with ``names`` (default: every file in ``manifest``), one line per file."""
    folder = Path(folder)
    problems = []
    for name in sorted(manifest if names is None else names):
        want = manifest[name]
        path = folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        except OSError as e:
            problems.append(f"{path} cannot be read ({e})")
            continue
        if size != want["bytes"]:
            how = "truncated" if size < want["bytes"] else "longer than written"
            problems.append(f"{path} is {how}: {size} bytes, {want['bytes']} at save")
            continue
        try:
            _, got = _sha256(path)
        except OSError as e:
            problems.append(f"{path} cannot be read ({e})")
            continue
        if got != want["sha256"]:
            problems.append(f"{path} holds other bytes than were saved (sha256 {got[:12]}..., "
                            f"{want['sha256'][:12]}... at save)")
    return problems


def structure_problems(folder: Path, md) -> list[str]:
    """Files the DCP metadata points into that are missing or too short for the bytes they should hold."""
    folder = Path(folder)
    needed: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for name, end in sorted(needed.items()):
        path = folder / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path} is missing")
            continue
        if size < end:
            problems.append(f"{path} is truncated: {size} bytes, the DCP metadata needs at least {end}")
    return problems


# ------------------------------------------------------------------ shardwise.json and COMPLETE
def complete_text(step: int, meta_bytes: bytes) -> str:
    return f"step {step}\n{META_FILE} sha256 {hashlib.sha256(meta_bytes).hexdigest()}\n"


def read_meta(path: str | os.PathLike) -> dict:
    """``shardwise.json`` of a checkpoint, checked against ``COMPLETE`` and for a readable format."""
    path = Path(path)
    meta_path = path / META_FILE
    try:
        raw = meta_path.read_bytes()
    except FileNotFoundError:
        if (path / DCP_METADATA).is_file():
            raise CheckpointError(
                f"{path} is a DCP checkpoint without {META_FILE}: it was not written by shardwise.checkpoint. "
                "Load it with torch's functions into the sharded model: sd = get_model_state_dict(model); "
                "dcp.load(sd, checkpoint_id=...); set_model_state_dict(model, sd) (and the same with "
                "get_optimizer_state_dict / set_optimizer_state_dict), then save it with CheckpointManager",
                path) from None
        raise _damaged(path, f"{meta_path} is missing") from None
    except OSError as e:
        raise _damaged(path, f"{meta_path} cannot be read ({e})") from None
    try:
        marker = (path / COMPLETE_MARKER).read_text()
    except (OSError, UnicodeDecodeError):
        marker = ""
    recorded = re.search(rf"^{re.escape(META_FILE)} sha256 ([0-9a-f]{{64}})$", marker, re.M)
    if recorded and hashlib.sha256(raw).hexdigest() != recorded.group(1):
        raise _damaged(path, f"{meta_path} differs from the one written at save (its sha256 is not the one "
                             f"recorded in {path / COMPLETE_MARKER})")
    try:
        meta = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _damaged(path, f"{meta_path} is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
        raise _damaged(path, f"{meta_path} does not describe a checkpoint (no integer 'step')")
    fmt = meta.get("format")
    if fmt not in READABLE_FORMATS:
        raise CheckpointError(
            f"checkpoint {path} has format {fmt!r}; this shardwise reads {', '.join(READABLE_FORMATS)}. "
            "Load it with the shardwise version that wrote it, or export it there "
            "(shardwise ckpt export) and load the safetensors", path)
    return meta


def read_dcp_metadata(path: str | os.PathLike, reader=None):
    """The DCP ``.metadata`` of ``path`` (through ``reader``), or one error naming the file and the cause."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    reader = reader if reader is not None else dcp.FileSystemReader(str(path))
    try:
        return reader.read_metadata()
    except FileNotFoundError:
        raise _damaged(path, f"{path / DCP_METADATA} is missing") from None
    except Exception as e:  # pickle errors, EOFError, ...: a truncated or overwritten file
        raise _damaged(path, f"{path / DCP_METADATA} cannot be read, it is truncated or corrupted "
                             f"({type(e).__name__}: {e})") from None


# ------------------------------------------------------------------ offline
def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check one checkpoint in this process; ``{"ok", "problems", "files", "bytes", "checked"}``."""
    path = Path(path)
    try:
        meta = read_meta(path)
        manifest = meta.get("files")
        problems = file_problems(path, manifest) if manifest else []
        if not problems:
            md = read_dcp_metadata(path)
            problems = structure_problems(path, md)
    except CheckpointError as e:
        return {"ok": False, "problems": [str(e)], "files": 0, "bytes": 0, "checked": "-"}
    if manifest:
        files, checked = {n: r["bytes"] for n, r in manifest.items()}, "sha256"
    else:
        names = {info.relative_path for info in (md.storage_data or {}).values()} | {DCP_METADATA}
        files = {n: (path / n).stat().st_size for n in names if (path / n).exists()}
        checked = "presence and sizes only (no checksums: written before shardwise-dcp/2)"
    return {"ok": not problems, "problems": problems, "files": len(files), "bytes": sum(files.values()),
            "checked": checked}
