"""``--init-from``: fill a sharded model from a Hugging Face safetensors folder, each rank its own rows.

After ``fully_shard`` every parameter is a DTensor whose local piece is a
``torch.chunk`` shard; ``compute_local_shape_and_global_offset`` names the
block of the global tensor this rank holds, and ``safe_open(...).get_slice``
reads exactly that block from the (memory-mapped) file. So a rank reads and
holds about ``1 / world`` of the checkpoint, never the whole of it.

A parameter's *source* says where its values live in the folder: one tensor
(:class:`FileTensor`), or several assembled along a dimension (:class:`Stack`
for one-tensor-per-expert checkpoints, :class:`Cat` for fused weights such as
``gate_up_proj``). Sources read any block without reading the rest.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..engine.model_ops import is_sharded
from .mapping import gpt_hf_keys
from .models import HFCausalLM

__all__ = [
    "SafetensorsFolder",
    "Source",
    "FileTensor",
    "Stack",
    "Cat",
    "LoadStats",
    "load_sources",
    "gpt_sources",
    "hf_sources",
    "local_box",
    "init_from_folder",
]

_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}

Box = tuple  # one slice per dimension


class SafetensorsFolder:
    """The tensors of a ``save_pretrained`` folder (``model.safetensors`` or shards plus an index).

    ``read(key, box)`` maps the file, copies out just that block and unmaps it
    again, so the file pages a rank touches are released tensor by tensor
    (a handle kept open would keep every page read so far resident).
    ``whole=True`` reads every file completely into memory on open (the usual
    way, for comparison).
    """

    def __init__(self, path: str | Path, whole: bool = False):
        from safetensors import safe_open

        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path}: no such folder")
        index = sorted(self.path.glob("*.safetensors.index.json"))
        if index:
            weight_map = json.loads(index[0].read_text())["weight_map"]
            files = sorted({self.path / name for name in weight_map.values()})
        else:
            files = sorted(self.path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{self.path} holds no .safetensors file")
        self.files: dict[str, Path] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(f, framework="pt") as handle:
                for key in handle.keys():
                    self.files[key] = f
                    self._shapes[key] = tuple(handle.get_slice(key).get_shape())
        self.whole = whole
        self._loaded: dict[str, torch.Tensor] = {}
        self.bytes_read = 0
        if whole:
            for f in files:
                self._loaded.update(_read_whole_file(f))
            self.bytes_read = sum(t.numel() * t.element_size() for t in self._loaded.values())

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def keys(self) -> list[str]:
        return list(self.files)

    def shape(self, key: str) -> tuple[int, ...]:
        if key not in self._shapes:
            raise KeyError(f"{self.path} holds no tensor {key!r}")
        return self._shapes[key]

    def read(self, key: str, box: Box) -> torch.Tensor:
        if self.whole:
            return self._loaded[key][box]
        from safetensors import safe_open

        self.shape(key)
        with safe_open(self.files[key], framework="pt") as handle:
            piece = handle.get_slice(key)
            out = piece[box] if box else piece[:]
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        self._loaded.clear()


def _read_whole_file(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a file, read into memory (safetensors' default ``load_file`` maps lazily)."""
    from safetensors.torch import load, load_file

    try:
        return load_file(path, backend="pread")
    except TypeError:  # safetensors < 0.8: no backend choice
        return load(Path(path).read_bytes())


class Source:
    """Where one parameter's values live; ``read(box)`` returns that block (any dtype)."""

    shape: tuple[int, ...]

    def read(self, box: Box) -> torch.Tensor:
        raise NotImplementedError

    def keys(self) -> list[str]:
        raise NotImplementedError


@dataclass
class FileTensor(Source):
    folder: SafetensorsFolder
    key: str
    shape: tuple = ()

    def __post_init__(self):
        self.shape = self.folder.shape(self.key)

    def read(self, box: Box) -> torch.Tensor:
        return self.folder.read(self.key, box)

    def keys(self) -> list[str]:
        return [self.key]


@dataclass
class Stack(Source):
    """``torch.stack(parts)`` along a new dim 0 (e.g. one tensor per expert)."""

    parts: list[Source]
    shape: tuple = ()

    def __post_init__(self):
        inner = {p.shape for p in self.parts}
        if len(inner) != 1:
            raise ValueError(f"stacked tensors differ in shape: {sorted(inner)}")
        self.shape = (len(self.parts),) + inner.pop()

    def read(self, box: Box) -> torch.Tensor:
        rows = range(*box[0].indices(self.shape[0]))
        blocks = [self.parts[i].read(box[1:]) for i in rows]
        if not blocks:
            sub = [len(range(*s.indices(n))) for s, n in zip(box[1:], self.shape[1:])]
            return torch.empty([0] + sub)
        return torch.stack(blocks)

    def keys(self) -> list[str]:
        return [k for p in self.parts for k in p.keys()]


@dataclass
class Cat(Source):
    """``torch.cat(parts, dim)`` (e.g. a fused gate/up projection)."""

    dim: int
    parts: list[Source]
    shape: tuple = ()

    def __post_init__(self):
        first = list(self.parts[0].shape)
        first[self.dim] = sum(p.shape[self.dim] for p in self.parts)
        self.shape = tuple(first)

    def read(self, box: Box) -> torch.Tensor:
        start, stop, _ = box[self.dim].indices(self.shape[self.dim])
        blocks, offset = [], 0
        for p in self.parts:
            n = p.shape[self.dim]
            lo, hi = max(start, offset), min(stop, offset + n)
            if lo < hi or not blocks:
                sub = list(box)
                sub[self.dim] = slice(lo - offset, max(lo, hi) - offset)
                blocks.append(p.read(tuple(sub)))
            offset += n
        return torch.cat(blocks, dim=self.dim)

    def keys(self) -> list[str]:
        return [k for p in self.parts for k in p.keys()]


def local_box(p: torch.Tensor) -> tuple[Box, tuple[int, ...]]:
    """The block of the global tensor this rank holds (one slice per dim) and its shape."""
    if isinstance(p, DTensor):
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    else:
        shape, offset = tuple(p.shape), (0,) * p.dim()
    return tuple(slice(o, o + n) for o, n in zip(offset, shape)), tuple(shape)


@dataclass
class LoadStats:
    """What one rank did: seconds, bytes read from the files, peak RSS (MiB) before and after."""

    seconds: float = 0.0
    bytes_read: int = 0
    tensors: int = 0
    rss_before_mib: float = 0.0
    peak_rss_mib: float = 0.0
    unused_keys: list = field(default_factory=list)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


@torch.no_grad()
def load_sources(model: nn.Module, sources: dict[str, Source], folder: SafetensorsFolder | None = None,
                 strict: bool = True) -> LoadStats:
    """Copy each parameter's local block from its source; no communication.

    ``sources`` maps parameter names (``named_parameters()``, tied weights once)
    to sources of the same global shape. With ``strict``, a parameter without a
    source is an error naming it; file keys no source used are returned in
    ``unused_keys``. Marks the weights modified on a shardwise model.
    """
    stats = LoadStats(rss_before_mib=_peak_rss_mib())
    started = time.perf_counter()
    params = dict(model.named_parameters())
    missing = [n for n in params if n not in sources]
    if missing and strict:
        raise KeyError(f"no source in the checkpoint for {len(missing)} parameter(s): {missing[:6]}"
                       f"{'...' if len(missing) > 6 else ''}")
    wrong = [f"{n}: model {tuple(p.shape)}, checkpoint {tuple(sources[n].shape)}"
             for n, p in params.items() if n in sources and tuple(p.shape) != tuple(sources[n].shape)]
    if wrong:
        raise ValueError(f"shapes differ for {len(wrong)} parameter(s): {'; '.join(wrong[:4])}")
    for name, p in params.items():
        if name not in sources:
            continue
        box, shape = local_box(p)
        local = p.to_local() if isinstance(p, DTensor) else p
        if math.prod(shape):
            block = sources[name].read(box)
            local.copy_(block.reshape(shape))
            del block
        stats.tensors += 1
    mark = getattr(model, "mark_weights_modified", None)
    if callable(mark) and is_sharded(model):
        mark()
    if folder is not None:
        used = {k for n in params if n in sources for k in sources[n].keys()}
        stats.unused_keys = sorted(set(folder.keys()) - used)
        stats.bytes_read = folder.bytes_read
    stats.seconds = time.perf_counter() - started
    stats.peak_rss_mib = _peak_rss_mib()
    return stats


# ------------------------------------------------------------------ plans
def gpt_sources(model_config, folder: SafetensorsFolder) -> dict[str, Source]:
    """Sources for :class:`shardwise.models.GPT` parameters from a Llama / Mixtral folder."""
    by_param: dict[str, list[tuple[str, int | None]]] = {}
    for gpt_name, hf_name, expert in gpt_hf_keys(model_config):
        by_param.setdefault(gpt_name, []).append((hf_name, expert))
    missing = [hf for entries in by_param.values() for hf, _ in entries if hf not in folder]
    if missing:
        raise KeyError(f"{folder.path} lacks {len(missing)} tensor(s) a {type(model_config).__name__} of this "
                       f"shape needs: {missing[:6]}{'...' if len(missing) > 6 else ''}")
    out: dict[str, Source] = {}
    for gpt_name, entries in by_param.items():
        if entries[0][1] is None:
            out[gpt_name] = FileTensor(folder, entries[0][0])
        else:
            out[gpt_name] = Stack([FileTensor(folder, hf) for hf, _ in sorted(entries, key=lambda t: t[1])])
    return out


def _reverted_keys(hf_model, name: str, shape) -> dict[str, tuple[int, ...]] | None:
    """The file keys (and shapes) ``transformers`` saves parameter ``name`` under, or ``None``."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    try:
        out = revert_weight_conversion(hf_model, {name: torch.empty(shape, device="meta")})
    except Exception:  # an op that needs more than one tensor, or the real values
        return None
    return {k: tuple(v.shape) for k, v in out.items()}


def _converted_source(folder: SafetensorsFolder, name: str, shape, reverted: dict) -> Source | None:
    """A source for a parameter ``transformers`` stores as several tensors (one per expert, maybe fused)."""
    keys = list(reverted)
    if len(keys) == 1:
        return FileTensor(folder, keys[0]) if keys[0] in folder and folder.shape(keys[0]) == tuple(shape) else None
    if any(k not in folder for k in keys) or len(shape) < 2:
        return None
    experts = shape[0]
    if len(keys) % experts:
        return None
    fused = len(keys) // experts  # e.g. gate and up: 2; down: 1
    # revert lists the pieces pattern by pattern, expert by expert: [w1 e0..eE, w3 e0..eE]
    groups = [keys[j * experts:(j + 1) * experts] for j in range(fused)]
    parts = []
    for e in range(experts):
        pieces = [FileTensor(folder, groups[j][e]) for j in range(fused)]
        parts.append(pieces[0] if fused == 1 else Cat(0, pieces))
    try:
        source = Stack(parts)
    except ValueError:
        return None
    return source if tuple(source.shape) == tuple(shape) else None


def hf_sources(model: nn.Module, hf_model, folder: SafetensorsFolder) -> tuple[dict[str, Source], list[str]]:
    """Sources for a ``transformers`` model's parameters (``model`` holds them under HF's names).

    A parameter is read from the tensor of its own name, else from the tensors
    ``transformers`` would save it as (``save_pretrained`` turns fused expert
    weights back into one tensor per expert, Mixtral's ``mlp`` into
    ``block_sparse_moe``...). Returns the sources and the names no layout
    covered (the caller reads those some other way).
    """
    declared = getattr(hf_model, "_tied_weights_keys", None)
    tie = bool(getattr(getattr(hf_model, "config", None), "tie_word_embeddings", False))
    tied = dict(declared) if isinstance(declared, dict) and tie else {}  # {alias: canonical}
    out: dict[str, Source] = {}
    uncovered = []
    for name, p in model.named_parameters():  # a tied weight appears once, under its canonical name
        shape = tuple(p.shape)
        candidates = [name] + [alias for alias, canonical in tied.items() if canonical == name]
        hit = next((k for k in candidates if k in folder and folder.shape(k) == shape), None)
        if hit is not None:
            out[name] = FileTensor(folder, hit)
            continue
        reverted = _reverted_keys(hf_model, name, shape)
        source = _converted_source(folder, name, shape, reverted) if reverted else None
        if source is None:
            uncovered.append(name)
        else:
            out[name] = source
    return out, uncovered


def read_whole_with_transformers(folder: str | Path, names: list[str]) -> dict[str, Source]:
    """Fallback: ``from_pretrained`` the folder on this rank and serve ``names`` from memory."""
    from transformers import AutoModelForCausalLM

    warnings.warn(f"--init-from {folder}: {len(names)} parameter(s) ({names[:3]}...) are stored in a layout read "
                  f"by transformers only; every rank loads the whole checkpoint for them", stacklevel=2)
    full = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    state = dict(full.named_parameters())

    class _Memory(Source):
        def __init__(self, tensor, key):
            self.tensor, self.key, self.shape = tensor.detach(), key, tuple(tensor.shape)

        def read(self, box):
            return self.tensor[box]

        def keys(self):
            return []

    return {n: _Memory(state[n], n) for n in names}


def init_from_folder(model: nn.Module, folder: str | Path, model_cfg=None, whole: bool = False) -> LoadStats:
    """Fill a sharded (or plain) model from a ``save_pretrained`` folder, each rank its own rows.

    ``model`` is a :class:`shardwise.models.GPT` (give ``model_cfg``) or an
    :class:`HFCausalLM`. ``whole=True`` reads every file completely first (the
    usual way; for comparison).
    """
    reader = SafetensorsFolder(folder, whole=whole)
    try:
        if isinstance(model, HFCausalLM):
            sources, uncovered = hf_sources(model, model.hf_model, reader)
            if uncovered:
                sources.update(read_whole_with_transformers(folder, uncovered))
        else:
            sources = gpt_sources(model_cfg or model.config, reader)
        stats = load_sources(model, sources, reader)
    finally:
        reader.close()
    if stats.unused_keys and (not dist.is_initialized() or dist.get_rank() == 0):
        print(f"shardwise: --init-from {folder}: {len(stats.unused_keys)} tensor(s) not used: "
              f"{stats.unused_keys[:6]}{'...' if len(stats.unused_keys) > 6 else ''}", file=sys.stderr, flush=True)
    return stats
