"""``shardwise train``'s settings: :class:`TrainConfig`, the flags, ``--config`` files, and their checks.

Settings come from, lowest first: the dataclass defaults, ``--preset``, a
``--config`` JSON file (field names with ``_`` or ``-``), then flags. Every
field of :class:`TrainConfig` and :class:`shardwise.models.GPTConfig` is a flag.
Everything that can be checked before a process starts is checked here
(:func:`resolve_config`; :func:`check_world` once the world size is known) and
reported as ``--flag value: reason`` (:class:`ConfigError`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from ..engine.placements import STRATEGY_PLACEMENTS, outer_strategy_choices
from ..models import GPTConfig
from .corpus import check_flags as check_data_flags, check_world as check_data, resolve_tokenizer
from .data import DATA_DTYPES, check_data_path
from .errors import ConfigError, Problems, ShortUsageParser
from .launch import under_launcher
from .presets import PRESETS

__all__ = ["TrainConfig", "ConfigError", "build_parser", "resolve_config", "check_world", "device_type",
           "default_out_dir", "RESUME_MODES"]

RESUME_MODES = {"": "never", "auto": "if there is a checkpoint", "required": "fail without a checkpoint"}


def _help(text: str) -> dict:
    return {"help": text}


@dataclass
class TrainConfig:
    preset: str = field(default="tiny", metadata=_help(f"starting point: {', '.join(PRESETS)}"))
    steps: int = field(default=100, metadata=_help("optimizer steps"))
    lr: float = field(default=3e-4, metadata=_help("peak learning rate (AdamW; Muon's too, RMS-matched)"))
    optimizer: str = field(default="adamw", metadata=_help(
        "adamw, or muon: torch.optim.Muon on the layers' matrices (each whole on one owner rank, update RMS "
        "matched to AdamW's so --lr and --weight-decay carry over), AdamW on the embedding, head, norms, biases"))
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
        f"sharding: {'/'.join(STRATEGY_PLACEMENTS)} or ZeRO stage 0-3"))
    outer_strategy: str = field(default="", metadata=_help(
        f"outer axis: {outer_strategy_choices()}; needs --outer-dp"))
    outer_dp: int = field(default=0, metadata=_help("size of the outer data-parallel axis"))
    pp: int = field(default=1, metadata=_help(
        "pipeline stages: the model cut by layers over this many ranks (processes = pp x data-parallel ranks; "
        "--grad-accum is the number of micro-batches)"))
    cp: int = field(default=1, metadata=_help(
        "context parallelism: each sequence split over this many ranks (zig-zag chunks, K/V all-gathered in "
        "attention; processes = cp x data-parallel ranks; --seq-len divisible by 2 x cp)"))
    pp_schedule: str = field(default="1f1b", metadata=_help(
        "with --pp: 1f1b, gpipe, interleaved, looped_bfs or interleaved_zb (several stages per rank: "
        "--pp-virtual-stages), or zb (torch's ZBV zero-bubble schedule: --pp-virtual-stages 2)"))
    pp_virtual_stages: int = field(default=1, metadata=_help(
        "with --pp: stages per rank (interleaved / looped_bfs / interleaved_zb: rank r holds stages r, r + pp, "
        "...; zb: r and 2 pp - 1 - r)"))
    pp_split: str = field(default="", metadata=_help(
        "with --pp: comma list of layers per stage, e.g. 3,5 (default: even, the first stages one more)"))
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
        "with --fp8 tensorwise: gather the weights as FP8 bytes (half of bf16's, for several GPUs; its speed: "
        "docs/performance.md); rowwise always gathers bf16"))
    cuda_graphs: bool = field(default=False, metadata=_help(
        "replay each step's forward and backward (all micro-batches, the gradient reductions) from a CUDA graph "
        "(shardwise.capture_step; the model wrapped with graph_safe=True: gathered weights and gradient buffers "
        "stay allocated); CUDA only"))
    dry_run: bool = field(default=False, metadata=_help(
        "before launching, run a few real steps of rank 0 of this job on this machine's device (torch's fake "
        "process group at the job's world size, the wire modelled: shardwise plan --dry-run) and say whether "
        "it fits and its expected tokens/s; stop if it does not fit"))
    offload: bool = field(default=False, metadata=_help(
        "keep fp32 main weights, grads and AdamW state in host memory; the optimizer steps on the CPU"))
    offload_fraction: float = field(default=1.0, metadata=_help(
        "with --offload: the share of the parameters offloaded, unit by unit from the first layer"))
    seed: int = field(default=0, metadata=_help("seed for init and data order"))
    data: str = field(default="", metadata=_help(
        "text file, folder of text files, or .bin token file (default: Python stdlib sources as bytes); with "
        "--tokenizer also .jsonl and .parquet files"))
    data_dtype: str = field(default="", metadata=_help(
        "token dtype of a .bin file: uint8, uint16 or uint32 (default: its <file>.bin.json sidecar's; a .bin "
        "without a sidecar needs it)"))
    tokenizer: str = field(default="", metadata=_help(
        "tokenize text with this tokenizer.json file or Hugging Face tokenizer folder (default: the --init-from / "
        "--hf-config folder's when it has one; 'bytes': UTF-8 bytes; none at hand: docs/cli.md's 'No tokenizer at "
        "hand?' trains one on your text with the tokenizers package, no hub needed)"))
    eos_token: str = field(default="", metadata=_help("the token that ends each document (default: the tokenizer's)"))
    text_key: str = field(default="text", metadata=_help("the text field of .jsonl rows and .parquet columns"))
    data_cache: str = field(default="", metadata=_help(
        "folder for tokenized-text caches (default: .shardwise-cache next to the data)"))
    eval_data: str = field(default="", metadata=_help("held-out data to evaluate on (same formats as --data)"))
    eval_fraction: float = field(default=0.0, metadata=_help(
        "hold out the last fraction of --data's tokens for evaluation instead"))
    eval_every: int = field(default=0, metadata=_help("evaluate every N steps (0 = after the last step only)"))
    eval_batches: int = field(default=10, metadata=_help(
        "global batches of held-out windows per evaluation (0 = all of them; the run says which share of the "
        "held-out windows that is)"))
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
    stall_timeout: float = field(default=60.0, metadata=_help(
        "seconds without a heartbeat from a rank (stopped, frozen) before every other rank stops, naming it "
        "(0 = off; only used when below --timeout)"))
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


def build_parser() -> argparse.ArgumentParser:
    parser = ShortUsageParser(
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


def resolve_config(argv=None, problems: Problems | None = None) -> tuple[TrainConfig, GPTConfig]:
    """Parse and merge flags, ``--config`` and the preset; validate everything that can be.

    Every problem is reported at once (:class:`.errors.ConfigProblems` for several). With ``problems``
    given, they are added to it instead of raised, for the caller's further checks (``main``: the
    world size's) to join them."""
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
    found = Problems() if problems is None else problems
    _validate(cfg, model, found, set(explicit))
    if not found:  # these read the model's folder and the tokenizer: only for settings that hold together
        if cfg.hf_config or cfg.init_from:
            from .hf_train import resolve  # checks transformers (says how to install it) and the config/folder

            model = resolve(cfg, model)
        model = resolve_tokenizer(cfg, model, explicit)  # the tokenizer in effect; its vocabulary fits the model's
    if problems is None:
        found.raise_any()
    return cfg, model


def _validate(cfg: TrainConfig, model: GPTConfig, problems: Problems, explicit=frozenset()) -> None:
    """Every check of the settings, each problem added to ``problems`` (checks that depend on one skipped)."""
    from ..engine.placements import STRATEGY_PLACEMENTS, hybrid_problem, resolve_strategy

    for obj, names in ((cfg, _TRAIN_FIELDS), (model, _MODEL_FIELDS)):
        for name, f in names.items():
            if str(f.type) == "float" and not math.isfinite(getattr(obj, name)):
                problems.add(name, getattr(obj, name), "must be a finite number")
    for name in ("steps", "micro_batch_size", "grad_accum", "seq_len"):
        if getattr(cfg, name) < 1:
            problems.add(name, getattr(cfg, name), "must be at least 1")
    if not cfg.lr > 0:
        problems.add("lr", cfg.lr, "must be positive")
    if cfg.min_lr_ratio > 1:
        problems.add("min_lr_ratio", cfg.min_lr_ratio, "must be at most 1 (a fraction of --lr)")
    for name in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, name) < 1:
            problems.add(name, getattr(cfg, name), "must be in [0, 1)")
    if not cfg.timeout > 0:
        problems.add("timeout", cfg.timeout, "must be a positive number of seconds")
    if not cfg.stall_timeout >= 0:
        problems.add("stall_timeout", cfg.stall_timeout, "must be 0 (off) or a positive number of seconds")
    if not 0 <= cfg.offload_fraction <= 1:
        problems.add("offload_fraction", cfg.offload_fraction, "must be a fraction in [0, 1]")
    if cfg.compile:
        from torch import _dynamo

        backends = _dynamo.list_backends(exclude_tags=())
        if cfg.compile not in backends:
            problems.add("compile", cfg.compile, f"unknown torch.compile backend; choose from {', '.join(backends)}")
    if cfg.resume == "never":
        cfg.resume = ""
    if cfg.resume not in RESUME_MODES:
        problems.add(f"--resume={cfg.resume}", "", "use --resume (continue if there is a checkpoint) or "
                     "--resume=required (fail if there is none)")
    if cfg.resume and not (cfg.out_dir or cfg.name):
        problems.add(f"--resume={cfg.resume}", "", "needs --out-dir (or --name): the run folder whose "
                     "checkpoints to resume")
    if cfg.resume and cfg.overwrite:
        problems.add("overwrite", "", "cannot be combined with --resume: continue the run or replace it")
    if cfg.name and (Path(cfg.name).name != cfg.name or cfg.name in (".", "..") or "/" in cfg.name):
        problems.add("name", cfg.name, "must be a plain folder name under runs/ (no / or ..); use --out-dir "
                     "for a path")
    for name, f in _MODEL_FIELDS.items():  # after GPTConfig filled in its 0 = automatic defaults
        if problems.named(_MODEL_FIELDS) and name not in explicit:
            continue  # derived from a field already refused (--dim 0 makes --ffn-hidden 0): not a problem of its own
        if str(f.type) == "int" and getattr(model, name) < 1:
            problems.add(name, getattr(model, name), "must be at least 1")
    for name in ("norm_eps", "init_std", "rope_theta"):
        if not getattr(model, name) > 0:
            problems.add(name, getattr(model, name), "must be positive")
    if model.moe_aux_loss_coef < 0:
        problems.add("moe_aux_loss_coef", model.moe_aux_loss_coef, "must not be negative")
    if cfg.keep_checkpoints < 1:
        problems.add("keep_checkpoints", cfg.keep_checkpoints, "must be at least 1")
    for name in ("warmup_steps", "max_grad_norm", "weight_decay", "min_lr_ratio", "nproc", "outer_dp", "save_every"):
        if getattr(cfg, name) < 0:
            problems.add(name, getattr(cfg, name), "must not be negative")
    try:
        cfg.strategy = resolve_strategy(cfg.strategy)
    except ValueError:
        problems.add("strategy", cfg.strategy,
                     f"unknown strategy; use one of {sorted(STRATEGY_PLACEMENTS)} or 0-3")
    if cfg.outer_strategy and not problems.named(("strategy",)) and (
            why := hybrid_problem(cfg.strategy, cfg.outer_strategy, "--strategy")):
        problems.add("outer_strategy", cfg.outer_strategy, why)
    if cfg.outer_strategy and cfg.outer_dp < 1:
        problems.add("outer_strategy", cfg.outer_strategy, "needs --outer-dp N (the outer axis size)")
    if cfg.outer_dp and not cfg.outer_strategy:
        problems.add("outer_dp", cfg.outer_dp, "needs --outer-strategy no_shard or optim")
    from .muon import check_muon

    bad = check_muon(cfg)
    if bad:
        problems.add(*bad)
    if cfg.precision not in ("fp32", "bf16"):
        problems.add("precision", cfg.precision, "use fp32 or bf16")
    if cfg.device not in ("auto", "cpu", "cuda"):
        problems.add("device", cfg.device, "use auto, cpu or cuda")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        problems.add("device", cfg.device, "no CUDA device is available")
    if cfg.data_dtype and cfg.data_dtype not in DATA_DTYPES:
        problems.add("data_dtype", cfg.data_dtype, f"use one of {', '.join(DATA_DTYPES)}")
    if cfg.seq_len > model.max_seq_len:
        problems.add("max_seq_len", model.max_seq_len, f"is shorter than --seq-len {cfg.seq_len}")
    if not problems.named(_MODEL_FIELDS):  # its arithmetic needs sane fields
        try:
            model.validate()
        except ValueError as e:
            name, _, why = str(e).partition(": ")
            name = name.split("=")[0]
            problems.add(name, getattr(model, name, "?"), why)
    why = check_data_path(cfg.data or None, cfg.data_dtype)
    if why:
        problems.add("data", cfg.data, why)
    from .fp8 import check_fp8

    bad = check_fp8(cfg.fp8, cfg.fp8_all_gather, cfg.precision, cfg.strategy, cfg.outer_strategy, cfg.offload)
    if bad:
        problems.add(*bad)
    from .pipeline_train import check_flags as check_pipeline_flags

    if not problems.named(("n_layers",)):
        with problems.collect():
            check_pipeline_flags(cfg, model)
    from .context_parallel_train import check_flags as check_context_parallel_flags

    with problems.collect():
        check_context_parallel_flags(cfg, model)
    from .cuda_graphs_train import check_flags as check_cuda_graph_flags

    with problems.collect():
        check_cuda_graph_flags(cfg, model, device_type(cfg))
    if cfg.fp8 and (cfg.hf_config or cfg.init_from):
        problems.add("fp8", cfg.fp8, "with --hf-config / --init-from is not built yet (FP8 trains the GPT model)")
    with problems.collect():
        check_data_flags(cfg)
    for name in ("tensorboard", "wandb"):
        if getattr(cfg, name):
            from .loggers import missing_package

            why = missing_package(name)
            if why:
                problems.add(name, "", why)


def check_world(cfg: TrainConfig, model: GPTConfig, world: int, problems: Problems | None = None) -> None:
    """Checks that need the world size and the data (still before any process group); with ``problems``,
    added to it (the data is then read only when there are none)."""
    found = Problems() if problems is None else problems
    if cfg.pp > 1:
        from .pipeline_train import check_world as check_pipeline_world

        with found.collect():
            check_pipeline_world(cfg, world)
    elif cfg.cp > 1:
        from .context_parallel_train import check_world as check_context_parallel_world

        with found.collect():
            check_context_parallel_world(cfg, world)
    elif cfg.outer_dp > 0 and world % cfg.outer_dp:
        found.add("outer_dp", cfg.outer_dp, f"must divide the number of processes ({world})")
    found.raise_any()  # with problems of the settings too: all of them, before reading (or tokenizing) data
    # lengths and ids; text to tokenize is tokenized here, once, unless each process is a torchrun worker
    check_data(cfg, model, build=not under_launcher())


def device_type(cfg: TrainConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def default_out_dir(cfg: TrainConfig) -> str:
    name = cfg.name or f"{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg.out_dir or str(Path("runs") / name)

