"""Offline: read a checkpoint one tensor at a time, export safetensors, describe it.

Nothing here needs a GPU or a process group. ``read_tensors`` asks DCP for one
whole tensor at a time (its reader seeks to just the saved chunks that tensor
is made of), and ``export_safetensors`` writes the safetensors header first
(every shape and dtype is known from the metadata) and then streams each
tensor's bytes after it, so memory stays near the largest tensor rather than
the model.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import warnings
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .dcp_state import MODEL_PREFIX, OPTIM_PREFIX
from .integrity import COMPLETE_MARKER, META_FILE, CheckpointCorruptError, read_dcp_metadata, verify_checkpoint
from .manager import _NAME, CheckpointManager, is_complete, read_meta

__all__ = [
    "resolve_checkpoint",
    "resolve_checkpoints",
    "read_tensors",
    "export_safetensors",
    "checkpoint_info",
    "format_info",
    "parse_size",
    "split_by_size",
    "write_safetensors",
]

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16}


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint folder; a manager folder (``step_*`` inside) resolves to its latest complete one."""
    return resolve_checkpoints(path, latest_only=True)[0]


def _is_checkpoint_folder(path: Path) -> bool:
    return any((path / name).exists() for name in (".metadata", META_FILE, COMPLETE_MARKER))


def resolve_checkpoints(path: str | os.PathLike, latest_only: bool = False) -> list[Path]:
    """One checkpoint folder as ``[path]``; a manager folder as its complete checkpoints, oldest first."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such checkpoint folder")
    if _is_checkpoint_folder(path):
        if not _NAME.match(path.name) and not (path / META_FILE).exists():
            read_meta(path)  # raises: a DCP checkpoint not written by shardwise, and how to load it
        if not is_complete(path):
            raise ValueError(f"{path} is an incomplete checkpoint (a save that did not finish): no COMPLETE marker")
        return [path]
    complete, incomplete = CheckpointManager(path).scan()
    unfinished = [p for p in incomplete if p.suffix in ("", ".tmp")]
    if unfinished:
        warnings.warn(f"ignoring incomplete checkpoint folder(s): {', '.join(str(p) for p in unfinished)}",
                      stacklevel=3)
    if not complete:
        raise FileNotFoundError(f"{path} holds no complete checkpoint")
    return [complete[-1][1]] if latest_only else [p for _, p in complete]


class _Reader(dcp.FileSystemReader):
    """A file-system reader that unpickles ``.metadata`` once for many single-tensor loads."""

    _cached = None

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self._cached is None:
            self._cached = super().read_metadata(*args, **kwargs)
        return self._cached


def _model_entries(md) -> dict[str, TensorStorageMetadata]:
    return {
        key[len(MODEL_PREFIX):]: entry
        for key, entry in md.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata)
    }


def read_tensors(ckpt: str | os.PathLike, names: list[str] | None = None,
                 prefix: str = MODEL_PREFIX) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, full tensor)`` one at a time (model tensors by default), in ``names`` order."""
    ckpt = Path(ckpt)
    reader = _Reader(str(ckpt))
    md = read_dcp_metadata(ckpt, reader)
    entries = {k[len(prefix):]: e for k, e in md.state_dict_metadata.items()
               if k.startswith(prefix) and isinstance(e, TensorStorageMetadata)}
    for name in names if names is not None else sorted(entries):
        entry = entries.get(name)
        if entry is None:
            raise KeyError(f"{ckpt} holds no tensor {prefix}{name}")
        box = {prefix + name: torch.empty(entry.size, dtype=entry.properties.dtype)}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(box, storage_reader=reader, no_dist=True)
        yield name, box.pop(prefix + name)  # hold no reference while the caller uses it


# ------------------------------------------------------------------ safetensors
def parse_size(text: str | int) -> int:
    """``2GB`` (10^9), ``1.5GiB`` (2^30), ``500MB``, ``800KB``, ``1000`` (bytes) -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)\s*", str(text).lower())
    if not match:
        raise ValueError(f"size {text!r}: use a number of bytes or a number with KB/MB/GB (or KiB/MiB/GiB)")
    number, unit = float(match.group(1)), match.group(2).rstrip("b")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}[unit]
    size = int(number * scale)
    if size < 1:
        raise ValueError(f"size {text!r} must be at least one byte")
    return size


def _header(entries: list[tuple[str, torch.Size, torch.dtype]], metadata: dict[str, str]) -> bytes:
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in entries:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def split_by_size(entries: list[tuple[str, tuple, torch.dtype]], limit: int | None) -> list[list[int]]:
    """Indices of ``entries`` per file, in order, each file at most ``limit`` bytes (a bigger tensor alone)."""
    shards: list[list[int]] = [[]]
    size = 0
    for i, (_, shape, dt) in enumerate(entries):
        nbytes = math.prod(shape) * dt.itemsize
        if limit is not None and shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += nbytes
    return shards


def write_safetensors(path: Path, entries, tensors: Iterator[tuple[str, torch.Tensor]], metadata: dict) -> None:
    """Write one safetensors file: the header from ``entries``, then each ``(name, tensor)`` as it arrives."""
    header = _header(entries, metadata)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        expected = iter(entries)
        # No zip/enumerate over tensors: they keep the previous item alive during the next read.
        for got, tensor in tensors:
            name, shape, dtype = next(expected)
            if got != name or tuple(tensor.shape) != tuple(shape):
                raise AssertionError(f"streamed {got} {tuple(tensor.shape)}, header says {name} {tuple(shape)}")
            tensor = tensor.to(dtype).contiguous()
            if tensor.numel():
                f.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
            del tensor
    os.replace(tmp, path)


def export_safetensors(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                       max_shard_size: int | str | None = None, include_tied: bool = True,
                       verify: bool = True) -> list[Path]:
    """Write the checkpoint's model as safetensors; return the files written (index json last).

    ``out`` ending in ``.safetensors`` names the file; otherwise it is a folder
    that gets ``model.safetensors``. When ``max_shard_size`` splits the model,
    the shards are ``<stem>-00001-of-0000N.safetensors`` next to it plus
    ``<name>.index.json`` (Hugging Face's layout). ``dtype`` casts floating
    tensors. Every key of the model's ``state_dict()`` is written, tied
    weights under each of their names; with ``include_tied=False`` a tied
    weight is written once, under its first name, as Hugging Face does (its
    other names are in the metadata, ``shardwise_tied``). ``verify`` checks
    every file's sha256 first (one more read of the checkpoint).
    """
    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    if verify:
        report = verify_checkpoint(ckpt)
        if not report["ok"]:
            problems = report["problems"]
            raise CheckpointCorruptError(problems[0] if len(problems) == 1 and problems[0].startswith("checkpoint")
                                         else f"checkpoint {ckpt} is damaged: {'; '.join(problems)}", ckpt)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    out = Path(out)
    if out.suffix != ".safetensors" and out.exists() and not out.is_dir():
        raise ValueError(f"{out} is an existing file, not a folder: give a folder (it gets model.safetensors) or a "
                         f"file name ending in .safetensors")
    target = out if out.suffix == ".safetensors" else out / "model.safetensors"
    target.parent.mkdir(parents=True, exist_ok=True)

    md = read_dcp_metadata(ckpt, _Reader(str(ckpt)))
    saved = _model_entries(md)
    tied = {a: c for a, c in (meta.get("tied") or {}).items() if c in saved}
    names = sorted(saved)
    # (output name, source name) in file order
    plan = [(n, n) for n in names] + ([(a, c) for a, c in sorted(tied.items())] if include_tied else [])

    def out_dtype(source: str) -> torch.dtype:
        src = saved[source].properties.dtype
        return dtype if dtype is not None and src.is_floating_point else src

    entries = [(name, saved[src].size, out_dtype(src)) for name, src in plan]
    shards = split_by_size(entries, limit)
    metadata = {"format": "pt", "shardwise_step": str(meta.get("step")), "shardwise_tied": json.dumps(tied)}
    if len(shards) == 1:
        files = [target]
    else:
        stem = target.name[: -len(".safetensors")]
        files = [target.with_name(f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors") for i in range(len(shards))]

    def stream(indices):
        names = iter([plan[i][0] for i in indices])
        for _, tensor in read_tensors(ckpt, [plan[i][1] for i in indices]):
            yield next(names), tensor
            del tensor  # before the next read: one tensor in memory at a time

    written = []
    for path, indices in zip(files, shards):
        write_safetensors(path, [entries[i] for i in indices], stream(indices), metadata)
        written.append(path)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(math.prod(s) * d.itemsize for _, s, d in entries),
                         "shardwise_step": meta.get("step"), "shardwise_tied": tied},
            "weight_map": {entries[i][0]: files[k].name for k, indices in enumerate(shards) for i in indices},
        }
        index_path = target.with_name(target.name + ".index.json")
        index_path.write_text(json.dumps(index, indent=2) + "\n")
        written.append(index_path)
    return written


# ------------------------------------------------------------------------ info
def checkpoint_info(ckpt: str | os.PathLike) -> dict:
    """What a checkpoint holds: its ``shardwise.json`` plus sizes from the DCP metadata."""
    ckpt = resolve_checkpoint(ckpt)
    meta = read_meta(ckpt)
    md = read_dcp_metadata(ckpt, _Reader(str(ckpt)))
    model, optim = {}, {}
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        nbytes = math.prod(entry.size) * entry.properties.dtype.itemsize
        row = {"shape": list(entry.size), "dtype": str(entry.properties.dtype).removeprefix("torch."),
               "bytes": nbytes, "chunks": len(entry.chunks)}
        if key.startswith(MODEL_PREFIX):
            model[key[len(MODEL_PREFIX):]] = row
        elif key.startswith(OPTIM_PREFIX):
            optim[key[len(OPTIM_PREFIX):]] = row
    tied = {a: c for a, c in (meta.get("tied") or {}).items() if c in model}
    return {"path": str(ckpt), "meta": meta, "model": model, "tied": tied, "optimizer": optim,
            "extra": sorted(k for k in md.state_dict_metadata if k.startswith("extra/")),
            "rng": sorted(k for k in md.state_dict_metadata if k.startswith("rng/"))}


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n} B"


def format_info(info: dict) -> str:
    meta = info["meta"]
    axes = meta.get("axes") or {}
    strategy = ", ".join(f"{a}={v['strategy']} (size {v['size']})" for a, v in axes.items()) or "?"
    params = {n: r for n, r in info["model"].items() if (meta.get("tensors", {}).get(n, {}).get("kind") == "param")}
    n_params = sum(math.prod(r["shape"]) for r in params.values())
    model_bytes = sum(r["bytes"] for r in info["model"].values())
    optim_bytes = sum(r["bytes"] for r in info["optimizer"].values())
    opt = meta.get("optimizer")
    lines = [
        f"checkpoint: {info['path']}",
        f"step: {meta.get('step')}    saved: {meta.get('time')}    torch {meta.get('torch')}    "
        f"format {meta.get('format')}",
        f"world size: {meta.get('world_size')}    mesh: {meta.get('mesh', {}).get('dim_names')} "
        f"{meta.get('mesh', {}).get('shape')}",
        f"strategy: {strategy}    placements: {meta.get('placements')}",
        f"model: {len(info['model'])} tensors, {n_params:,} parameters, {_bytes(model_bytes)}"
        + (f"; {len(info['tied'])} more state_dict key(s) tied to them (exported under every name)"
           if info["tied"] else ""),
    ]
    if opt:
        keys = sorted({k for state in opt.get("state", {}).values() for k in state})
        lines.append(f"optimizer: {opt.get('class')}, {opt.get('groups')} group(s), state {keys}, "
                     f"{_bytes(optim_bytes)}")
    else:
        lines.append("optimizer: none")
    files = meta.get("files") or {}
    checksums = (f"sha256 of {len(files)} files" if files
                 else "none (written before shardwise-dcp/2: files' presence and sizes are checked)")
    lines.append(f"extra: {len(info['extra'])} rank(s)    rng: {len(info['rng'])} rank(s)    "
                 f"files: {_bytes(meta.get('files_bytes', 0))}    save time: {meta.get('save_seconds')}s")
    lines.append(f"checksums: {checksums}")
    tied = info["tied"]
    if tied:
        lines.append("tied: " + ", ".join(f"{a} -> {c}" for a, c in sorted(tied.items())))
    rows = [(name, row, None) for name, row in info["model"].items()]
    rows += [(alias, info["model"][canonical], canonical) for alias, canonical in tied.items()]
    width = max((len(n) for n, _, _ in rows), default=4)
    lines.append("")
    lines.append(f"  {'tensor':{width}s}  {'shape':>18s}  {'dtype':8s}  {'size':>10s}  saved chunks")
    for name, row, canonical in sorted(rows, key=lambda r: r[0]):
        shape = "x".join(str(s) for s in row["shape"]) or "()"
        where = f"tied to {canonical}" if canonical else str(row["chunks"])
        lines.append(f"  {name:{width}s}  {shape:>18s}  {row['dtype']:8s}  {_bytes(row['bytes']):>10s}  {where}")
    return "\n".join(lines)
