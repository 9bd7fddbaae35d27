"""What one ``shardwise train`` run trains and evaluates on: token arrays from the data flags.

* ``--data`` / ``--eval-data``: bytes (the stdlib corpus, text), a ``.bin`` of ids
  (:mod:`.data`), or text tokenized with ``--tokenizer`` (:mod:`.tokenized`):
  once a tokenizer is in effect, every text input is tokenized with it (the
  stdlib corpus too, one document per file). ``.bin`` inputs are ids already.
* The tokenizer defaults to the ``--init-from`` / ``--hf-config`` folder's when it
  holds one (``--tokenizer bytes`` keeps byte tokens). Its vocabulary must fit
  the model's; a model built from scratch (no ``--vocab-size`` given) takes it.
* ``--eval-fraction F`` holds out the last ``ceil(F x tokens)`` tokens of
  ``--data`` (as Megatron's split holds out the tail): the training windows
  never touch them.
* Caches are built once: by the launching process before any worker starts, or
  under ``torchrun`` by rank 0 while the others wait in a barrier that allows
  for a long build (:data:`BUILD_WAIT_S`); then every rank memory-maps them.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import sysconfig
from dataclasses import replace
from pathlib import Path

import numpy as np

from .data import CACHE_DIR_NAME, check_data_path, load_tokens, sidecar_path, stdlib_files, text_files
from .errors import ConfigError  # the app's one error type for settings
from .tokenized import (TokenizeError, Tokenizer, build_cache, cache_file, cached_tokens, input_files, load_backend,
                        load_tokenizer, tokenizer_in_folder)

__all__ = ["BYTES", "BUILD_WAIT_S", "check_flags", "resolve_tokenizer", "check_world", "open_data", "split_eval",
           "describe_coverage"]

BYTES = "bytes"  # --tokenizer bytes: UTF-8 bytes (vocab 256), also when the --init-from folder has a tokenizer
BUILD_WAIT_S = 24 * 3600.0  # how long ranks wait for rank 0 to tokenize (a dead rank 0 fails them at once)


def _error(flag: str, value, why: str):
    return ConfigError(flag, value, why)


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"shardwise train: {message}", file=sys.stderr, flush=True)


def _is_tokens_file(path: str) -> bool:
    return Path(path).suffix == ".bin"


def _tokenizer_path(cfg) -> str | None:
    return cfg.tokenizer if cfg.tokenizer and cfg.tokenizer != BYTES else None


def _sources(cfg) -> list[tuple[str, str | None]]:
    """``(flag, path)`` of every input: ``--data`` (``None``: the stdlib corpus), then ``--eval-data``."""
    sources = [("data", cfg.data or None)]
    if cfg.eval_data:
        sources.append(("eval_data", cfg.eval_data))
    return sources


def _tokenized(cfg, path: str | None) -> bool:
    return _tokenizer_path(cfg) is not None and not (path and _is_tokens_file(path))


# ------------------------------------------------------------------ before any process starts
def check_flags(cfg) -> None:
    """The data and evaluation flags on their own (no file is read beyond a stat)."""
    if not 0 <= cfg.eval_fraction < 1:
        raise _error("eval_fraction", cfg.eval_fraction, "must be a fraction in [0, 1)")
    for name in ("eval_every", "eval_batches"):
        if getattr(cfg, name) < 0:
            raise _error(name, getattr(cfg, name), "must not be negative")
    if cfg.eval_data and cfg.eval_fraction:
        raise _error("eval_fraction", cfg.eval_fraction, "cannot be combined with --eval-data (one held-out set)")
    if cfg.eval_every and not (cfg.eval_data or cfg.eval_fraction):
        raise _error("eval_every", cfg.eval_every, "needs --eval-data PATH or --eval-fraction F (what to evaluate)")
    if cfg.eval_data:
        why = check_data_path(cfg.eval_data, cfg.data_dtype)
        if why:
            raise _error("eval_data", cfg.eval_data, why)
        if _within(cfg.eval_data, cfg.data):
            _say(f"warning: --eval-data {cfg.eval_data} is {'part of ' if Path(cfg.data).is_dir() else ''}the "
                 f"training data (--data {cfg.data}): its eval loss measures how well the run memorised what it "
                 f"trained on, not how it does on unseen text; --eval-fraction F holds out the end of --data instead")
    if cfg.tokenizer and cfg.tokenizer != BYTES and not Path(cfg.tokenizer).exists():
        raise _error("tokenizer", cfg.tokenizer, "no such file or folder (a tokenizer.json file or a Hugging Face "
                                                 "tokenizer folder; 'bytes' for byte tokens)")
    if cfg.tokenizer and cfg.tokenizer != BYTES and cfg.data and _is_tokens_file(cfg.data) and (
            not cfg.eval_data or _is_tokens_file(cfg.eval_data)):
        raise _error("tokenizer", cfg.tokenizer, f"--data {cfg.data} is a .bin of token ids already (nothing to "
                                                 f"tokenize); drop --tokenizer")


def _within(path: str, data: str) -> bool:
    """Whether ``path`` is the file ``data`` or lies in the folder ``data`` (the default corpus: never)."""
    if not data:
        return False
    inner, outer = Path(path).resolve(), Path(data).resolve()
    return inner == outer or (outer.is_dir() and outer in inner.parents)


def resolve_tokenizer(cfg, model, explicit: dict):
    """Settle ``cfg.tokenizer`` (the folder's default) and check it against the model; the model config to use.

    Sets ``cfg.tokenizer`` to the path in effect, or ``"bytes"`` when text trains as bytes, so
    that the workers and ``config.json`` see what was used.
    """
    if cfg.tokenizer and cfg.init_from:
        _warn_foreign_tokenizer(cfg)
    if not cfg.tokenizer:
        folder = tokenizer_in_folder(cfg.init_from or cfg.hf_config) if (cfg.init_from or cfg.hf_config) else None
        text_inputs = any(path is None or not _is_tokens_file(path) for _, path in _sources(cfg))
        if folder and text_inputs:
            cfg.tokenizer = folder
            _say(f"--tokenizer {folder}: the tokenizer of the --{'init-from' if cfg.init_from else 'hf-config'} "
                 f"folder (--tokenizer bytes trains on UTF-8 bytes instead)")
        else:
            cfg.tokenizer = BYTES
    path = _tokenizer_path(cfg)
    if cfg.eos_token and path is None:
        raise _error("eos_token", cfg.eos_token, "needs --tokenizer (text trains as bytes, with no EOS)")
    if path is None:
        for flag, source in _sources(cfg):
            if source and Path(source).suffix in (".jsonl", ".parquet"):
                raise _error(flag, source, f"{Path(source).suffix} documents are read with a tokenizer: add "
                                           f"--tokenizer PATH (byte tokens come from text files)")
            if source and Path(source).is_dir() and not text_files(Path(source)):
                raise _error(flag, source, "holds only .parquet files, whose documents are read with a tokenizer: "
                                           "add --tokenizer PATH")
        return model
    tokenizer = _load(cfg)
    if not (cfg.init_from or cfg.hf_config) and "vocab_size" not in explicit:
        if tokenizer.vocab_size != model.vocab_size:
            _say(f"--vocab-size {tokenizer.vocab_size} (from --tokenizer {path}; --vocab-size N overrides)")
        return replace(model, vocab_size=tokenizer.vocab_size)
    if tokenizer.vocab_size > model.vocab_size:
        whose = "--vocab-size" if "vocab_size" in explicit and not (cfg.init_from or cfg.hf_config) else \
            f"the {'--init-from' if cfg.init_from else '--hf-config'} config's vocab_size"
        raise _error("tokenizer", path, f"has {tokenizer.vocab_size:,} tokens but the model's vocabulary is "
                                        f"{model.vocab_size:,} ({whose}): its ids would not fit")
    return model


def _warn_foreign_tokenizer(cfg) -> None:
    """One warning when ``--tokenizer`` is not the ``--init-from`` folder's own: the pretrained embedding rows
    were learnt for that tokenizer's ids, so every id would start from another token's row."""
    folder = tokenizer_in_folder(cfg.init_from)
    if cfg.tokenizer == BYTES:
        other = "--tokenizer bytes (UTF-8 byte ids 0-255)"
    elif folder is None:
        return  # the folder has no tokenizer to compare with
    else:
        try:
            vocabularies = [load_backend(path)[0].get_vocab(with_added_tokens=True) for path in (cfg.tokenizer, folder)]
            if vocabularies[0] == vocabularies[1]:  # the same ids for the same tokens: the same embeddings apply
                return
        except TokenizeError:
            return  # the unusable one is refused with its reason where it is loaded
        other = f"--tokenizer {cfg.tokenizer}"
    theirs = f"its own tokenizer ({folder})" if folder else "the tokenizer it was trained with"
    _say(f"warning: {other} is not the tokenizer of --init-from {cfg.init_from}: its pretrained embeddings were "
         f"learnt for the ids of {theirs}, so each id starts from another token's embedding; drop --tokenizer to "
         f"use the folder's")


def _load(cfg) -> Tokenizer:
    try:
        return load_tokenizer(_tokenizer_path(cfg), cfg.eos_token)
    except TokenizeError as e:
        raise _error("tokenizer", cfg.tokenizer, str(e)) from None


def _cache_dir(cfg, path: str | None) -> Path:
    if cfg.data_cache:
        return Path(cfg.data_cache)
    if path is None:  # the stdlib corpus: the user's cache folder, not the Python installation
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "shardwise"
    return Path(path).resolve().parent / CACHE_DIR_NAME


def _files(path: str | None) -> list[Path]:
    return stdlib_files() if path is None else input_files(Path(path))


def _tokens(cfg, tokenizer: Tokenizer | None, flag: str, path: str | None, build: bool,
            progress: bool) -> np.ndarray | None:
    """The token ids of one input; for tokenized text, the cache (built when ``build``; else ``None`` if absent)."""
    if not _tokenized(cfg, path):
        return load_tokens(path, cfg.data_dtype)
    files = _files(path)
    label = path or "(stdlib)"
    if not files:
        raise _error(flag, label, "holds no text, .jsonl or .parquet files")
    root = path or sysconfig.get_paths()["stdlib"]  # the stdlib corpus: its files relative to the stdlib
    out = cache_file(root, files, tokenizer, cfg.text_key, _cache_dir(cfg, path))
    tokens = cached_tokens(out)
    if tokens is not None or not build:
        return tokens
    try:
        tokens = build_cache(files, tokenizer, cfg.text_key, out, label, progress=progress)
    except TokenizeError as e:
        raise _error(flag, label, str(e)) from None
    meta = f"{len(tokens):,} tokens"
    _say(f"--{flag.replace('_', '-')} {label}: tokenized with {tokenizer.path} into {out} ({meta})")
    return tokens


def split_eval(tokens: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray | None]:
    """(training tokens, held-out tokens): the last ``ceil(fraction x len)`` tokens are held out."""
    if not fraction:
        return tokens, None
    held = math.ceil(fraction * len(tokens))
    return tokens[:len(tokens) - held], tokens[len(tokens) - held:]


def _check_ids(model, flag: str, where: str, tokens: np.ndarray) -> None:
    if len(tokens) and int(tokens.max()) >= model.vocab_size and tokens.dtype.itemsize > 1 and \
            _is_tokens_file(where) and not sidecar_path(where).is_file():
        for narrower in (np.uint16, np.uint8)[{2: 1, 4: 0}[tokens.dtype.itemsize]:]:  # the widest first
            view = np.asarray(tokens).view(narrower)
            if int(view.max()) < model.vocab_size:  # read as narrower ids, every one fits: it was written so
                name = np.dtype(narrower).name
                raise _error("data_dtype", tokens.dtype.name, f"{where} read as {tokens.dtype.name} holds id "
                             f"{int(tokens.max()):,}, past the vocabulary ({model.vocab_size:,}), but read as "
                             f"{name} every id fits: it was written as {name}; pass --data-dtype {name}")
    if len(tokens) and int(tokens.max()) >= model.vocab_size:
        raise _error("vocab_size", model.vocab_size, f"{'data' if flag == 'data' else '--eval-data'} {where} "
                                                     f"holds token id {int(tokens.max())}")


def _check_lengths(cfg, train: np.ndarray, held: np.ndarray | None) -> None:
    label = cfg.data or "(stdlib)"
    if cfg.eval_fraction and held is not None and len(held) <= cfg.seq_len:
        raise _error("eval_fraction", cfg.eval_fraction, f"holds out {len(held)} of the {len(train) + len(held)} "
                     f"tokens of {label}, too few for one window of --seq-len {cfg.seq_len}")
    if len(train) <= cfg.seq_len:
        raise _error("data", label, f"{len(train)} tokens{' left for training' if cfg.eval_fraction else ''}, "
                                    f"too few for --seq-len {cfg.seq_len}")
    if cfg.eval_data and held is not None and len(held) <= cfg.seq_len:
        raise _error("eval_data", cfg.eval_data, f"{len(held)} tokens, too few for --seq-len {cfg.seq_len}")


def check_world(cfg, model, build: bool) -> None:
    """Checks that read the data, before any process group: lengths, ids against the vocabulary.

    With ``build`` (the launching process, before it starts the workers) tokenized inputs are
    tokenized into their caches now, so a bad file fails here and the workers find the cache.
    Without it (each process under ``torchrun``) inputs not cached yet are checked by the workers.
    Tokenized ids are below the tokenizer's vocabulary, which :func:`resolve_tokenizer` checked.
    """
    tokenizer = _load(cfg) if any(_tokenized(cfg, p) for _, p in _sources(cfg)) else None
    arrays = {}
    for flag, path in _sources(cfg):
        arrays[flag] = _tokens(cfg, tokenizer, flag, path, build, progress=True)
        if arrays[flag] is not None and not _tokenized(cfg, path):
            _check_ids(model, flag, path or "(stdlib)", arrays[flag])
    if all(tokens is not None for tokens in arrays.values()):
        train, held = split_eval(arrays["data"], cfg.eval_fraction)
        _check_lengths(cfg, train, arrays.get("eval_data", held))


def _wait_for_rank0(timeout_s: float) -> None:
    """Barrier with a long timeout (rank 0 may be tokenizing); the groups get ``timeout_s`` back after."""
    import torch.distributed as dist

    group = dist.group.WORLD
    group.set_timeout(datetime.timedelta(seconds=BUILD_WAIT_S))
    try:
        dist.barrier()
    finally:
        group.set_timeout(datetime.timedelta(seconds=timeout_s))


def open_data(cfg, rank: int, world: int) -> tuple[np.ndarray, np.ndarray | None]:
    """(training tokens, held-out tokens or ``None``) on every rank; rank 0 builds missing caches."""
    tokenized = [(flag, path) for flag, path in _sources(cfg) if _tokenized(cfg, path)]
    tokenizer = _load(cfg) if tokenized else None
    if tokenized and rank == 0:
        for flag, path in tokenized:
            _tokens(cfg, tokenizer, flag, path, build=True, progress=True)
    if tokenized and world > 1:
        _wait_for_rank0(cfg.timeout)
    arrays = {}
    for flag, path in _sources(cfg):
        arrays[flag] = _tokens(cfg, tokenizer, flag, path, build=False, progress=False)
        if arrays[flag] is None:
            raise _error(flag, path or "(stdlib)", f"rank {rank} does not see the token cache rank 0 wrote in "
                         f"{_cache_dir(cfg, path)} (a node-local folder?); --data-cache DIR on a file system every "
                         f"node sees")
    train, held = split_eval(arrays["data"], cfg.eval_fraction)
    held = arrays.get("eval_data", held)
    _check_lengths(cfg, train, held)
    return train, held


def describe_coverage(cfg, tokens: int, windows: int, global_batch: int) -> str:
    """The start line naming the corpus and the share of it the run trains on; a warning when it repeats
    (``global_batch``: sequences per step, each one window of ``seq_len + 1`` tokens)."""
    corpus = f"--data {cfg.data}" if cfg.data else \
        "the Python standard library's .py sources (the default; --data PATH for yours)"
    how = f"tokenizer {cfg.tokenizer}" if _tokenized(cfg, cfg.data or None) else \
        "token ids" if cfg.data and _is_tokens_file(cfg.data) else "UTF-8 bytes"
    held = " left after --eval-fraction" if cfg.eval_fraction else ""
    needed = cfg.steps * global_batch
    epochs = needed / windows
    line = (f"data: {corpus} ({how}): {tokens:,} tokens{held}, {windows:,} windows of {cfg.seq_len + 1} tokens; "
            f"--steps {cfg.steps} x {global_batch} sequences = {needed:,} windows, ")
    if epochs <= 1:
        share = f"{epochs:.1%}" if epochs >= 0.001 else f"{100 * epochs:.2g}%"  # 2.1%, 0.028%
        return line + f"{share} of it (each window at most once)"
    one_step = " (one step alone takes more windows than there are)" if global_batch > windows else ""
    return ("warning: " + line + f"{epochs:.1f} epochs: the run sees each window about {epochs:.1f} times"
            f"{one_step}; more data or fewer --steps to see each window once")
