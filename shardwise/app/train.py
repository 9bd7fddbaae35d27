"""``shardwise train``: train a reference model with ``shardwise.fully_shard``.

    shardwise train --preset tiny                       # 2 CPU processes (gloo), stdlib bytes
    shardwise train --preset 1b --strategy optim_grads  # one process per GPU (NCCL)
    torchrun --nproc-per-node 8 -m shardwise train --preset 8b
    python -m shardwise train --preset tiny --steps 50 --dim 64 --config overrides.json

Settings come from, lowest first: the dataclass defaults, ``--preset``, a
``--config`` JSON file (field names with ``_`` or ``-``), then flags. Every
field of :class:`TrainConfig` and :class:`shardwise.models.GPTConfig` is a flag
(``--n-layers``, ``--micro-batch-size``, ``--activation-checkpointing`` /
``--no-activation-checkpointing``...). Everything is checked before any process
starts; a bad value is reported as ``--flag value: reason``.

Started directly, the command spawns ``--nproc`` local workers (default: one per
GPU, or 2 on CPU) and watches them like torchrun: when one fails, the others are
stopped; under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) it is the worker. Rank 0
shows a progress bar and writes to ``--out-dir`` (default ``runs/<name>``):
``config.json``, ``metrics.jsonl`` (one JSON object per step: step, loss, lr,
grad_norm, tokens (cumulative over the whole run), step_time_s, tokens_per_s,
mfu, mem_gib, elapsed_s, launch; after an evaluation also eval_loss,
eval_perplexity, eval_tokens, eval_time_s), ``summary.json`` and ``loss.png``
(both computed from the whole ``metrics.jsonl``, resumed parts included), and
with ``--tensorboard`` / ``--wandb`` their files (:mod:`.loggers`). Data,
tokenizer and evaluation flags: :mod:`.corpus`, :mod:`.tokenized`, :mod:`.evaluate`.

A run folder holds one run: starting again in a folder that has metrics or
checkpoints needs ``--resume`` (continue from the latest checkpoint) or
``--overwrite`` (delete the earlier run first). Every collective waits at most
``--timeout`` seconds for the other ranks; a stalled rank makes the others fail
with one line naming the step and collective, and the launcher stops the rest.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import shutil
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointError, CheckpointManager
from ..device import device_for
from .corpus import check_flags as check_data_flags, check_world as check_data, open_data, resolve_tokenizer
from .data import DATA_DTYPES, TokenLoader, check_data_path
from ..models import GPT, GPTConfig
from ..optim import takes_clip_factor
from ..replaced import check_optimizer_params
from .launch import (EXIT_INTERRUPTED, WorkerError, describe_collective_error, launch_local, one_line_warnings,
                     run_guarded, shutdown_process_groups, under_launcher)
from .presets import PRESETS

__all__ = ["TrainConfig", "ConfigError", "LRSchedule", "resolve_config", "train", "main", "summarize"]

PROG = "shardwise train"
RENDEZVOUS_S = 600.0  # how long ranks may take to meet at start (imports, data), whatever --timeout is
RESUME_MODES = {"": "never", "auto": "if there is a checkpoint", "required": "fail without a checkpoint"}
RUN_FILES = ("metrics.jsonl", "summary.json", "loss.png", "config.json", "wandb-run-id")  # what --overwrite deletes
RUN_FOLDERS = ("checkpoints", "tensorboard", "wandb")  # and these folders

PEAK_FLOPS_PER_GPU = 989e12  # H100/H200 dense bf16
OUTER_STRATEGIES = ("no_shard", "optim")


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class TrainConfig:
    preset: str = field(default="tiny", metadata=_help(f"starting point: {', '.join(PRESETS)}"))
    steps: int = field(default=100, metadata=_help("optimizer steps"))
    lr: float = field(default=3e-4, metadata=_help("peak learning rate (AdamW)"))
    min_lr_ratio: float = field(default=0.1, metadata=_help("cosine decay floor, as a fraction of --lr"))
    warmup_steps: int = field(default=10, metadata=_help("linear warm-up steps"))
    weight_decay: float = field(default=0.1, metadata=_help("AdamW weight decay (matrices only)"))
    beta1: float = field(default=0.9, metadata=_help("AdamW beta1"))
    beta2: float = field(default=0.95, metadata=_help("AdamW beta2"))
    micro_batch_size: int = field(default=8, metadata=_help("sequences per rank per micro-batch"))
    grad_accum: int = field(default=1, metadata=_help("micro-batches per step (no_sync on all but the last)"))
    seq_len: int = field(default=128, metadata=_help("tokens per sequence"))
    max_grad_norm: float = field(default=1.0, metadata=_help("clip the global grad norm (0 = no clipping)"))
    strategy: str = field(default="optim_grads_params", metadata=_help(
        "sharding: no_shard/optim/optim_grads/optim_grads_params or ZeRO stage 0-3"))
    outer_strategy: str = field(default="", metadata=_help(
        "outer axis: no_shard (HSDP) or optim (HFSDP); needs --outer-dp"))
    outer_dp: int = field(default=0, metadata=_help("size of the outer data-parallel axis"))
    precision: str = field(default="fp32", metadata=_help("compute dtype: fp32 or bf16 (main weights stay fp32)"))
    compile: str = field(default="", metadata=_help(
        "torch.compile each layer's forward with this backend (shardwise.compile_units; the sharding hooks "
        "stay eager): --compile alone means inductor"))
    fp8: str = field(default="", metadata=_help(
        "FP8 linears through torchao: tensorwise or rowwise (needs --precision bf16 and pip install "
        "'shardwise[fp8]'); turns --compile on unless --no-compile"))
    fp8_skip: str = field(default="output,lm_head", metadata=_help(
        "with --fp8: comma list of linears (names or last name parts) kept in bf16"))
    fp8_all_gather: bool = field(default=False, metadata=_help(
        "with --fp8 tensorwise: gather the weights as FP8 bytes (half of bf16's, for several GPUs; 3.2x slower "
        "than the bf16 gather on one H200 today, docs/performance.md); rowwise always gathers bf16"))
    offload: bool = field(default=False, metadata=_help(
        "keep fp32 main weights, grads and AdamW state in host memory; the optimizer steps on the CPU"))
    offload_fraction: float = field(default=1.0, metadata=_help(
        "with --offload: the share of the parameters offloaded, unit by unit from the first layer"))
    seed: int = field(default=0, metadata=_help("seed for init and data order"))
    data: str = field(default="", metadata=_help(
        "text file, folder of text files, or .bin token file (default: Python stdlib sources as bytes); with "
        "--tokenizer also .jsonl and .parquet files"))
    data_dtype: str = field(default="", metadata=_help(
        "token dtype of a .bin file: uint8, uint16 or uint32 (default: its <file>.bin.json sidecar's, else uint16)"))
    tokenizer: str = field(default="", metadata=_help(
        "tokenize text with this tokenizer.json file or Hugging Face tokenizer folder (default: the --init-from / "
        "--hf-config folder's when it has one; 'bytes': UTF-8 bytes)"))
    eos_token: str = field(default="", metadata=_help("the token that ends each document (default: the tokenizer's)"))
    text_key: str = field(default="text", metadata=_help("the text field of .jsonl rows and .parquet columns"))
    data_cache: str = field(default="", metadata=_help(
        "folder for tokenized-text caches (default: .shardwise-cache next to the data)"))
    eval_data: str = field(default="", metadata=_help("held-out data to evaluate on (same formats as --data)"))
    eval_fraction: float = field(default=0.0, metadata=_help(
        "hold out the last fraction of --data's tokens for evaluation instead"))
    eval_every: int = field(default=0, metadata=_help("evaluate every N steps (0 = after the last step only)"))
    eval_batches: int = field(default=10, metadata=_help(
        "global batches of held-out windows per evaluation (0 = all of them)"))
    tensorboard: bool = field(default=False, metadata=_help(
        "write TensorBoard event files to <out-dir>/tensorboard (needs tensorboard)"))
    wandb: bool = field(default=False, metadata=_help(
        "log to Weights & Biases, offline unless WANDB_MODE says otherwise, under <out-dir>/wandb (needs wandb)"))
    out_dir: str = field(default="", metadata=_help("output folder (default runs/<name>)"))
    name: str = field(default="", metadata=_help("run name (default <preset>-<timestamp>)"))
    save_every: int = field(default=0, metadata=_help(
        "save a checkpoint every N steps (and at the last) into <out-dir>/checkpoints (0 = never)"))
    keep_checkpoints: int = field(default=3, metadata=_help("complete checkpoints to keep"))
    resume: str = field(default="", metadata=_help(
        "continue the run in --out-dir/--name from the latest complete checkpoint in <out-dir>/checkpoints: "
        "--resume starts at step 1 (and says so) when there is none, --resume=required fails then"))
    overwrite: bool = field(default=False, metadata=_help(
        "replace an earlier run in the same folder: its metrics, summary, plot and checkpoints are deleted first"))
    keep_global_batch: bool = field(default=False, metadata=_help(
        "when resuming on another number of ranks, keep the checkpoint's global batch by changing --grad-accum"))
    timeout: float = field(default=300.0, metadata=_help(
        "seconds a collective waits for the other ranks before the run fails (the process-group timeout)"))
    nproc: int = field(default=0, metadata=_help("local worker processes (0 = one per GPU, or 2 on CPU)"))
    meta_init: bool = field(default=True, metadata=_help(
        "build the model on the meta device and initialize it one layer at a time while sharding "
        "(the same weights as a direct build, without ever holding the whole model)"))
    device: str = field(default="auto", metadata=_help("auto, cpu or cuda"))
    hf_config: str = field(default="", metadata=_help(
        "train the transformers causal LM this config.json (or folder) describes instead of the GPT model "
        "(needs the hf extra: pip install 'shardwise[hf]')"))
    init_from: str = field(default="", metadata=_help(
        "start from a Hugging Face save_pretrained folder, each rank reading only its own rows; a "
        "Llama/Mistral/Mixtral folder trains as the GPT model of its shape, others as with --hf-config"))


_TRAIN_FIELDS = {f.name: f for f in fields(TrainConfig)}
_MODEL_FIELDS = {f.name: f for f in GPTConfig.cli_fields()}
assert not set(_TRAIN_FIELDS) & set(_MODEL_FIELDS)
_ALL_FIELDS = {**_TRAIN_FIELDS, **_MODEL_FIELDS}
_CASTS = {"int": int, "float": float, "str": str, "bool": bool}


class ConfigError(ValueError):
    """A bad setting, reported as ``--flag value: reason`` (one line; exit status 2)."""

    one_line = True
    exit_code = 2

    def __init__(self, name: str, value, why: str):
        flag = name if name.startswith("-") else "--" + name.replace("_", "-")
        super().__init__(f"{flag} {value}: {why}" if value != "" else f"{flag}: {why}")


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ configuration
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise train", description="Train a reference model with shardwise.fully_shard.",
        argument_default=argparse.SUPPRESS,
        epilog="Defaults shown are what runs without the flag: where the default preset (tiny) sets a field, "
               "its value; another --preset sets its own (--list-presets shows them).")
    parser.add_argument("--config", help="JSON file of field -> value overrides (applied after --preset)")
    parser.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    for title, group_fields in (("training", _TRAIN_FIELDS), ("model", _MODEL_FIELDS)):
        group = parser.add_argument_group(title)
        for name, f in group_fields.items():
            flag = "--" + name.replace("_", "-")
            kind = _CASTS[str(f.type)]
            text = f.metadata.get("help")
            if "(default" not in text:  # a help that says its default itself keeps it
                text += f" ({_shown_default(name, f.default)})"
            if name == "resume":
                group.add_argument(flag, dest=name, nargs="?", const="auto", metavar="auto|required",
                                   help=text.replace("(default: '')", "(default: no)"))
                group.add_argument("--no-resume", dest=name, action="store_const", const="",
                                   help="start a new run (the default)")
            elif name == "compile":
                group.add_argument(flag, dest=name, nargs="?", const="inductor", metavar="BACKEND",
                                   help=text.replace("(default: '')", "(default: eager)"))
                group.add_argument("--no-compile", dest=name, action="store_const", const="",
                                   help="run eagerly (the default)")
            elif kind is bool:
                group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=text)
            else:
                group.add_argument(flag, dest=name, type=kind, metavar=kind.__name__.upper(), help=text)
    return parser


def _shown_default(name: str, default) -> str:
    """What runs when the flag is not given: the default preset's value where it sets one."""
    preset = TrainConfig.preset
    if name not in PRESETS[preset]:
        return f"default: {default!r}"
    others = "" if all(name in p for p in PRESETS.values()) else f", {default!r} under one that does not set it"
    return f"default: {PRESETS[preset][name]!r}, from the preset {preset}; other presets set their own{others}"


def _coerce(name: str, value, source: str):
    """A JSON value for field ``name``, of exactly the field's type (no ``true`` for a number)."""
    kind = _CASTS[str(_ALL_FIELDS[name].type)]
    shown = f"{name}={json.dumps(value)}"
    if name == "resume" and isinstance(value, bool):
        return "auto" if value else ""
    if name == "compile" and isinstance(value, bool):
        return "inductor" if value else ""
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(source, shown, "needs true or false")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise ConfigError(source, shown, "needs a whole number")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(source, shown, "needs a number")
        return float(value)
    if not isinstance(value, str):
        raise ConfigError(source, shown, "needs a string")
    return value


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except OSError as e:
        raise ConfigError("config", path, e.strerror or str(e)) from None
    except json.JSONDecodeError as e:
        raise ConfigError("config", path, f"not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError("config", path, "must hold a JSON object of field -> value")
    values = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name not in _ALL_FIELDS:
            raise ConfigError("config", path, f"unknown field {key!r}")
        values[name] = _coerce(name, value, f"--config {path}:")
    return values


def resolve_config(argv=None) -> tuple[TrainConfig, GPTConfig]:
    """Parse and merge flags, ``--config`` and the preset; validate everything that can be."""
    args = vars(build_parser().parse_args(argv))
    if args.pop("list_presets", False):
        for name, preset in PRESETS.items():
            print(f"{name:12s} " + " ".join(f"{k}={v}" for k, v in preset.items()))
        raise SystemExit(0)
    from_file = _read_json(args.pop("config")) if "config" in args else {}
    preset = args.get("preset", from_file.get("preset", "tiny"))
    if preset not in PRESETS:
        raise ConfigError("preset", preset, f"unknown preset; choose one of {', '.join(PRESETS)}")
    explicit = {**from_file, **args}
    values = {**PRESETS[preset], **explicit, "preset": preset}
    if values.get("fp8") and "compile" not in explicit:  # FP8 matmuls pay only compiled (docs/performance.md)
        values["compile"] = "inductor"
    if "max_seq_len" not in explicit:
        values["max_seq_len"] = values.get("seq_len", TrainConfig.seq_len)
    cfg = TrainConfig(**{k: v for k, v in values.items() if k in _TRAIN_FIELDS})
    model = GPTConfig(**{k: v for k, v in values.items() if k in _MODEL_FIELDS})
    _validate(cfg, model)
    if cfg.hf_config or cfg.init_from:
        from .hf_train import resolve  # checks transformers (says how to install it) and the config/folder

        model = resolve(cfg, model)
    model = resolve_tokenizer(cfg, model, explicit)  # the tokenizer in effect; its vocabulary fits the model's
    return cfg, model


def _validate(cfg: TrainConfig, model: GPTConfig) -> None:
    import shardwise

    for obj, names in ((cfg, _TRAIN_FIELDS), (model, _MODEL_FIELDS)):
        for name, f in names.items():
            if str(f.type) == "float" and not math.isfinite(getattr(obj, name)):
                raise ConfigError(name, getattr(obj, name), "must be a finite number")
    for name in ("steps", "micro_batch_size", "grad_accum", "seq_len"):
        if getattr(cfg, name) < 1:
            raise ConfigError(name, getattr(cfg, name), "must be at least 1")
    if not cfg.lr > 0:
        raise ConfigError("lr", cfg.lr, "must be positive")
    if cfg.min_lr_ratio > 1:
        raise ConfigError("min_lr_ratio", cfg.min_lr_ratio, "must be at most 1 (a fraction of --lr)")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            raise ConfigError(name, getattr(cfg, name), "must be in [0, 1)")
    if not cfg.timeout > 0:
        raise ConfigError("timeout", cfg.timeout, "must be a positive number of seconds")
    if not 0 <= cfg.offload_fraction <= 1:
        raise ConfigError("offload_fraction", cfg.offload_fraction, "must be a fraction in [0, 1]")
    if cfg.compile:
        from torch import _dynamo

        backends = _dynamo.list_backends(exclude_tags=())
        if cfg.compile not in backends:
            raise ConfigError("compile", cfg.compile, f"unknown torch.compile backend; choose from {', '.join(backends)}")
    if cfg.resume == "never":
        cfg.resume = ""
    if cfg.resume not in RESUME_MODES:
        raise ConfigError(f"--resume={cfg.resume}", "", "use --resume (continue if there is a checkpoint) or "
                          "--resume=required (fail if there is none)")
    if cfg.resume and not (cfg.out_dir or cfg.name):
        raise ConfigError(f"--resume={cfg.resume}", "", "needs --out-dir (or --name): the run folder whose "
                          "checkpoints to resume")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("overwrite", "", "cannot be combined with --resume: continue the run or replace it")
    if cfg.name and (Path(cfg.name).name != cfg.name or cfg.name in (".", "..") or "/" in cfg.name):
        raise ConfigError("name", cfg.name, "must be a plain folder name under runs/ (no / or ..); use --out-dir "
                          "for a path")
    for name, f in _MODEL_FIELDS.items():  # after GPTConfig filled in its 0 = automatic defaults
        if str(f.type) == "int" and getattr(model, name) < 1:
            raise ConfigError(name, getattr(model, name), "must be at least 1")
    for name in ("norm_eps", "init_std", "rope_theta"):
        if not getattr(model, name) > 0:
            raise ConfigError(name, getattr(model, name), "must be positive")
    if model.moe_aux_loss_coef < 0:
        raise ConfigError("moe_aux_loss_coef", model.moe_aux_loss_coef, "must not be negative")
    if cfg.keep_checkpoints < 1:
        raise ConfigError("keep_checkpoints", cfg.keep_checkpoints, "must be at least 1")
    for name in ("warmup_steps", "max_grad_norm", "weight_decay", "min_lr_ratio", "nproc", "outer_dp", "save_every"):
        if getattr(cfg, name) < 0:
            raise ConfigError(name, getattr(cfg, name), "must not be negative")
    try:
        cfg.strategy = shardwise.resolve_strategy(cfg.strategy)
    except ValueError:
        raise ConfigError("strategy", cfg.strategy,
                          f"unknown strategy; use one of {sorted(shardwise.STRATEGY_PLACEMENTS)} or 0-3") from None
    if cfg.outer_strategy and cfg.outer_strategy not in OUTER_STRATEGIES:
        raise ConfigError("outer_strategy", cfg.outer_strategy, f"use one of {', '.join(OUTER_STRATEGIES)}")
    if cfg.outer_strategy and cfg.outer_dp < 1:
        raise ConfigError("outer_strategy", cfg.outer_strategy, "needs --outer-dp N (the outer axis size)")
    if cfg.outer_dp and not cfg.outer_strategy:
        raise ConfigError("outer_dp", cfg.outer_dp, "needs --outer-strategy no_shard or optim")
    if cfg.precision not in ("fp32", "bf16"):
        raise ConfigError("precision", cfg.precision, "use fp32 or bf16")
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("device", cfg.device, "use auto, cpu or cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", cfg.device, "no CUDA device is available")
    if cfg.data_dtype and cfg.data_dtype not in DATA_DTYPES:
        raise ConfigError("data_dtype", cfg.data_dtype, f"use one of {', '.join(DATA_DTYPES)}")
    if cfg.seq_len > model.max_seq_len:
        raise ConfigError("max_seq_len", model.max_seq_len, f"is shorter than --seq-len {cfg.seq_len}")
    try:
        model.validate()
    except ValueError as e:
        name, _, why = str(e).partition(": ")
        name = name.split("=")[0]
        raise ConfigError(name, getattr(model, name, "?"), why) from None
    why = check_data_path(cfg.data or None, cfg.data_dtype)
    if why:
        raise ConfigError("data", cfg.data, why)
    from .fp8 import check_fp8

    bad = check_fp8(cfg.fp8, cfg.fp8_all_gather, cfg.precision, cfg.strategy, cfg.outer_strategy, cfg.offload)
    if bad:
        raise ConfigError(*bad)
    if cfg.fp8 and (cfg.hf_config or cfg.init_from):
        raise ConfigError("fp8", cfg.fp8, "with --hf-config / --init-from is not built yet (FP8 trains the GPT model)")
    check_data_flags(cfg)
    for name in ("tensorboard", "wandb"):
        if getattr(cfg, name):
            from .loggers import missing_package

            why = missing_package(name)
            if why:
                raise ConfigError(name, "", why)


def _check_world(cfg: TrainConfig, model: GPTConfig, world: int) -> None:
    """Checks that need the world size and the data (still before any process group)."""
    if cfg.outer_dp and world % cfg.outer_dp:
        raise ConfigError("outer_dp", cfg.outer_dp, f"must divide the number of processes ({world})")
    # lengths and ids; text to tokenize is tokenized here, once, unless each process is a torchrun worker
    check_data(cfg, model, build=not under_launcher())


def _device_type(cfg: TrainConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def _default_out_dir(cfg: TrainConfig) -> str:
    name = cfg.name or f"{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg.out_dir or str(Path("runs") / name)


# ------------------------------------------------------------------ the run folder
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
            _say(f"--overwrite: deleted the earlier run in {out_dir} ({', '.join(earlier)})")
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
            _say(f"--resume: no complete checkpoint in {ckpt_dir}; starting at step 1{replacing}")


# ------------------------------------------------------------------ learning rate
@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up then cosine decay, possibly continuing from ``(start, start_lr)`` of a resumed run.

    For ``start < step <= warmup_end`` the rate rises linearly from ``start_lr`` to ``peak``;
    after ``warmup_end`` it follows a cosine from ``top`` down to ``floor`` at step ``end``.
    ``settings`` are the flags it was made from (steps, lr, min_lr_ratio, warmup_steps): a resumed
    run with the same flags keeps the checkpoint's schedule exactly.
    """

    peak: float
    floor: float
    end: int
    warmup_end: int
    top: float
    start: int = 0
    start_lr: float = 0.0
    settings: tuple = ()
    note: str = ""

    def __call__(self, step: int) -> float:
        if step <= self.warmup_end:
            return self.start_lr + (self.peak - self.start_lr) * (step - self.start) / (self.warmup_end - self.start)
        begin = max(self.warmup_end, self.start)
        progress = min(1.0, (step - begin) / max(1, self.end - begin))
        return self.floor + (self.top - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))

    def describe(self) -> str:
        parts = []
        if self.start:
            parts.append(f"continues from {self.start_lr:.3g} at step {self.start}")
        if self.warmup_end > self.start:
            parts.append(f"linear warm-up to {self.peak:.3g} over steps {self.start + 1}-{self.warmup_end}")
        begin = max(self.warmup_end, self.start)
        if math.isclose(self.top, self.floor, rel_tol=1e-6):
            parts.append(f"constant at the floor {self.floor:.3g} over steps {begin + 1}-{self.end}")
        else:
            parts.append(f"cosine decay from {self.top:.3g} to {self.floor:.3g} over steps {begin + 1}-{self.end}")
        return "lr: " + ", then ".join(parts) + (f" ({self.note})" if self.note else "")

    def to_dict(self) -> dict:
        return {**asdict(self), "settings": list(self.settings)}

    @classmethod
    def from_dict(cls, d: dict) -> "LRSchedule":
        return cls(**{**d, "settings": tuple(d.get("settings", ()))})


def _settings(cfg: TrainConfig) -> tuple:
    return (cfg.steps, cfg.lr, cfg.min_lr_ratio, cfg.warmup_steps)


def lr_schedule(cfg: TrainConfig) -> LRSchedule:
    """The schedule of a new run: warm-up (at most half of --steps), then cosine decay to the floor."""
    warmup = min(cfg.warmup_steps, cfg.steps // 2)
    note = (f"warm-up capped at half of --steps {cfg.steps}; --warmup-steps is {cfg.warmup_steps}"
            if warmup < cfg.warmup_steps else "")
    return LRSchedule(peak=cfg.lr, floor=cfg.lr * cfg.min_lr_ratio, end=cfg.steps, warmup_end=warmup,
                      top=cfg.lr, settings=_settings(cfg), note=note)


def resumed_schedule(saved: LRSchedule | None, cfg: TrainConfig, step: int) -> LRSchedule:
    """The schedule after resuming at checkpoint ``step``: the saved one, or one that continues it.

    When --steps, --lr, --min-lr-ratio or --warmup-steps differ from the checkpoint's run, the
    rate continues from where it was (no jump): a warm-up still under way goes on to --lr at the
    new warm-up end; otherwise the cosine decays from the current rate to the floor at --steps.
    """
    fresh = lr_schedule(cfg)
    if saved is None or saved.settings == fresh.settings:
        return saved or fresh
    lr_now = saved(step)
    old = dict(zip(("steps", "lr", "min_lr_ratio", "warmup_steps"), saved.settings))
    changed = ", ".join(f"--{k.replace('_', '-')} {old[k]:g} -> {getattr(cfg, k):g}" for k in old
                        if old[k] != getattr(cfg, k))
    note = f"changed since the checkpoint: {changed}" if changed else ""
    if cfg.steps > step and math.isclose(lr_now, fresh.floor, rel_tol=1e-6):  # it would train flat at the floor
        note += (f"; the rate already decayed to its floor {lr_now:.3g} by step {step}, so steps {step + 1}-"
                 f"{cfg.steps} stay there: for a decay over all {cfg.steps} steps, start a new run with --steps "
                 f"{cfg.steps} (the first launch's --steps sets the schedule)")
    if step < saved.warmup_end and step < fresh.warmup_end:  # still warming up: go on to the peak
        return replace(fresh, start=step, start_lr=lr_now, note=note)
    return replace(fresh, start=step, start_lr=lr_now, warmup_end=step, top=lr_now, note=note)


def _lr_at(cfg: TrainConfig, step: int) -> float:
    """The learning rate of a new run at ``step`` (1-based)."""
    return lr_schedule(cfg)(step)


# ------------------------------------------------------------------ training
def _param_groups(model: torch.nn.Module, matrix_names: set[str], weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if name in matrix_names else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def _limit_collective_waits(model: torch.nn.Module | None, timeout_s: float) -> None:
    """Make every collective of the world group (and of ``model``'s device meshes) wait at most ``timeout_s``.

    ``init_process_group(timeout=)`` covers the default group only; groups that DeviceMeshes
    create later get torch's default (30 min on gloo, 10 min on NCCL), so they are set here
    once the model's meshes exist.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    groups = [dist.group.WORLD]
    if model is not None:
        meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")}
        for mesh in meshes.values():
            groups += [mesh.get_group(dim) for dim in range(mesh.ndim)]
    for group in {id(g): g for g in groups if g is not None}.values():
        group.set_timeout(timeout)


class _Phase:
    """Where this rank is (step and collective), for the one line a stalled peer causes."""

    def __init__(self):
        self.now = "process-group setup"

    def __call__(self, text: str) -> None:
        self.now = text


def train(cfg: TrainConfig, model_cfg: GPTConfig, started_at: float | None = None) -> dict | None:
    """The worker: runs in every rank of an initialized (or to-be-initialized) process group.

    A collective that times out (a stalled rank) or loses its peer (a dead rank) raises
    :class:`WorkerError` with one line naming the step and collective.
    """
    started_at = started_at or time.time()
    device_type = _device_type(cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    owns_group = not dist.is_initialized()
    if owns_group:
        if device_type == "cuda":
            # NCCL: the watchdog aborts a collective that outlives the timeout and takes the process
            # down (it cannot be interrupted from Python); its monitor catches a stuck watchdog.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
            os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "1")
            # On a timeout the watchdog first waits for the flight-recorder dump (a minute by default).
            os.environ.setdefault("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "5000")
        # Ranks may start seconds apart (imports on a busy machine): the rendezvous gets at least
        # RENDEZVOUS_S; the collectives get --timeout (set on the groups below).
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=max(cfg.timeout, RENDEZVOUS_S)))
    device = device_for()  # the group's backend decides: NCCL -> this rank's GPU, gloo -> the CPU
    _limit_collective_waits(None, cfg.timeout)
    phase = _Phase()
    try:
        return _train(cfg, model_cfg, started_at, device, phase)
    except BaseException as e:
        traceback.clear_frames(e.__traceback__)  # let the model and its process groups go
        why = None
        if isinstance(e, Exception) and dist.is_initialized():
            world, rank = dist.get_world_size(), dist.get_rank()
            peers = f"rank {1 - rank}" if world == 2 else "another rank (the launcher names those still running)"
            why = describe_collective_error(e, cfg.timeout, peers)
        if why:
            raise WorkerError(f"{phase.now}: {why}") from None
        if isinstance(e, CheckpointError):  # its message names the folder and the cause: one line, no traceback
            raise WorkerError(f"{phase.now}: {e}") from None
        raise
    finally:
        if owns_group:
            shutdown_process_groups()


def global_batch_plan(run: dict, cfg: TrainConfig, world: int) -> tuple[int, str]:
    """(grad_accum, one line or "") for resuming checkpoint ``run`` facts on ``world`` ranks.

    The same micro-batch on another number of ranks changes the global batch: said on one
    line, or, with --keep-global-batch, avoided by scaling --grad-accum (refused when the
    checkpoint's global batch is not a multiple of micro-batch x ranks).
    """
    grad_accum = cfg.grad_accum
    old_global = run.get("global_batch")
    new_global = cfg.micro_batch_size * grad_accum * world
    if not old_global or old_global == new_global:
        return grad_accum, ""
    was = f"{run['world_size']} ranks x micro-batch {run['micro_batch_size']} x grad-accum {run['grad_accum']}"
    if not cfg.keep_global_batch:
        return grad_accum, (f"global batch changes from {old_global} to {new_global} sequences per step ({was} -> "
                            f"{world} ranks x micro-batch {cfg.micro_batch_size} x grad-accum {grad_accum}); "
                            f"--keep-global-batch keeps it")
    per_micro = cfg.micro_batch_size * world
    if old_global % per_micro:
        raise ConfigError("keep_global_batch", "", f"the checkpoint's global batch of {old_global} sequences "
                          f"({was}) is not a multiple of --micro-batch-size {cfg.micro_batch_size} x {world} ranks")
    grad_accum = old_global // per_micro
    return grad_accum, (f"global batch kept at {old_global} sequences per step: --grad-accum {cfg.grad_accum} -> "
                        f"{grad_accum} on {world} ranks (checkpoint: {was})")


def _restore(cfg: TrainConfig, checkpoints: CheckpointManager, model, optimizer, loader: TokenLoader,
             world: int, rank: int) -> tuple[int, int, int, LRSchedule]:
    """Load the latest checkpoint (with --resume); (first step, grad_accum, tokens so far, lr schedule)."""
    grad_accum, schedule = cfg.grad_accum, lr_schedule(cfg)
    restored = checkpoints.load_latest(model, optimizer) if cfg.resume else None  # also restores the RNG
    if restored is None:
        if cfg.resume == "required":
            raise ConfigError("--resume=required", "", f"no complete checkpoint in {checkpoints.directory}")
        return 1, grad_accum, 0, schedule
    extra = restored.extra or {}
    loader.load_state_dict(extra["data"])
    run = extra.get("run") or {}
    say = _say if rank == 0 else (lambda message: None)
    say(f"resumed from {restored.path} (step {restored.step})")
    grad_accum, message = global_batch_plan(run, cfg, world)
    if message:
        say(message)
    tokens = int(run["tokens"]) if "tokens" in run else loader.position * cfg.seq_len
    saved = LRSchedule.from_dict(run["schedule"]) if "schedule" in run else None
    return restored.step + 1, grad_accum, tokens, resumed_schedule(saved, cfg, restored.step)


def _train(cfg: TrainConfig, model_cfg: GPTConfig, started_at: float, device: torch.device,
           phase: _Phase) -> dict | None:
    import shardwise
    from tqdm import tqdm

    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = Path(cfg.out_dir)
    # AdamW's fused kernel on the GPU (no temporaries; it takes the clipping factor) and for offloaded
    # state, where torch's default CPU AdamW is a per-tensor loop 3.4x slower (python -m
    # shardwise.app.bench.cpu_adam, docs/performance.md); the default on CPU runs.
    fused = bool(cfg.offload) or device.type == "cuda"
    phase("data (rank 0 tokenizes text that has no cache yet; the others wait)")
    train_tokens, eval_tokens = open_data(cfg, rank, world)  # before the model: a data error costs no model load
    phase("model setup (fully_shard)")
    if not (cfg.hf_config or cfg.init_from):  # what it will take, before anything is built
        from .memory import check_fits, estimate_for_run, host_available_bytes

        estimate = estimate_for_run(
            model_cfg, cfg.seq_len, cfg.micro_batch_size, world, cfg.strategy,
            cfg.offload_fraction if cfg.offload else 0.0, outer=cfg.outer_dp or None,
            outer_strategy=cfg.outer_strategy or "no_shard", precision=cfg.precision, vocab_units=False,
            grad_accum=cfg.grad_accum, optimizer="fused" if fused else "default",
            build_on_device=not cfg.meta_init, ranks_per_host=int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if rank == 0:
            _say(f"memory estimate: {estimate.describe(device.type)}")
        if device.type == "cuda":  # on every rank, before any rank allocates: a clear error, not an OOM
            note = check_fits(estimate, torch.cuda.mem_get_info(device)[0], host_available_bytes())
            if note and rank == 0:
                _say(note)
    torch.manual_seed(cfg.seed)
    if cfg.hf_config or cfg.init_from:  # init_fn.finish() reads the --init-from rows
        from .hf_train import build_model

        model, init_fn, unit_modules = build_model(cfg, model_cfg, device)
    else:
        init_fn = None
        with torch.device("meta" if cfg.meta_init else device):
            model = GPT(model_cfg)
        if cfg.fp8:  # before the meta plan and fully_shard; the parameters and their init stay the model's
            from .fp8 import convert_model

            conversion = convert_model(model, cfg.fp8, cfg.fp8_skip, cfg.fp8_all_gather)
            if rank == 0:
                _say(conversion.describe())
        if cfg.meta_init:
            init_fn = shardwise.MetaInitializer(model, device)
            init_fn.plan()  # records the RNG state each layer's init starts from in a direct build
        unit_modules = list(dict.fromkeys(type(layer) for layer in model.layers))
    n_params, flops_per_token = model.num_params(), model.flops_per_token(cfg.seq_len)
    embeddings = {  # no weight decay on embeddings (GPT's ``embed.``, HF's ``embed_tokens``...)
        f"{module_name}.{name}" if module_name else name
        for module_name, module in model.named_modules() if isinstance(module, torch.nn.Embedding)
        for name, _ in module.named_parameters(recurse=False)
    }
    matrices = {
        n for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embed.") and n not in embeddings
    }
    mesh = shardwise.build_dp_mesh(outer=cfg.outer_dp, device_type=device.type) if cfg.outer_dp else None
    policy = shardwise.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if cfg.precision == "bf16" else None)
    model = shardwise.fully_shard(
        model, mesh=mesh, strategy=cfg.strategy, outer_dp_sharding_strategy=cfg.outer_strategy or None,
        unit_modules=unit_modules, mixed_precision=policy,
        init_fn=init_fn,
        offload_policy=shardwise.OffloadPolicy(fraction=cfg.offload_fraction) if cfg.offload else None)
    if init_fn is not None:
        init_fn.finish()
    if cfg.compile:  # each layer's forward; compiled at the first step
        shardwise.compile_units(model, modules=unit_modules, backend=cfg.compile)
    _limit_collective_waits(model, cfg.timeout)
    optimizer = torch.optim.AdamW(_param_groups(model, matrices, cfg.weight_decay),
                                  lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), **({"fused": True} if fused else {}))
    check_optimizer_params(optimizer, model)
    torch.manual_seed(cfg.seed + 1 + rank)  # dropout differs per rank
    loader = TokenLoader(train_tokens, cfg.seq_len, cfg.micro_batch_size, rank, world, cfg.seed, device)
    checkpoints = CheckpointManager(out_dir / "checkpoints", keep_last=cfg.keep_checkpoints)
    phase("checkpoint load")
    start, grad_accum, tokens, schedule = _restore(cfg, checkpoints, model, optimizer, loader, world, rank)
    evaluator = None
    if eval_tokens is not None:
        from .evaluate import Evaluator

        evaluator = Evaluator(eval_tokens, cfg.seq_len, cfg.micro_batch_size, cfg.micro_batch_size * grad_accum * world,
                              cfg.eval_batches, cfg.eval_every, cfg.steps, rank, world, device)

    metrics_file, launch = None, 0  # rank 0 writes the metrics
    if rank == 0:
        _say(schedule.describe())
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(
            {"train": {**vars(cfg), "grad_accum": grad_accum}, "model": model_cfg.to_dict(), "world_size": world,
             "device": device.type, "params": n_params}, indent=2) + "\n")
        metrics = out_dir / "metrics.jsonl"
        kept = metrics.read_text().splitlines() if start > 1 and metrics.exists() else []
        kept = [line for line in kept if json.loads(line)["step"] < start]  # drop steps being redone
        launch = 1 + max((json.loads(line).get("launch", 1) for line in kept), default=0)
        metrics_file = open(metrics, "w", buffering=1)
        metrics_file.writelines(line + "\n" for line in kept)
        if start > cfg.steps:
            _say(f"nothing to train: the checkpoint is at step {start - 1} and --steps is {cfg.steps}")
        if evaluator is not None:
            _say(evaluator.describe())
    loggers = None
    if rank == 0 and (cfg.tensorboard or cfg.wandb):
        from .loggers import RunLoggers

        loggers = RunLoggers(cfg, out_dir, start, json.loads((out_dir / "config.json").read_text()))
    # One bar per process: a thread lock will do. tqdm's default multiprocessing lock is a named
    # semaphore, which a killed rank leaks (and the resource tracker warns about at exit).
    tqdm.set_lock(threading.RLock())
    bar = tqdm(total=cfg.steps, initial=min(start - 1, cfg.steps), desc=f"{_model_label(cfg)} x{world}",
               disable=rank != 0, dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
    try:
        trained = _loop(cfg, model, optimizer, loader, checkpoints, schedule, start, grad_accum, tokens, device,
                        phase, bar, metrics_file, launch, flops_per_token, evaluator, loggers)
    finally:
        bar.close()  # ends the progress line before anything else is printed
        if loggers is not None:
            loggers.close()
    phase("shutdown")
    if rank != 0:
        return None
    metrics_file.close()
    if not trained:
        return None
    return _finish(out_dir, cfg, n_params, world, time.time() - started_at)


def _loop(cfg, model, optimizer, loader, checkpoints, schedule, start, grad_accum, tokens, device, phase, bar,
          metrics_file, launch, flops_per_token, evaluator=None, loggers=None) -> int:
    """Steps ``start..cfg.steps``; rank 0 writes a metrics line per step. Returns the steps trained.

    After the steps ``evaluator.due`` names, every rank evaluates (outside the step time); the
    result goes into that step's metrics line.
    """
    import shardwise

    rank, world = dist.get_rank(), dist.get_world_size()
    tokens_per_step = cfg.micro_batch_size * cfg.seq_len * grad_accum * world
    trained, loop_start = 0, time.perf_counter()
    bar_eval = ""  # the last eval loss, shown in the progress bar
    model.train()
    for step in range(start, cfg.steps + 1):
        t0 = time.perf_counter()
        lr = schedule(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=device)
        phase(f"step {step}, forward/backward (parameter all-gathers, gradient reduce-scatters)")
        for micro in range(grad_accum):
            inputs, targets = next(loader)
            last = micro == grad_accum - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(inputs, targets)
                (loss / grad_accum).backward()
            loss_sum += loss.detach().float()
        phase(f"step {step}, gradient norm (all-reduce)")
        if cfg.max_grad_norm > 0:
            # fused: the factor goes into the step's kernel instead of a pass over the gradients
            grad_norm = shardwise.clip_grad_norm_(model.parameters(), cfg.max_grad_norm,
                                                  optimizer=optimizer if takes_clip_factor(optimizer) else None)
        else:
            grad_norm = shardwise.grad_norm(model.parameters())
        phase(f"step {step}, optimizer step")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phase(f"step {step}, loss all-reduce")
        dist.all_reduce(loss_sum)
        loss_value = loss_sum.item() / (grad_accum * world)  # .item() syncs the device
        step_time = time.perf_counter() - t0
        tokens += tokens_per_step
        trained += 1
        evaluated = {}
        if evaluator is not None and evaluator.due(step):
            phase(f"step {step}, evaluation (forwards, loss all-reduce)")
            evaluated = evaluator(model)
        if rank == 0:  # the metrics line goes out before the checkpoint that covers it
            record = {
                "step": step, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                "tokens": tokens, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
                "mfu": (tokens_per_step / step_time * flops_per_token / (PEAK_FLOPS_PER_GPU * world)
                        if device.type == "cuda" else None),
                "mem_gib": _memory_gib(device), "elapsed_s": time.perf_counter() - loop_start, "launch": launch,
                **evaluated,
            }
            metrics_file.write(json.dumps(record) + "\n")
            if loggers is not None:
                loggers.log(record)
            if evaluated:
                bar_eval = f"{evaluated['eval_loss']:.3f}"
            postfix = {"loss": f"{loss_value:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}",
                       "mem": f"{record['mem_gib']:.2f}G"}
            if evaluator is not None and bar_eval:
                postfix["eval"] = bar_eval
            if record["mfu"] is not None:
                postfix["mfu"] = f"{100 * record['mfu']:.1f}%"
            bar.set_postfix(postfix, refresh=False)
            bar.update()
        if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
            phase(f"step {step}, checkpoint save")
            run = {"world_size": world, "micro_batch_size": cfg.micro_batch_size, "grad_accum": grad_accum,
                   "global_batch": cfg.micro_batch_size * grad_accum * world, "seq_len": cfg.seq_len,
                   "tokens": tokens, "schedule": schedule.to_dict()}
            checkpoints.save(step, model, optimizer, extra={"data": loader.state_dict(), "run": run})
    return trained


# ------------------------------------------------------------------ summary
def summarize(records: list[dict]) -> dict:
    """Numbers for the whole run from its ``metrics.jsonl`` records (every launch of a resumed run).

    Throughput is tokens over time of the steady steps: each launch's first step (allocation,
    warm-up) is left out unless nothing else is there. Tokens per step are differences of the
    cumulative ``tokens``, so launches on different numbers of ranks count right.
    """
    launches: dict[int, list[dict]] = {}
    for r in records:
        launches.setdefault(r.get("launch", 1), []).append(r)
    step_tokens, previous = [], 0
    for r in records:
        step_tokens.append(r["tokens"] - previous)
        previous = r["tokens"]
    by_step = dict(zip((r["step"] for r in records), step_tokens))
    steady = [r for part in launches.values() for r in part[1:]] or records
    steady_time = sum(r["step_time_s"] for r in steady)
    tail = [r["loss"] for r in records[-10:]]
    mfus = [r["mfu"] for r in steady if r.get("mfu") is not None]
    evals = [r for r in records if r.get("eval_loss") is not None]
    last_eval = {"eval_loss": evals[-1]["eval_loss"], "eval_perplexity": evals[-1]["eval_perplexity"],
                 "eval_step": evals[-1]["step"]} if evals else {}
    return {
        "steps": records[-1]["step"], "launches": len(launches),
        "resumed_at": [part[0]["step"] for part in list(launches.values())[1:]],
        "first_loss": records[0]["loss"], "last_loss": records[-1]["loss"],
        "last10_mean_loss": sum(tail) / len(tail), "tokens": records[-1]["tokens"],
        "tokens_per_s": sum(by_step[r["step"]] for r in steady) / steady_time if steady_time > 0 else None,
        "mfu": sum(mfus) / len(mfus) if mfus else None,
        "peak_mem_gib": max(r["mem_gib"] for r in records),
        "train_time_s": sum(part[-1]["elapsed_s"] for part in launches.values()),
        **last_eval,
    }


def _model_label(cfg: TrainConfig) -> str:
    """What the run trains (summary, progress bar, plot): the preset, or the Hugging Face config or folder it
    came from (whose model is not the preset's; the preset gave only the training settings)."""
    if cfg.hf_config and cfg.hf_config != cfg.init_from:
        return f"hf-config:{Path(cfg.hf_config).name}"
    return f"init-from:{Path(cfg.init_from).name}" if cfg.init_from else cfg.preset


def _finish(out_dir: Path, cfg: TrainConfig, n_params: int, world: int, wall_time: float) -> dict:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    label = _model_label(cfg)
    summary = {"model": label, "preset": None if label != cfg.preset else cfg.preset, "params": n_params, "world_size": world, **summarize(records),
               "wall_time_s": wall_time, "out_dir": str(out_dir)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(out_dir / "loss.png", records, summary["resumed_at"], cfg)
    mfu = f", MFU {100 * summary['mfu']:.1f}%" if summary["mfu"] is not None else ""
    resumed = f" (resumed at step {', '.join(map(str, summary['resumed_at']))})" if summary["resumed_at"] else ""
    speed = f"{summary['tokens_per_s']:,.0f} tokens/s" if summary["tokens_per_s"] else "tokens/s n/a"
    evaluated = (f"  eval loss {summary['eval_loss']:.3f} (perplexity {summary['eval_perplexity']:.2f}) at step "
                 f"{summary['eval_step']}\n" if "eval_loss" in summary else "")
    print(f"\n{label}: {n_params / 1e6:.2f}M params, {world} ranks, {summary['steps']} steps{resumed}\n"
          f"  loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} "
          f"(last-10 mean {summary['last10_mean_loss']:.3f})\n"
          f"{evaluated}"
          f"  {speed}{mfu}, peak mem {summary['peak_mem_gib']:.2f} GiB\n"
          f"  train {summary['train_time_s']:.1f}s, wall {wall_time:.1f}s\n"
          f"  outputs: {out_dir}/ (metrics.jsonl, loss.png, summary.json, config.json"
          f"{', tensorboard/' if cfg.tensorboard else ''}{', wandb/' if cfg.wandb else ''})", flush=True)
    return summary


def _plot(path: Path, records: list[dict], resumed_at: list[int], cfg: TrainConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in records]
    ax_loss.plot(steps, [r["loss"] for r in records], label="train")
    evals = [r for r in records if r.get("eval_loss") is not None]
    if evals:
        ax_loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", markersize=3, label="eval")
        ax_loss.legend(loc="upper center", fontsize=8)
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)",
                title=f"{_model_label(cfg)}: training{' and eval' if evals else ''} loss")
    ax_speed.plot(steps, [r["tokens_per_s"] for r in records])
    ax_speed.set(xlabel="step", ylabel="tokens/s (all ranks)", title="throughput")
    for ax in (ax_loss, ax_speed):
        ax.grid(alpha=0.3)
        for step in resumed_at:
            ax.axvline(step - 0.5, color="gray", linestyle="--", linewidth=0.8)
    if resumed_at:
        ax_loss.text(0.99, 0.98, "dashed: resumed", transform=ax_loss.transAxes, ha="right", va="top", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------ launching
def _worker_prog() -> str:
    rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
    return f"{PROG}: rank {rank}" if world > 1 else PROG


def main(argv=None) -> int:
    started_at = time.time()
    launched = under_launcher()
    one_line_warnings(_worker_prog() if launched else PROG)
    try:
        cfg, model_cfg = resolve_config(argv)
        if launched:
            world = int(os.environ["WORLD_SIZE"])
        elif cfg.nproc:
            world = cfg.nproc
        else:
            world = torch.cuda.device_count() if _device_type(cfg) == "cuda" else 2
        if _device_type(cfg) == "cuda" and not launched and world > torch.cuda.device_count():
            raise ConfigError("nproc", world, f"more processes than GPUs ({torch.cuda.device_count()})")
        _check_world(cfg, model_cfg, world)
        cfg = replace(cfg, out_dir=_default_out_dir(cfg))
        rank0 = not launched or os.environ.get("RANK") == "0"
        prepare_run_folder(cfg, rank0=rank0, announce=rank0)
    except ConfigError as e:
        _say(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        _say("interrupted (Ctrl-C)")
        return EXIT_INTERRUPTED
    if launched:  # torchrun started this process: it is the worker; torchrun watches the others
        code = run_guarded(train, (cfg, model_cfg, started_at), _worker_prog())
        if code == EXIT_INTERRUPTED:
            _say("interrupted (Ctrl-C)")
        return code
    return launch_local(train, world, (cfg, model_cfg, started_at), PROG)


if __name__ == "__main__":
    from shardwise.app.train import main as _main  # so spawned workers unpickle shardwise.app.train.*

    sys.exit(_main())
