"""``shardwise train``: train a reference model with ``shardwise.fully_shard``.

    shardwise train --preset tiny                       # 2 CPU processes (gloo), stdlib bytes
    shardwise train --preset 1b --strategy optim_grads  # one process per GPU (NCCL)
    torchrun --nproc-per-node 8 -m shardwise.train --preset 8b
    python -m shardwise.train --preset tiny --steps 50 --dim 64 --config overrides.json

Settings come from, lowest first: the dataclass defaults, ``--preset``, a
``--config`` JSON file (field names with ``_`` or ``-``), then flags. Every
field of :class:`TrainConfig` and :class:`shardwise.models.GPTConfig` is a flag
(``--n-layers``, ``--micro-batch-size``, ``--activation-checkpointing`` /
``--no-activation-checkpointing``...). Everything is checked before any process
starts; a bad value is reported as ``--flag value: reason``.

Started directly, the command spawns ``--nproc`` local workers (default: one per
GPU, or 2 on CPU); under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) it is the
worker. Rank 0 shows a progress bar and writes to ``--out-dir`` (default
``runs/<name>``): ``config.json``, ``metrics.jsonl`` (one JSON object per step:
step, loss, lr, grad_norm, tokens, step_time_s, tokens_per_s, mfu, mem_gib,
elapsed_s), ``summary.json`` and ``loss.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

from .checkpoint import CheckpointManager
from .data import DATA_DTYPES, TokenLoader, check_data_path, load_tokens
from .models import GPT, GPTConfig
from .launch import launch_local, under_launcher
from .presets import PRESETS

__all__ = ["TrainConfig", "ConfigError", "resolve_config", "train", "main"]

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
    seed: int = field(default=0, metadata=_help("seed for init and data order"))
    data: str = field(default="", metadata=_help(
        "text file, folder of text files, or .bin token file (default: Python stdlib sources as bytes)"))
    data_dtype: str = field(default="uint16", metadata=_help("token dtype of a .bin file: uint16 or uint8"))
    out_dir: str = field(default="", metadata=_help("output folder (default runs/<name>)"))
    name: str = field(default="", metadata=_help("run name (default <preset>-<timestamp>)"))
    save_every: int = field(default=0, metadata=_help(
        "save a checkpoint every N steps (and at the last) into <out-dir>/checkpoints (0 = never)"))
    keep_checkpoints: int = field(default=3, metadata=_help("complete checkpoints to keep"))
    resume: bool = field(default=False, metadata=_help(
        "resume from the latest complete checkpoint in <out-dir>/checkpoints (needs --out-dir or --name)"))
    nproc: int = field(default=0, metadata=_help("local worker processes (0 = one per GPU, or 2 on CPU)"))
    meta_init: bool = field(default=True, metadata=_help(
        "build the model on the meta device and initialize it one layer at a time while sharding "
        "(the same weights as a direct build, without ever holding the whole model)"))
    device: str = field(default="auto", metadata=_help("auto, cpu or cuda"))


_TRAIN_FIELDS = {f.name: f for f in fields(TrainConfig)}
_MODEL_FIELDS = {f.name: f for f in GPTConfig.cli_fields()}
assert not set(_TRAIN_FIELDS) & set(_MODEL_FIELDS)
_ALL_FIELDS = {**_TRAIN_FIELDS, **_MODEL_FIELDS}
_CASTS = {"int": int, "float": float, "str": str, "bool": bool}


class ConfigError(ValueError):
    """A bad setting, reported as ``--flag value: reason``."""

    def __init__(self, name: str, value, why: str):
        flag = name if name.startswith("-") else "--" + name.replace("_", "-")
        super().__init__(f"{flag} {value}: {why}")


# ------------------------------------------------------------------ configuration
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardwise train", description="Train a reference model with shardwise.fully_shard.",
        argument_default=argparse.SUPPRESS,
        epilog="Defaults shown are the dataclass defaults; --preset (default tiny) overrides many.")
    parser.add_argument("--config", help="JSON file of field -> value overrides (applied after --preset)")
    parser.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    for title, group_fields in (("training", _TRAIN_FIELDS), ("model", _MODEL_FIELDS)):
        group = parser.add_argument_group(title)
        for name, f in group_fields.items():
            flag = "--" + name.replace("_", "-")
            kind = _CASTS[str(f.type)]
            text = f"{f.metadata.get('help')} (default: {f.default!r})"
            if kind is bool:
                group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=text)
            else:
                group.add_argument(flag, dest=name, type=kind, metavar=kind.__name__.upper(), help=text)
    return parser


def _coerce(name: str, value, source: str):
    kind = _CASTS[str(_ALL_FIELDS[name].type)]
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(source, value, f"field {name!r} needs true or false")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(source, value, f"field {name!r} needs a {kind.__name__}") from None


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
    if "max_seq_len" not in explicit:
        values["max_seq_len"] = values.get("seq_len", TrainConfig.seq_len)
    cfg = TrainConfig(**{k: v for k, v in values.items() if k in _TRAIN_FIELDS})
    model = GPTConfig(**{k: v for k, v in values.items() if k in _MODEL_FIELDS})
    _validate(cfg, model)
    return cfg, model


def _validate(cfg: TrainConfig, model: GPTConfig) -> None:
    import shardwise

    for name in ("steps", "micro_batch_size", "grad_accum", "seq_len"):
        if getattr(cfg, name) < 1:
            raise ConfigError(name, getattr(cfg, name), "must be at least 1")
    if not cfg.lr > 0:
        raise ConfigError("lr", cfg.lr, "must be positive")
    if cfg.resume and not (cfg.out_dir or cfg.name):
        raise ConfigError("resume", True, "needs --out-dir (or --name): the run folder whose checkpoints to resume")
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
    if cfg.data_dtype not in DATA_DTYPES:
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


def _check_world(cfg: TrainConfig, model: GPTConfig, world: int) -> None:
    """Checks that need the world size and the data (still before any process group)."""
    if cfg.outer_dp and world % cfg.outer_dp:
        raise ConfigError("outer_dp", cfg.outer_dp, f"must divide the number of processes ({world})")
    tokens = load_tokens(cfg.data or None, cfg.data_dtype)
    if len(tokens) <= cfg.seq_len:
        raise ConfigError("data", cfg.data or "(stdlib)", f"{len(tokens)} tokens, too few for --seq-len {cfg.seq_len}")
    top = int(tokens.max())
    if top >= model.vocab_size:
        raise ConfigError("vocab_size", model.vocab_size, f"data {cfg.data or '(stdlib)'} holds token id {top}")


def _device_type(cfg: TrainConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def _default_out_dir(cfg: TrainConfig) -> str:
    name = cfg.name or f"{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg.out_dir or str(Path("runs") / name)


# ------------------------------------------------------------------ training
def _lr_at(cfg: TrainConfig, step: int) -> float:
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


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


def train(cfg: TrainConfig, model_cfg: GPTConfig, started_at: float | None = None) -> dict | None:
    """The worker: runs in every rank of an initialized (or to-be-initialized) process group."""
    import shardwise
    from tqdm import tqdm

    started_at = started_at or time.time()
    device_type = _device_type(cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        out_dir = Path(cfg.out_dir)
        torch.manual_seed(cfg.seed)
        init_fn = None
        with torch.device("meta" if cfg.meta_init else device):
            model = GPT(model_cfg)
        if cfg.meta_init:
            init_fn = shardwise.MetaInitializer(model, device)
            init_fn.plan()  # records the RNG state each layer's init starts from in a direct build
        n_params, flops_per_token = model.num_params(), model.flops_per_token(cfg.seq_len)
        matrices = {n for n, p in model.named_parameters() if p.dim() >= 2 and not n.startswith("embed.")}
        mesh = shardwise.build_dp_mesh(outer=cfg.outer_dp, device_type=device_type) if cfg.outer_dp else None
        policy = shardwise.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if cfg.precision == "bf16" else None)
        model = shardwise.fully_shard(
            model, mesh=mesh, strategy=cfg.strategy, outer_dp_sharding_strategy=cfg.outer_strategy or None,
            unit_modules=list(dict.fromkeys(type(layer) for layer in model.layers)), mixed_precision=policy,
            init_fn=init_fn)
        if init_fn is not None:
            init_fn.finish()
        optimizer = torch.optim.AdamW(_param_groups(model, matrices, cfg.weight_decay),
                                      lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
        torch.manual_seed(cfg.seed + 1 + rank)  # dropout differs per rank
        loader = TokenLoader(load_tokens(cfg.data or None, cfg.data_dtype), cfg.seq_len,
                             cfg.micro_batch_size, rank, world, cfg.seed, device)
        tokens_per_step = cfg.micro_batch_size * cfg.seq_len * cfg.grad_accum * world
        checkpoints = CheckpointManager(out_dir / "checkpoints", keep_last=cfg.keep_checkpoints)
        start = 1
        if cfg.resume:
            restored = checkpoints.load_latest(model, optimizer)  # also restores every rank's RNG
            if restored is not None:
                loader.load_state_dict(restored.extra["data"])
                start = restored.step + 1
                if rank == 0:
                    print(f"resumed from {restored.path} (step {restored.step})", file=sys.stderr)

        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "config.json").write_text(json.dumps(
                {"train": vars(cfg), "model": model_cfg.to_dict(), "world_size": world,
                 "device": device_type, "params": n_params}, indent=2) + "\n")
            metrics = out_dir / "metrics.jsonl"
            kept = metrics.read_text().splitlines() if start > 1 and metrics.exists() else []
            kept = [line for line in kept if json.loads(line)["step"] < start]  # drop steps being redone
            metrics_file = open(metrics, "w", buffering=1)
            metrics_file.writelines(line + "\n" for line in kept)
        bar = tqdm(total=cfg.steps, initial=start - 1, desc=f"{cfg.preset} x{world}", disable=rank != 0,
                   dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
        history, loop_start = [], time.perf_counter()
        model.train()
        for step in range(start, cfg.steps + 1):
            t0 = time.perf_counter()
            lr = _lr_at(cfg, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss_sum = torch.zeros((), device=device)
            for micro in range(cfg.grad_accum):
                inputs, targets = next(loader)
                last = micro == cfg.grad_accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = model(inputs, targets)
                    (loss / cfg.grad_accum).backward()
                loss_sum += loss.detach().float()
            if cfg.max_grad_norm > 0:
                grad_norm = shardwise.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            else:
                grad_norm = shardwise.grad_norm(model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            dist.all_reduce(loss_sum)
            loss_value = loss_sum.item() / (cfg.grad_accum * world)  # .item() syncs the device
            step_time = time.perf_counter() - t0
            if cfg.save_every and (step % cfg.save_every == 0 or step == cfg.steps):
                checkpoints.save(step, model, optimizer, extra={"data": loader.state_dict()})
            if rank != 0:
                continue
            record = {
                "step": step, "loss": loss_value, "lr": lr, "grad_norm": float(grad_norm),
                "tokens": step * tokens_per_step, "step_time_s": step_time,
                "tokens_per_s": tokens_per_step / step_time,
                "mfu": (tokens_per_step / step_time * flops_per_token / (PEAK_FLOPS_PER_GPU * world)
                        if device_type == "cuda" else None),
                "mem_gib": _memory_gib(device), "elapsed_s": time.perf_counter() - loop_start,
            }
            history.append(record)
            metrics_file.write(json.dumps(record) + "\n")
            postfix = {"loss": f"{loss_value:.3f}", "tok/s": f"{record['tokens_per_s']:,.0f}",
                       "mem": f"{record['mem_gib']:.2f}G"}
            if record["mfu"] is not None:
                postfix["mfu"] = f"{100 * record['mfu']:.1f}%"
            bar.set_postfix(postfix, refresh=False)
            bar.update()
        bar.close()
        if rank != 0:
            return None
        metrics_file.close()
        if not history:  # resumed at or past --steps: nothing left to train
            return None
        return _finish(out_dir, history, cfg, n_params, world, time.time() - started_at)
    finally:
        if owns_group:
            dist.destroy_process_group()


def _finish(out_dir: Path, history: list[dict], cfg: TrainConfig, n_params: int, world: int,
            wall_time: float) -> dict:
    steady = history[1:] or history  # the first step pays for allocation and warm-up
    steady_time = sum(r["step_time_s"] for r in steady)
    tail = [r["loss"] for r in history[-10:]]
    summary = {
        "preset": cfg.preset, "params": n_params, "world_size": world, "steps": len(history),
        "first_loss": history[0]["loss"], "last_loss": history[-1]["loss"],
        "last10_mean_loss": sum(tail) / len(tail), "tokens": history[-1]["tokens"],
        "tokens_per_s": len(steady) * history[0]["tokens"] / steady_time,
        "mfu": (sum(r["mfu"] for r in steady) / len(steady)) if steady[0]["mfu"] is not None else None,
        "peak_mem_gib": max(r["mem_gib"] for r in history),
        "train_time_s": history[-1]["elapsed_s"], "wall_time_s": wall_time, "out_dir": str(out_dir),
    }
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(out_dir / "loss.png", history, cfg)
    mfu = f", MFU {100 * summary['mfu']:.1f}%" if summary["mfu"] is not None else ""
    print(f"\n{cfg.preset}: {n_params / 1e6:.2f}M params, {world} ranks, {len(history)} steps\n"
          f"  loss {summary['first_loss']:.3f} -> {summary['last_loss']:.3f} "
          f"(last-10 mean {summary['last10_mean_loss']:.3f})\n"
          f"  {summary['tokens_per_s']:,.0f} tokens/s{mfu}, peak mem {summary['peak_mem_gib']:.2f} GiB\n"
          f"  train {summary['train_time_s']:.1f}s, wall {wall_time:.1f}s\n"
          f"  outputs: {out_dir}/ (metrics.jsonl, loss.png, summary.json, config.json)", flush=True)
    return summary


def _plot(path: Path, history: list[dict], cfg: TrainConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_speed) = plt.subplots(1, 2, figsize=(10, 4))
    steps = [r["step"] for r in history]
    ax_loss.plot(steps, [r["loss"] for r in history])
    ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title=f"{cfg.preset}: training loss")
    ax_loss.grid(alpha=0.3)
    ax_speed.plot(steps, [r["tokens_per_s"] for r in history])
    ax_speed.set(xlabel="step", ylabel="tokens/s (all ranks)", title="throughput")
    ax_speed.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------ launching
def main(argv=None) -> int:
    started_at = time.time()
    try:
        cfg, model_cfg = resolve_config(argv)
        launched = under_launcher()
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
        if not launched:
            try:
                Path(cfg.out_dir).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError("out_dir", cfg.out_dir, e.strerror or str(e)) from None
    except ConfigError as e:
        print(f"shardwise train: error: {e}", file=sys.stderr)
        return 2
    if launched:
        train(cfg, model_cfg, started_at)
        return 0
    return launch_local(train, world, (cfg, model_cfg, started_at), "shardwise train")


if __name__ == "__main__":
    from shardwise.train import main as _main  # so spawned workers unpickle shardwise.train.*

    sys.exit(_main())
