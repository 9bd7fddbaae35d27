"""Text tokenized with the model's tokenizer, packed and cached as a ``.bin`` token file.

A *tokenizer* is a ``tokenizer.json`` file (read with the ``tokenizers`` library)
or a Hugging Face tokenizer folder (read with ``transformers.AutoTokenizer``,
which also converts a SentencePiece-only folder); either way the encoding is the
``tokenizers`` backend's, so ``encode_batch`` runs in its Rust thread pool.

*Documents* come from: a text file (one document), a ``.jsonl`` file (one per
line, the ``text_key`` string field), a ``.parquet`` file (one per row of the
``text_key`` column, read with ``pyarrow``), or a folder of any of these (sorted
path order; binary files and ``.shardwise-cache`` folders skipped). Each
document is encoded with the tokenizer's own special tokens (a Llama BOS, say)
and followed by one EOS, unless its encoding already ends with it; the documents
are concatenated in order -- the stream :class:`shardwise.app.data.TokenLoader`
cuts into ``seq_len + 1`` windows. Empty documents are skipped.

The result is written once into ``<cache dir>/<data name>.<key>.bin`` with its
sidecar (:func:`shardwise.app.data.write_tokens`' format; ``uint16`` when the
vocabulary fits, else ``uint32``) and memory-mapped from then on. ``key`` hashes
the tokenizer (its serialized JSON and EOS id), the text field and every input
file's path, size and modification time, so another tokenizer or changed data
gets another file. The sidecar is renamed into place last: a build that died
leaves no cache that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .data import CACHE_DIR_NAME, DATA_DTYPES, _is_text, _sorted_files, bin_dtype, sidecar_path

__all__ = ["Tokenizer", "load_tokenizer", "load_backend", "tokenizer_in_folder", "input_files", "cache_file", "cached_tokens",
           "build_cache", "TokenizeError", "CACHE_VERSION"]

CACHE_VERSION = 1
_EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")  # bare tokenizer.json
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_BATCH_DOCS, _BATCH_BYTES = 512, 4 << 20  # one encode_batch call: work for every thread, a bar that moves


class TokenizeError(ValueError):
    """A tokenizer or input that cannot be used: the reason, for ``--flag value: reason``."""


@dataclass
class Tokenizer:
    """What tokenizing needs: the ``tokenizers`` backend, the EOS id, the vocabulary, a fingerprint."""

    path: str
    backend: object  # tokenizers.Tokenizer
    eos_id: int
    eos_token: str
    vocab_size: int  # with added tokens: the largest id + 1 it can produce
    fingerprint: str

    def encode_documents(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids (the tokenizer's special tokens included), then EOS unless it already ends so."""
        out = []
        # encode_batch_fast (tokenizers >= 0.21) skips the character offsets, which packing does not use
        encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
        for encoding in encode(texts, add_special_tokens=True):
            ids = encoding.ids
            if not ids or ids[-1] != self.eos_id:
                ids.append(self.eos_id)
            out.append(ids)
        return out


def tokenizer_in_folder(folder: str | Path) -> str | None:
    """``folder`` when it holds a Hugging Face tokenizer (the default ``--tokenizer`` of ``--init-from``)."""
    folder = Path(folder)
    if folder.is_file():
        folder = folder.parent  # --hf-config may name the config.json
    return str(folder) if folder.is_dir() and any((folder / f).is_file() for f in _TOKENIZER_FILES) else None


def _eos_from_config(folder: Path) -> str | None:
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        try:
            eos = json.loads((folder / name).read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and eos:
            return eos
    return None


def load_backend(path: str) -> tuple[object, str | None]:
    """``(tokenizers backend, the tokenizer's own EOS or None)`` of a tokenizer.json file or tokenizer folder."""
    p = Path(path)
    if not p.exists():
        raise TokenizeError("no such file or folder (a tokenizer.json file or a Hugging Face tokenizer folder)")
    if p.is_dir():
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise TokenizeError("a tokenizer folder is read with transformers, which is not installed: pip install "
                                "'shardwise[hf]' (or give the folder's tokenizer.json file)") from None
        try:
            hf = AutoTokenizer.from_pretrained(str(p))
        except Exception as e:  # noqa: BLE001 -- transformers raises many kinds; the user needs the text
            raise TokenizeError(f"transformers cannot load a tokenizer from it ({type(e).__name__}: "
                                f"{str(e).splitlines()[0] if str(e) else ''})") from None
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            raise TokenizeError(f"{type(hf).__name__} has no fast (tokenizers) backend")
        default_eos = hf.eos_token
    else:
        try:
            from tokenizers import Tokenizer as Backend
        except ImportError:
            raise TokenizeError("a tokenizer.json file is read with tokenizers, which is not installed: pip install "
                                "'shardwise[data]'") from None
        try:
            backend = Backend.from_file(str(p))
        except Exception as e:  # noqa: BLE001 -- a Rust error with the reason
            raise TokenizeError(f"not a tokenizers JSON file ({str(e).splitlines()[0] if str(e) else e})") from None
        default_eos = _eos_from_config(p.parent)
        if default_eos is None:
            special = {t.content for t in backend.get_added_tokens_decoder().values() if t.special}
            default_eos = next((name for name in _EOS_NAMES if name in special), None)
    return backend, default_eos


def load_tokenizer(path: str, eos_token: str = "") -> Tokenizer:
    """The tokenizer at ``path``; ``TokenizeError`` saying why it cannot be used.

    The EOS is ``eos_token`` when given, else the tokenizer's own (a folder's
    ``eos_token``; for a bare ``tokenizer.json``, a ``tokenizer_config.json``
    beside it, else the first of the usual EOS names among its special tokens).
    """
    p = Path(path)
    backend, default_eos = load_backend(path)
    eos = eos_token or default_eos
    if not eos:
        raise TokenizeError("has no EOS token to separate documents; name one with --eos-token")
    eos_id = backend.token_to_id(eos)
    if eos_id is None:
        raise TokenizeError(f"has no token {eos!r} (the EOS{' of --eos-token' if eos_token else ''})")
    serialized = backend.to_str()
    fingerprint = hashlib.sha256(f"{serialized}\0{eos_id}".encode()).hexdigest()
    return Tokenizer(str(p.resolve()), backend, eos_id, eos, backend.get_vocab_size(with_added_tokens=True),
                     fingerprint)


# ------------------------------------------------------------------ documents
def input_files(path: Path) -> list[Path]:
    """The files whose documents make up ``path`` (a file, or a folder's files in sorted order)."""
    if not path.is_dir():
        return [path]
    return [f for f in _sorted_files(path, skip_dirs={CACHE_DIR_NAME})
            if f.suffix in (".jsonl", ".parquet") or (not f.name.endswith((".bin", ".bin.json")) and _is_text(f))]


def _jsonl_documents(path: Path, text_key: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise TokenizeError(f"{path} line {number}: not JSON ({e})") from None
            text = row.get(text_key) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise TokenizeError(f"{path} line {number}: no string field {text_key!r} (--text-key)")
            yield text


def _parquet_documents(path: Path, text_key: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TokenizeError(f"{path}: .parquet files are read with pyarrow, which is not installed: pip install "
                            f"'shardwise[data]'") from None
    try:
        parquet = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 -- pyarrow's ArrowInvalid and friends
        raise TokenizeError(f"{path}: not a parquet file ({e})") from None
    names = parquet.schema_arrow.names
    if text_key not in names:
        raise TokenizeError(f"{path}: no column {text_key!r} (--text-key); it has {', '.join(names)}")
    for batch in parquet.iter_batches(columns=[text_key], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None and not isinstance(text, str):
                raise TokenizeError(f"{path}: column {text_key!r} holds {type(text).__name__}, not text")
            yield text or ""


def _documents(path: Path, text_key: str) -> Iterator[str]:
    if path.suffix == ".jsonl":
        yield from _jsonl_documents(path, text_key)
    elif path.suffix == ".parquet":
        yield from _parquet_documents(path, text_key)
    else:
        try:
            yield path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise TokenizeError(f"{path} is not UTF-8 text (byte {e.start})") from None


# ------------------------------------------------------------------ the cache
def _data_key(files: list[Path], root: Path, tokenizer: Tokenizer, text_key: str) -> str:
    stats = []
    for f in files:
        st = f.stat()
        stats.append([str(f.relative_to(root)) if f != root else f.name, st.st_size, st.st_mtime_ns])
    blob = json.dumps({"version": CACHE_VERSION, "tokenizer": tokenizer.fingerprint, "text_key": text_key,
                       "files": stats})
    return hashlib.sha256(blob.encode()).hexdigest()


def cache_file(data: str | Path, files: list[Path], tokenizer: Tokenizer, text_key: str, cache_dir: str | Path) -> Path:
    """Where the tokens of ``data`` (made of ``files``) with ``tokenizer`` are cached."""
    root = Path(data)
    name = root.resolve().name or "data"
    return Path(cache_dir) / f"{name}.{_data_key(files, root, tokenizer, text_key)[:16]}.bin"


def cached_tokens(path: Path) -> np.ndarray | None:
    """The cached tokens at ``path`` memory-mapped, or ``None`` when there is no complete cache."""
    if not sidecar_path(path).is_file() or not path.is_file():
        return None
    try:
        dtype = bin_dtype(path)
    except ValueError:
        return None
    return np.memmap(path, dtype=DATA_DTYPES[dtype], mode="r")


def build_cache(files: list[Path], tokenizer: Tokenizer, text_key: str, out: Path, label: str,
                progress: bool = True) -> np.ndarray:
    """Tokenize ``files`` into the cache ``out`` (atomically) and return it memory-mapped.

    Batches of documents go to the backend's ``encode_batch`` (all cores); the bar counts the
    input's bytes. Raises :class:`TokenizeError` for unusable input or an unwritable cache folder.
    """
    from tqdm import tqdm

    dtype = "uint16" if tokenizer.vocab_size <= 1 << 16 else "uint32"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        handle = open(tmp, "wb")
    except OSError as e:
        raise TokenizeError(f"cannot write the token cache in {out.parent} ({e.strerror or e}); "
                            f"--data-cache DIR puts it elsewhere") from None
    tqdm.set_lock(threading.RLock())  # not tqdm's default multiprocessing lock (a named semaphore)
    total = sum(f.stat().st_size for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing {label}", disable=not progress,
               file=sys.stderr, mininterval=0.5, dynamic_ncols=True)
    tokens = documents = 0
    try:
        with handle:
            batch, batch_chars, done = [], 0, 0  # done: bytes of the files finished

            def flush(read: int):
                nonlocal tokens, documents
                for ids in tokenizer.encode_documents(batch):
                    handle.write(np.asarray(ids, dtype=DATA_DTYPES[dtype]).tobytes())
                    tokens += len(ids)
                documents += len(batch)
                batch.clear()
                bar.update(max(0, read - bar.n))  # characters stand in for bytes within a file

            for f in files:
                size, chars = f.stat().st_size, 0
                for text in _documents(f, text_key):
                    if not text:
                        continue
                    batch.append(text)
                    batch_chars += len(text)
                    chars += len(text)
                    if len(batch) >= _BATCH_DOCS or batch_chars >= _BATCH_BYTES:
                        flush(done + min(chars, size))
                        batch_chars = 0
                done += size
                bar.update(max(0, done - bar.n))
            if batch:
                flush(done)
        if tokens == 0:
            raise TokenizeError(f"{label} holds no documents (every one is empty)")
        meta = {"format": "shardwise-tokens", "dtype": dtype, "tokens": tokens, "documents": documents,
                "eos_id": tokenizer.eos_id, "eos_token": tokenizer.eos_token, "vocab_size": tokenizer.vocab_size,
                "tokenizer": tokenizer.path, "data": label, "text_key": text_key, "files": len(files)}
        side_tmp = sidecar_path(tmp)
        side_tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, out)
        os.replace(side_tmp, sidecar_path(out))  # last: the cache is complete only once this exists
    except BaseException:
        for leftover in (tmp, sidecar_path(tmp)):
            leftover.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    return cached_tokens(out)
