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
starts; a bad value is reported as ``--flag value: reason`` (:mod:`.config`).

Started directly, the command starts ``--nproc`` local workers (default: one per
GPU, or 2 on CPU) and watches them like torchrun: when one fails, the others are
stopped; under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) it is the worker. Rank 0
shows a progress bar and writes to ``--out-dir`` (default ``runs/<name>``):
``config.json``, ``metrics.jsonl`` (one JSON object per step: step, loss, lr,
grad_norm, tokens (cumulative over the whole run), step_time_s, tokens_per_s,
mfu, mem_gib, elapsed_s, launch; with ``--pp`` also pp_bubble; after an evaluation
also eval_loss, eval_perplexity, eval_tokens, eval_time_s), ``summary.json`` and ``loss.png``
(both computed from the whole ``metrics.jsonl``, resumed parts included), and
with ``--tensorboard`` / ``--wandb`` their files (:mod:`.loggers`). Data,
tokenizer and evaluation flags: :mod:`.corpus`, :mod:`.tokenized`, :mod:`.evaluate`.

A run folder holds one run: starting again in a folder that has metrics or
checkpoints needs ``--resume`` (continue from the latest checkpoint) or
``--overwrite`` (delete the earlier run first). Every collective waits at most
``--timeout`` seconds for the other ranks; a stalled rank makes the others fail
with one line naming the step and collective, and the launcher stops the rest.

This module is the command and its worker: :func:`main` (launching), :func:`train`
(each rank: the process group, the model, the optimizer). The parts have their own
modules: :mod:`.config` (settings and their checks), :mod:`.run_folder`,
:mod:`.lr` (the schedule), :mod:`.resume`, :mod:`.loop` (the steps and metrics) and
:mod:`.summary` (``summary.json``, ``loss.png``); ``--pp`` (pipeline stages) is
:mod:`.pipeline_train`. Their public names are importable from here too.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint import CheckpointError, CheckpointManager
from ..engine.device import device_for
from ..models import GPT, GPTConfig
from ..engine.replaced_params import check_optimizer_params
from ..engine.teardown import destroy_process_groups
from .config import (ConfigError, TrainConfig, build_parser, check_world, default_out_dir, device_type,
                     resolve_config)
from .corpus import describe_coverage, open_data
from .data import TokenLoader
from .errors import PROG, Problems, say
from .launch import (EXIT_INTERRUPTED, WorkerError, available_cores, describe_collective_error, fail_now,
                     launch_local, one_line_warnings, process_started_at, report_started, run_guarded, under_launcher)
from .loop import DataParallelRun, Phase, run_steps
from .plan.estimate import DoesNotFit
from .lr import LRSchedule, lr_schedule, resumed_schedule
from .resume import global_batch_plan, restore
from .run_folder import prepare_run_folder
from .summary import finish, model_label, summarize
from .weight_decay import decayed_names, param_groups

__all__ = ["TrainConfig", "ConfigError", "LRSchedule", "resolve_config", "train", "main", "summarize",
           "build_parser", "prepare_run_folder", "lr_schedule", "resumed_schedule", "global_batch_plan"]

RENDEZVOUS_S = 600.0  # how long ranks may take to meet at start (imports, data), whatever --timeout is


def _pipeline_estimates(cfg: TrainConfig, model_cfg: GPTConfig, world: int, fused: bool) -> tuple[list, str]:
    """Each pipeline rank's memory estimate for ``--pp`` (the planner's fast path, ``plan/pipeline_estimate.py``), or ``([], why not)``."""
    from .pipeline_order import PIPELINE_SCHEDULES
    from .plan.pipeline_estimate import estimate_pipeline
    from .pipeline_train import parse_split, schedule_name

    name = schedule_name(cfg)
    if name not in PIPELINE_SCHEDULES or cfg.offload:
        why = "--offload" if cfg.offload else f"the {name} schedule"
        return [], f"not made for --pp with {why} (the pipeline estimate does not model it yet)"
    return estimate_pipeline(
        model_cfg, cfg.seq_len, cfg.micro_batch_size, pp=cfg.pp, dp=world // cfg.pp, schedule=name,
        n_microbatches=cfg.grad_accum, virtual=cfg.pp_virtual_stages, split=parse_split(cfg.pp_split),
        strategy=cfg.strategy, outer=cfg.outer_dp or None, outer_strategy=cfg.outer_strategy or "no_shard",
        precision=cfg.precision, vocab_units=False, optimizer="fused" if fused else "foreach"), ""  # no offload


def _pipeline_estimate(cfg: TrainConfig, model_cfg: GPTConfig, world: int, fused: bool, device_type: str) -> str:
    """The memory estimate's line for ``--pp``: the peak of every pipeline rank."""
    ranks, why = _pipeline_estimates(cfg, model_cfg, world, fused)
    if not ranks:
        return f"memory estimate: {why}"
    peaks = ", ".join(f"{e.gpu_bytes / 2**30:.2f}" for e in ranks)
    worst = max(range(cfg.pp), key=lambda r: ranks[r].gpu_bytes)
    return (f"memory estimate: per pipeline rank {peaks} GiB; the largest, rank {worst}: "
            f"{ranks[worst].describe(device_type)}")


def _fused(cfg: TrainConfig, device_type: str) -> bool:
    """AdamW's fused kernel on the GPU (no temporaries; it takes the clipping factor) and for offloaded
    state, where torch's default CPU AdamW is a per-tensor loop 3.4x slower (python -m
    benchmarks/cpu_adam.py, docs/performance.md); the default on CPU runs."""
    return bool(cfg.offload) or device_type == "cuda"


def _run_estimate(cfg: TrainConfig, model_cfg: GPTConfig, world: int, device_type: str, ranks_per_host: int):
    """The memory estimate of a run without ``--pp`` (``None`` for a Hugging Face model: not modelled); the
    planner's (``plan.fit``), so ``shardwise plan`` and this check count alike."""
    from .plan.fit import run_estimate

    return run_estimate(cfg, model_cfg, world, device_type, ranks_per_host, _fused(cfg, device_type))


def check_host_memory(cfg: TrainConfig, model_cfg: GPTConfig, world: int, ranks_per_host: int) -> None:
    """A CPU run: every rank's estimated peak together against the host's available memory (before any
    process starts); :class:`.plan.estimate.DoesNotFit` says what would fit."""
    from .host_memory import host_available_bytes
    from .plan.estimate import INTERPRETER_BYTES
    from .plan.fit import check_run_on_cpu

    available = host_available_bytes()
    if cfg.pp > 1:
        ranks, _ = _pipeline_estimates(cfg, model_cfg, world, _fused(cfg, "cpu"))
        if ranks and ranks_per_host == world and available is not None:  # every stage of every replica here
            needed = sum(e.gpu_bytes for e in ranks) * (world // cfg.pp) + INTERPRETER_BYTES * world
            if needed > available:
                raise DoesNotFit(
                    f"this configuration does not fit in this machine's memory: {world} pipeline ranks need "
                    f"{needed / 2**30:.1f} GiB together ({', '.join(f'{e.gpu_bytes / 2**30:.1f}' for e in ranks)} "
                    f"GiB per stage rank, and {INTERPRETER_BYTES / 2**30:.2f} GiB per rank's interpreter), "
                    f"{available / 2**30:.1f} GiB available (MemAvailable); use a smaller model, --micro-batch-size "
                    f"or --activation-checkpointing")
        return
    estimate = _run_estimate(cfg, model_cfg, world, "cpu", ranks_per_host)
    if estimate is not None:
        check_run_on_cpu(estimate, available, ranks_per_host)


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


def train(cfg: TrainConfig, model_cfg: GPTConfig, started_at: float | None = None) -> dict | None:
    """The worker: runs in every rank of an initialized (or to-be-initialized) process group.

    A collective that times out (a stalled rank) or loses its peer (a dead rank) raises
    :class:`WorkerError` with one line naming the step and collective.
    """
    started_at = started_at or time.time()
    kind = device_type(cfg)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if kind == "cuda":
        torch.cuda.set_device(local_rank)
    else:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
    owns_group = not dist.is_initialized()
    world = int(os.environ.get("WORLD_SIZE", 1))
    phase = Phase(f"process-group setup (each of the {world} ranks starts and joins)")
    if os.environ.get("RANK", "0") == "0":
        report_started()  # the launcher's own start-up notes end; this rank's phases take over
        phase.watch(say)
    if owns_group:
        if kind == "cuda":
            # NCCL: the watchdog aborts a collective that outlives the timeout and takes the process
            # down (it cannot be interrupted from Python); its monitor catches a stuck watchdog.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
            os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "1")
            # On a timeout the watchdog first waits for the flight-recorder dump (a minute by default).
            os.environ.setdefault("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "5000")
        # Ranks may start seconds apart (imports on a busy machine): the rendezvous gets at least
        # RENDEZVOUS_S; the collectives get --timeout (set on the groups below).
        dist.init_process_group("nccl" if kind == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=max(cfg.timeout, RENDEZVOUS_S)))
    device = device_for()  # the group's backend decides: NCCL -> this rank's GPU, gloo -> the CPU
    _limit_collective_waits(None, cfg.timeout)
    try:
        return _train(cfg, model_cfg, started_at, device, phase)
    except BaseException as e:
        phase.started()  # no more start-up notes
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
            destroy_process_groups()



def _stall_watchdog(cfg: TrainConfig, phase: Phase):
    """A started ``StallWatchdog`` when --stall-timeout is on and below --timeout (else the collectives' own
    timeout comes first): a stopped rank is named on every other, which then exits with that line."""
    if not 0 < cfg.stall_timeout < cfg.timeout or dist.get_world_size() == 1:
        return None
    from ..engine.watchdog import StallWatchdog

    return StallWatchdog(cfg.stall_timeout, describe=lambda: phase.now, on_stall=fail_now).start()


def _optimizer(cfg: TrainConfig, module, matrices: set[str], fused: bool) -> torch.optim.Optimizer:
    """AdamW (the matrices decayed), or with ``--optimizer muon`` Muon on the layers' matrices beside it."""
    adamw = {"betas": (cfg.beta1, cfg.beta2), **({"fused": True} if fused else {})}
    if cfg.optimizer == "muon":
        from .muon import MuonAdamW, muon_names

        return MuonAdamW(module, muon_names(module), lr=cfg.lr, weight_decay=cfg.weight_decay,
                         adamw_groups=lambda rest: _named_groups(module, rest, matrices, cfg.weight_decay), **adamw)
    return torch.optim.AdamW(param_groups(module, matrices, cfg.weight_decay), lr=cfg.lr, **adamw)


def _named_groups(module, params: list, matrices: set[str], weight_decay: float) -> list[dict]:
    """``param_groups`` (decay on the matrices) over ``params`` only."""
    ids = {id(p) for p in params}
    return [dict(g, params=[p for p in g["params"] if id(p) in ids])
            for g in param_groups(module, matrices, weight_decay)]


def _build_model(cfg: TrainConfig, model_cfg: GPTConfig, device: torch.device, policy, rank: int) -> tuple:
    """One model sharded over every rank: ``(model, n_params, flops_per_token, matrix names)``."""
    import shardwise

    mesh = shardwise.build_dp_mesh(outer=cfg.outer_dp or None, device_type=device.type, cp=cfg.cp) \
        if cfg.outer_dp or cfg.cp > 1 else None
    if cfg.cp > 1:  # its cp ranks split each sequence (fully_shard shards over dp_shard x cp)
        model_cfg = replace(model_cfg, cp_group=mesh.get_group("cp"))
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
                say(conversion.describe())
        if cfg.meta_init:
            init_fn = shardwise.MetaInitializer(model, device)
            init_fn.plan()  # records the RNG state each layer's init starts from in a direct build
        unit_modules = list(dict.fromkeys(type(layer) for layer in model.layers))
    n_params, flops_per_token = model.num_params(), model.flops_per_token(cfg.seq_len)
    matrices = decayed_names(model)
    placement_fn = None
    if cfg.optimizer == "muon":  # the layers' matrices whole on one owner rank each (app/muon.py)
        from .muon import owned_placement_fn

        placement_fn = owned_placement_fn(model)
    model = shardwise.fully_shard(
        model, mesh=mesh, strategy=cfg.strategy, outer_dp_sharding_strategy=cfg.outer_strategy or None,
        unit_modules=unit_modules, mixed_precision=policy, shard_placement_fn=placement_fn,
        init_fn=init_fn,
        offload_policy=shardwise.OffloadPolicy(fraction=cfg.offload_fraction) if cfg.offload else None,
        graph_safe=cfg.cuda_graphs)
    if init_fn is not None:
        init_fn.finish()
    if cfg.compile:  # each layer's forward; compiled at the first step
        shardwise.compile_units(model, modules=unit_modules, backend=cfg.compile)
    return model, n_params, flops_per_token, matrices


def _train(cfg: TrainConfig, model_cfg: GPTConfig, started_at: float, device: torch.device,
           phase: Phase) -> dict | None:
    import shardwise
    from tqdm import tqdm

    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = Path(cfg.out_dir)
    fused = _fused(cfg, device.type)
    phase("data (rank 0 tokenizes text that has no cache yet; the others wait)")
    train_tokens, eval_tokens = open_data(cfg, rank, world)  # before the model: a data error costs no model load
    phase("model setup (fully_shard)")
    if cfg.pp > 1:  # each pipeline rank's stages and the micro-batches its schedule keeps in flight
        if rank == 0:
            say(_pipeline_estimate(cfg, model_cfg, world, fused, device.type))
    else:  # what it will take, before anything is built (a CPU run's host was checked before it started)
        estimate = _run_estimate(cfg, model_cfg, world, device.type, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if estimate is not None and rank == 0:
            say(f"memory estimate: {estimate.describe(device.type)}")
        if estimate is not None and device.type == "cuda":  # on every rank, before any rank allocates
            from .host_memory import host_available_bytes
            from .plan.fit import check_run

            note = check_run(estimate, torch.cuda.mem_get_info(device)[0], host_available_bytes())
            if note and rank == 0:
                say(note)
    if rank == 0:
        say(f"building the model{' on the meta device' if cfg.meta_init and cfg.pp == 1 else ''} and sharding it "
            f"(fully_shard, {cfg.strategy}) over {world} ranks")
    torch.manual_seed(cfg.seed)
    policy = shardwise.MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if cfg.precision == "bf16" else None)
    if cfg.pp > 1:
        from .pipeline_train import build_pipeline

        run, (n_params, flops_per_token, matrices) = build_pipeline(
            cfg, model_cfg, device, world, policy, say if rank == 0 else (lambda message: None))
    else:
        model, n_params, flops_per_token, matrices = _build_model(cfg, model_cfg, device, policy, rank)
        if cfg.cp > 1:
            from .context_parallel_train import ContextParallelRun

            run = ContextParallelRun(model, model.config.cp_group)
        elif cfg.cuda_graphs:
            from .cuda_graphs_train import GraphedRun

            run = GraphedRun(model)
        else:
            run = DataParallelRun(model)
    for module in run.modules:
        _limit_collective_waits(module, cfg.timeout)
    for group in run.extra_groups:  # the pipeline's group: no parameter's mesh names it
        group.set_timeout(datetime.timedelta(seconds=cfg.timeout))
    optimizer = run.optimizer(lambda module: _optimizer(cfg, module, matrices, fused))
    saved_model, saved_optimizer = run.checkpointed(optimizer)
    for module, each in zip(*((saved_model, saved_optimizer) if isinstance(saved_model, list)
                              else ([saved_model], [saved_optimizer]))):
        check_optimizer_params(each, module)
    torch.manual_seed(cfg.seed + 1 + rank)  # dropout differs per rank
    loader = TokenLoader(train_tokens, cfg.seq_len, cfg.micro_batch_size, run.data_rank, run.data_ranks, cfg.seed,
                         device)
    checkpoints = CheckpointManager(out_dir / "checkpoints", keep_last=cfg.keep_checkpoints)
    phase("checkpoint load")
    start, grad_accum, tokens, schedule = restore(cfg, checkpoints, saved_model, saved_optimizer, loader,
                                                  run.data_ranks, rank, model_cfg.to_dict())
    evaluator = None
    if eval_tokens is not None:
        from .evaluate import Evaluator

        evaluator = Evaluator(eval_tokens, cfg.seq_len, cfg.micro_batch_size, cfg.micro_batch_size * grad_accum * world,
                              cfg.eval_batches, cfg.eval_every, cfg.steps, rank, world, device)

    metrics_file, launch = None, 0  # rank 0 writes the metrics
    if rank == 0:
        global_batch = cfg.micro_batch_size * grad_accum * run.data_ranks  # sequences (windows) per step
        say(describe_coverage(cfg, len(train_tokens), loader.num_windows, global_batch))
        if start <= cfg.steps:
            say(schedule.describe())
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
            say(f"nothing to train: the checkpoint is at step {start - 1} and --steps is {cfg.steps}")
        if evaluator is not None:
            say(evaluator.describe())
    loggers = None
    if rank == 0 and (cfg.tensorboard or cfg.wandb):
        from .loggers import RunLoggers

        loggers = RunLoggers(cfg, out_dir, start, json.loads((out_dir / "config.json").read_text()))
    phase.started()
    if rank == 0 and start <= cfg.steps:
        compiled = (f": each layer is compiled first (torch.compile, {cfg.compile}), which can take minutes"
                    if cfg.compile else " (allocation and warm-up: slower than the next)")
        say(f"step {start}: the first step{compiled}")
    # One bar per process: a thread lock will do. tqdm's default multiprocessing lock is a named
    # semaphore, which a killed rank leaks (and the resource tracker warns about at exit).
    tqdm.set_lock(threading.RLock())
    bar = tqdm(total=cfg.steps, initial=min(start - 1, cfg.steps), desc=f"{model_label(cfg)} x{world}{f' pp{cfg.pp}' if cfg.pp > 1 else ''}"
               f"{f' cp{cfg.cp}' if cfg.cp > 1 else ''}",
               disable=rank != 0, dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
    loop_started_at = time.time()
    # Nothing to train (a finished run resumed): rank 0 may be gone, and its store with it, before another rank
    # would connect its watchdog's client to that store (which then waits out --timeout).
    watchdog = _stall_watchdog(cfg, phase) if start <= cfg.steps else None
    try:
        trained = run_steps(cfg, run, optimizer, loader, checkpoints, schedule, start, grad_accum,
                            tokens, device, phase, bar, metrics_file, launch, flops_per_token, evaluator, loggers)
    finally:
        if watchdog is not None:
            watchdog.close()
        bar.close()  # ends the progress line before anything else is printed
        if loggers is not None:
            loggers.close()
    phase("shutdown")
    if rank != 0:
        return None
    metrics_file.close()
    if not trained:
        return None
    return finish(out_dir, cfg, n_params, world, time.time() - started_at, loop_started_at - started_at)



def _start_notes(cfg: TrainConfig) -> list[str]:
    """What a run should know before it starts (said once, by the launcher or rank 0)."""
    from .fp8 import cpu_note

    return [note for note in [cpu_note(cfg.fp8, cfg.compile, device_type(cfg))] if note]


def _worker_prog() -> str:
    rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
    return f"{PROG}: rank {rank}" if world > 1 else PROG


def main(argv=None) -> int:
    started_at = process_started_at()  # the interpreter's start: wall time includes importing torch
    launched = under_launcher()
    one_line_warnings(_worker_prog() if launched else PROG)
    try:
        problems = Problems()  # every problem of the flags and of the world size, said at once
        cfg, model_cfg = resolve_config(argv, problems)
        if launched:
            world = int(os.environ["WORLD_SIZE"])
        elif cfg.nproc > 0:
            world = cfg.nproc
        else:
            world = torch.cuda.device_count() if device_type(cfg) == "cuda" else 2
        if device_type(cfg) == "cuda" and not launched and world > torch.cuda.device_count():
            problems.add("nproc", world, f"more processes than GPUs ({torch.cuda.device_count()}): one process per "
                                         f"GPU; --nproc {torch.cuda.device_count()} or fewer")
        cores = available_cores()
        if device_type(cfg) == "cpu" and not launched and world > cores and not problems:
            say(f"warning: --nproc {world} on {cores} CPU core{'s' if cores > 1 else ''}: each process gets "
                f"{cores / world:.2g} of a core, so every step takes longer than with --nproc {cores}")
        check_world(cfg, model_cfg, world, problems)  # raises them all, then reads the data
        if device_type(cfg) == "cpu":  # the ranks share the host's memory: all of it, before any starts
            check_host_memory(cfg, model_cfg, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
        if cfg.dry_run:  # before any worker: the dry run needs the one default process group of this process
            if launched:
                raise ConfigError("--dry-run runs in shardwise train's own launcher, before the workers start; "
                                  "under torchrun run it once without torchrun (or shardwise plan --dry-run)")
            from .plan.job_dry_run import dry_run_job

            say(dry_run_job(cfg, model_cfg, world, device_type(cfg))[1])
        cfg = replace(cfg, out_dir=default_out_dir(cfg))
        rank0 = not launched or os.environ.get("RANK") == "0"
        prepare_run_folder(cfg, rank0=rank0, announce=rank0)
        if rank0:
            for note in _start_notes(cfg):
                say(note)
    except (ConfigError, DoesNotFit) as e:
        say(f"error: {e}")
        return 2
    except KeyboardInterrupt:
        say("interrupted (Ctrl-C)")
        return EXIT_INTERRUPTED
    if launched:  # torchrun started this process: it is the worker; torchrun watches the others
        code = run_guarded(train, (cfg, model_cfg, started_at), _worker_prog())
        if code == EXIT_INTERRUPTED:
            say("interrupted (Ctrl-C)")
        return code
    # The workers' fork server imports this module (torch, shardwise) and torch._dynamo (fully_shard's hooks
    # and torch's optimizers import it at the first step) once for all of them.
    return launch_local(train, world, (cfg, model_cfg, started_at), PROG, startup_notes=True,
                        preload=("torch._dynamo",))


if __name__ == "__main__":
    from shardwise.app.train import main as _main  # so the workers unpickle shardwise.app.train.*

    sys.exit(_main())
