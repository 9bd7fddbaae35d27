"""Token data for ``shardwise train``: corpora and a deterministic, resumable loader.

Sources (all give a 1-D array of token ids):

* default: the Python standard library's own ``.py`` files (``sysconfig``'s
  ``stdlib`` path; ``site-packages`` and test suites left out), sorted by path,
  concatenated as raw bytes -- about 10 MB of byte tokens, vocab 256, no download;
* a text file, or a folder of text files (read recursively in sorted path order,
  files with NUL bytes in their first 8 KiB skipped as binary): UTF-8 bytes, vocab 256;
* a ``.bin`` file: pre-tokenized ids, a flat array of little-endian ``uint8``,
  ``uint16`` or ``uint32`` with no header, memory-mapped -- the format
  ``numpy.array(ids, dtype=numpy.uint32).tofile(path)`` writes. Its dtype comes
  from a sidecar ``<file>.bin.json`` (``{"dtype": "uint32", "tokens": N}``,
  written by :func:`write_tokens` and by the tokenized-text cache) when there is
  one, so it cannot be read with the wrong width; else from ``data_dtype``
  (default ``uint16``). A ``uint16`` read whose every second value is 0 is
  refused as a likely ``uint32`` file.
* text tokenized with a tokenizer (``--tokenizer``): :mod:`.tokenized` turns it
  into such a ``.bin`` (the cache), read here like any other.

The loader cuts the tokens into non-overlapping windows of ``seq_len + 1``
tokens, visits them in an order shuffled once per epoch by a seeded generator,
and hands micro-batch ``i`` of the run to the ranks as consecutive slices of the
global batch: rank r gets samples ``[i*G + r*B, i*G + (r+1)*B)`` with
``B = micro_batch_size`` and ``G = B * world_size``. Its only state is the
global sample position (plus the seed), so ``state_dict()`` taken on any rank
restores the stream exactly -- on any world size with the same global batch.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

__all__ = ["stdlib_files", "stdlib_corpus", "text_files", "load_tokens", "check_data_path", "TokenLoader", "DATA_DTYPES", "CACHE_DIR_NAME",
           "write_tokens", "sidecar_path", "bin_dtype"]

DATA_DTYPES = {"uint16": np.uint16, "uint8": np.uint8, "uint32": np.uint32}
CACHE_DIR_NAME = ".shardwise-cache"  # tokenized-text caches (:mod:`.tokenized`); never read as text data
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def _sorted_files(root: Path, suffix: str = "", skip_dirs=frozenset()) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        found += [Path(dirpath) / f for f in filenames if f.endswith(suffix)]
    return sorted(found)


def stdlib_files() -> list[Path]:
    """The standard library's ``.py`` sources (the default corpus), in sorted path order."""
    return _sorted_files(Path(sysconfig.get_paths()["stdlib"]), ".py", _SKIP_DIRS)


def stdlib_corpus() -> np.ndarray:
    """Bytes of the standard library's ``.py`` sources, in sorted path order."""
    return np.frombuffer(b"".join(f.read_bytes() for f in stdlib_files()), dtype=np.uint8)


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def text_files(root: Path) -> list[Path]:
    """The text files of a data folder in sorted path order (binary files and token caches left out)."""
    return [f for f in _sorted_files(root, skip_dirs={CACHE_DIR_NAME}) if _is_text(f)]


def sidecar_path(path: str | Path) -> Path:
    """``<file>.bin.json``: the dtype (and token count) of the headerless ``.bin`` next to it."""
    return Path(str(path) + ".json")


def write_tokens(path: str | Path, ids, dtype: str | None = None, **meta) -> Path:
    """Write ``ids`` as a ``.bin`` token file with its sidecar; ``dtype`` defaults to the narrowest that holds them."""
    ids = np.asarray(ids)
    if dtype is None:
        top = int(ids.max()) if ids.size else 0
        dtype = next(name for name in ("uint8", "uint16", "uint32") if top <= np.iinfo(DATA_DTYPES[name]).max)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(DATA_DTYPES[dtype]).max):
        raise ValueError(f"token ids {int(ids.min())}..{int(ids.max())} do not fit in {dtype}")
    path = Path(path)
    ids.astype(DATA_DTYPES[dtype]).tofile(path)
    sidecar_path(path).write_text(json.dumps({"format": "shardwise-tokens", "dtype": dtype, "tokens": int(ids.size),
                                              **meta}, indent=1) + "\n")
    return path


def bin_dtype(path: str | Path, data_dtype: str = "") -> str:
    """The dtype of ``.bin`` file ``path``: its sidecar's, else ``data_dtype`` (needed without a sidecar).

    Raises ``ValueError`` (the reason, for ``--data PATH: reason``) when the sidecar and an
    explicit ``data_dtype`` disagree, the sidecar is unreadable, or the size does not match.
    """
    path, side = Path(path), sidecar_path(path)
    size = path.stat().st_size
    if side.is_file():
        try:
            meta = json.loads(side.read_text())
            dtype = meta["dtype"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"its sidecar {side} is not a JSON object with a \"dtype\" ({e})") from None
        if dtype not in DATA_DTYPES:
            raise ValueError(f"its sidecar {side} says dtype {dtype!r}; use one of {', '.join(DATA_DTYPES)}")
        if data_dtype and data_dtype != dtype:
            raise ValueError(f"holds {dtype} tokens (its sidecar {side} says so), not --data-dtype {data_dtype}")
        tokens = meta.get("tokens")
        if tokens is not None and tokens * np.dtype(DATA_DTYPES[dtype]).itemsize != size:
            raise ValueError(f"size {size} bytes is not the {tokens} {dtype} tokens its sidecar {side} records "
                             f"(truncated or replaced?)")
        return dtype
    if not data_dtype:  # a headerless file does not say its width, and no guess is safe: uint32 ids above
        # 65,535 read as uint16 look like ordinary ids and train, wrongly, without a sign
        raise ValueError(f"has no sidecar {side.name} saying its token dtype: pass --data-dtype uint8, uint16 or "
                         f"uint32 (the dtype it was written with), or write {side.name} holding "
                         f"{{\"dtype\": \"uint32\"}} (shardwise.app.data.write_tokens writes both)")
    dtype = data_dtype
    itemsize = np.dtype(DATA_DTYPES[dtype]).itemsize
    if size == 0 or size % itemsize:
        raise ValueError(f"size {size} bytes is not a whole number of {dtype} tokens")
    if dtype == "uint16":  # uint32 ids below 65,536 read as uint16: every second value is 0
        head = np.fromfile(path, dtype=np.uint16, count=1 << 16)
        if len(head) >= 64 and not head[1::2].any() and head[0::2].any():
            raise ValueError("every second uint16 is 0: this looks like a uint32 token file; pass --data-dtype "
                             f"uint32 (or write {side.name} with {{\"dtype\": \"uint32\"}})")
    return dtype


def check_data_path(path: str | None, data_dtype: str = "") -> str | None:
    """Return why ``path`` cannot be read as training data, or ``None`` when it can."""
    if path is None:
        return None
    p = Path(path)
    if not p.exists():
        return "no such file or directory"
    if data_dtype and data_dtype not in DATA_DTYPES:
        return f"unknown --data-dtype {data_dtype!r} (use {'/'.join(DATA_DTYPES)})"
    if p.is_dir():
        if not text_files(p) and not any(f.suffix == ".parquet" for f in _sorted_files(p)):
            return "folder holds no text files"
    elif p.suffix == ".bin":
        try:
            bin_dtype(p, data_dtype)
        except ValueError as e:
            return str(e)
    elif not os.access(p, os.R_OK):
        return "file is not readable"
    elif p.suffix != ".parquet" and not _is_text(p):  # an image, an archive...: its bytes would train as text
        return ("is a binary file (NUL bytes in its first 8 KiB), not text: give a text file, a folder of them, or "
                "token ids as a .bin file (shardwise.app.data.write_tokens writes one)")
    return None


def load_tokens(path: str | None = None, data_dtype: str = "") -> np.ndarray:
    """Token ids from ``path`` (see the module docstring); the stdlib corpus when ``None``."""
    if path is None:
        return stdlib_corpus()
    p = Path(path)
    if p.is_dir():
        return np.frombuffer(b"".join(f.read_bytes() for f in text_files(p)), dtype=np.uint8)
    if p.suffix == ".bin":
        return np.memmap(p, dtype=DATA_DTYPES[bin_dtype(p, data_dtype)], mode="r")
    return np.frombuffer(p.read_bytes(), dtype=np.uint8)


class TokenLoader:
    """Deterministic micro-batches ``(inputs, targets)`` of shape ``[micro_batch_size, seq_len]``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int,
                 rank: int = 0, world_size: int = 1, seed: int = 0, device="cpu"):
        self.tokens, self.seq_len, self.batch = tokens, seq_len, micro_batch_size
        self.rank, self.world_size, self.seed, self.device = rank, world_size, seed, torch.device(device)
        self.num_windows = (len(tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"{len(tokens)} tokens are too few for one sequence of seq_len={seq_len}")
        self.position = 0  # global samples consumed so far
        self._epoch, self._order = -1, None

    def _window(self, sample: int) -> int:
        epoch, index = divmod(sample, self.num_windows)
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        return int(self._order[index])

    def __iter__(self):
        return self

    def __next__(self):
        first = self.position + self.rank * self.batch
        starts = [self._window(first + i) * self.seq_len for i in range(self.batch)]
        rows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts])
        self.position += self.batch * self.world_size
        rows = torch.from_numpy(rows).to(self.device, non_blocking=True)
        return rows[:, :-1], rows[:, 1:]

    @property
    def epoch(self) -> float:
        return self.position / self.num_windows

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed, "windows": self.num_windows}

    def load_state_dict(self, state: dict) -> None:
        """Restore the stream; a checkpoint of other data (another window count) is said in one warning."""
        self.position, self.seed = int(state["position"]), int(state["seed"])
        self._epoch, self._order = -1, None
        saved = state.get("windows")
        if saved is not None and int(saved) != self.num_windows:
            import warnings

            warnings.warn(f"the data has {self.num_windows} windows of seq_len+1 tokens where the checkpoint's had "
                          f"{saved}: the data or --seq-len changed, so the resumed order is not the straight run's")
