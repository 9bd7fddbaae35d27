"""Token data for ``shardwise train``: corpora and a deterministic, resumable loader.

Sources (all give a 1-D array of token ids):

* default: the Python standard library's own ``.py`` files (``sysconfig``'s
  ``stdlib`` path; ``site-packages`` and test suites left out), sorted by path,
  concatenated as raw bytes -- about 10 MB of byte tokens, vocab 256, no download;
* a text file, or a folder of text files (read recursively in sorted path order,
  files with NUL bytes in their first 8 KiB skipped as binary): UTF-8 bytes, vocab 256;
* a ``.bin`` file: pre-tokenized ids, a flat array of little-endian ``uint16``
  (default) or ``uint8`` (``data_dtype``) with no header, memory-mapped -- the
  format ``numpy.array(ids, dtype=numpy.uint16).tofile(path)`` writes.

The loader cuts the tokens into non-overlapping windows of ``seq_len + 1``
tokens, visits them in an order shuffled once per epoch by a seeded generator,
and hands micro-batch ``i`` of the run to the ranks as consecutive slices of the
global batch: rank r gets samples ``[i*G + r*B, i*G + (r+1)*B)`` with
``B = micro_batch_size`` and ``G = B * world_size``. Its only state is the
global sample position (plus the seed), so ``state_dict()`` taken on any rank
restores the stream exactly -- on any world size with the same global batch.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

__all__ = ["stdlib_corpus", "load_tokens", "check_data_path", "TokenLoader", "DATA_DTYPES"]

DATA_DTYPES = {"uint16": np.uint16, "uint8": np.uint8}
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def _sorted_files(root: Path, suffix: str = "", skip_dirs=frozenset()) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs]
        found += [Path(dirpath) / f for f in filenames if f.endswith(suffix)]
    return sorted(found)


def stdlib_corpus() -> np.ndarray:
    """Bytes of the standard library's ``.py`` sources, in sorted path order."""
    files = _sorted_files(Path(sysconfig.get_paths()["stdlib"]), ".py", _SKIP_DIRS)
    return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(8192)


def check_data_path(path: str | None, data_dtype: str = "uint16") -> str | None:
    """Return why ``path`` cannot be read as training data, or ``None`` when it can."""
    if path is None:
        return None
    p = Path(path)
    if not p.exists():
        return "no such file or directory"
    if data_dtype not in DATA_DTYPES:
        return f"unknown --data-dtype {data_dtype!r} (use {'/'.join(DATA_DTYPES)})"
    if p.is_dir():
        if not any(_is_text(f) for f in _sorted_files(p)):
            return "folder holds no text files"
    elif p.suffix == ".bin":
        size = np.dtype(DATA_DTYPES[data_dtype]).itemsize
        if p.stat().st_size == 0 or p.stat().st_size % size:
            return f"size {p.stat().st_size} bytes is not a whole number of {data_dtype} tokens"
    elif not os.access(p, os.R_OK):
        return "file is not readable"
    return None


def load_tokens(path: str | None = None, data_dtype: str = "uint16") -> np.ndarray:
    """Token ids from ``path`` (see the module docstring); the stdlib corpus when ``None``."""
    if path is None:
        return stdlib_corpus()
    p = Path(path)
    if p.is_dir():
        files = [f for f in _sorted_files(p) if _is_text(f)]
        return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
    if p.suffix == ".bin":
        return np.memmap(p, dtype=DATA_DTYPES[data_dtype], mode="r")
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
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        self.position, self.seed = int(state["position"]), int(state["seed"])
        self._epoch, self._order = -1, None
