"""``shardwise bench``: train one model under shardwise, FSDP2, DDP and megatron-fsdp in one job.

    shardwise bench --size tiny --device cpu --nproc 2              # CPU, gloo, a minute
    shardwise bench --sizes 0.9b,2.8b,8b --out runs/bench           # one process per GPU
    shardwise bench --sizes 0.9b --repeats 2 --steps 20 --wrappers fsdp2,shardwise
    shardwise bench --sizes 0.9b,2.8b,8b --wrappers fsdp2,shardwise,none --compile both
    shardwise bench --sizes 2.8b,8b --wrappers fsdp2,fsdp2-fp8ag,shardwise,none --fp8 off,tensorwise,rowwise
    shardwise bench --sizes 0.9b --wrappers shardwise,none --compile --cuda-graphs on,off   # one GPU
    torchrun --nproc-per-node 2 -m shardwise bench --sizes 8b --steps 8b=6
    shardwise bench --device cpu --nproc 2 --pp 2 --pp-schedule 1f1b   # a pipeline of shardwise stages
    shardwise bench --device cpu --nproc 4 --cp 2 --seq-len 256        # each sequence over 2 ranks (CP)

Started directly it spawns ``--nproc`` local workers (default: one per GPU, or 2
on CPU); under ``torchrun`` it is the worker. Each size is trained under every
wrapper in turn (``--repeats 2`` runs the order again reversed), results are
printed as each run ends, and rank 0 writes ``bench.json`` (every run, the
summary and the settings), ``bench.md`` (the table) and ``bench.png`` (bar
charts) under ``--out``; the JSON and table are rewritten after every run, so a
job cut short still leaves what it measured. See :mod:`shardwise.app.bench.runner`
for exactly what is measured. With ``--pp N`` it trains an ``N``-stage pipeline
of shardwise stages instead (:mod:`shardwise.app.bench.pipeline`), writing
``bench_pp.json``. With ``--cp N`` it trains shardwise with each sequence split
over ``N`` ranks (:mod:`shardwise.app.bench.context_parallel`), writing
``bench_cp.json``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import ShortUsageParser
from ..launch import launch_local, under_launcher
from ..muon import OPTIMIZERS
from .report import format_run, write_reports
from ...engine.fp8 import require_torchao
from ...engine.placements import resolve_strategy
from ...engine.teardown import destroy_process_groups
from .fp8 import FP8_MODES
from .graphs import GRAPH_MODES
from .pipeline import MULTI_STAGE_SCHEDULES, format_pipeline_run, run_pipeline_benchmark
from ..pipeline_order import PIPELINE_SCHEDULES
from .context_parallel import check_options as check_context_parallel_options
from .context_parallel import format_context_parallel_run, run_context_parallel_benchmark
from .runner import COMPILE_MODES, GRAD_COMM_DTYPES, BenchOptions, run_benchmark
from .sizes import SIZES
from .wrappers import CLIP_MODES, DEFAULT_ORDER, WRAPPERS, wrapper_version

__all__ = ["build_parser", "parse_options", "worker", "main"]

GPU_SIZES = "0.9b,2.8b,8b"


class UsageError(ValueError):
    pass


class _DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: ...)" only to a help that does not say its default itself."""

    def _get_help_string(self, action):
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = ShortUsageParser(prog="shardwise bench", description=__doc__.split("\n\n")[0],
                                formatter_class=_DefaultsOnce)
    p.add_argument("--sizes", "--size", dest="sizes", default=None,
                   help=f"comma list of {', '.join(SIZES)} (default: tiny on CPU, {GPU_SIZES} on CUDA)")
    p.add_argument("--wrappers", default=",".join(DEFAULT_ORDER),
                   help=f"comma list, run in this order: {', '.join(WRAPPERS)} (none: the compute-only "
                        "ceiling, bf16 weights, each rank its own replica, no communication)")
    p.add_argument("--compile", nargs="?", const="on", default="off", choices=tuple(COMPILE_MODES),
                   help="torch.compile each layer's forward under every wrapper that supports it "
                        "(--compile = on; both = eager and compiled runs interleaved in one job)")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --compile")
    p.add_argument("--cuda-graphs", default="off",
                   help="comma list of on/off: each step of shardwise (graph_safe=True) and the ceiling captured "
                        "in a CUDA graph and replayed (shardwise.capture_step); on,off runs both in one job "
                        "(CUDA only)")
    p.add_argument("--fp8", default="off",
                   help="comma list of FP8 modes run in turn: off (bf16 linears), tensorwise, rowwise (torchao "
                        "Float8Linear for every linear but the output head, under every wrapper; pip install "
                        "'shardwise[fp8]'); with any FP8 mode --compile defaults to on")
    p.add_argument("--offload", nargs="?", type=float, const=1.0, default=0.0, metavar="FRACTION",
                   help="main weights and optimizer state on the host: shardwise offloads FRACTION of the "
                        "parameters (--offload = all), FSDP2 (CPUOffloadPolicy) all of them")
    p.add_argument("--grad-comm-dtype", default="fp32", choices=tuple(GRAD_COMM_DTYPES),
                   help="dtype shardwise's gradients travel in during reduction (accumulated in fp32 either way)")
    p.add_argument("--max-grad-norm", type=float, default=0.0,
                   help="clip the global gradient norm to this under every wrapper (0 = no clipping)")
    p.add_argument("--clip-mode", default="fold", choices=CLIP_MODES,
                   help="how shardwise applies the clipping factor: folded into the fused AdamW step, or "
                        "gradients scaled in place (as the other wrappers do)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--nproc", type=int, default=0, help="local workers (0 = one per GPU, or 2 on CPU)")
    p.add_argument("--steps", default="", help="timed steps: N for every size, or SIZE=N,... (default: 10)")
    p.add_argument("--warmup", default="", help="warm-up steps before timing: N or SIZE=N,... (default: 3)")
    p.add_argument("--profile-steps", type=int, default=2,
                   help="extra profiled steps per run for exposed communication (CUDA; 0 = off)")
    p.add_argument("--repeats", type=int, default=1, help="run every wrapper this many times, order alternated")
    p.add_argument("--strategy", default="optim_grads_params", help="shardwise sharding strategy (or ZeRO 0-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the random tokens")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per GPU per step (0 = the size's)")
    p.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (0 = the size's)")
    p.add_argument("--loss-rtol", type=float, default=1.6e-2,
                   help="last-step loss tolerance against FSDP2 (relative; bf16 unit roundoff)")
    p.add_argument("--out", default="runs/bench", help="folder for bench.json, bench.md, bench.png")
    p.add_argument("--pp", type=int, default=0,
                   help="pipeline stages: train a pipeline of shardwise stages (--nproc divisible by it) and report "
                        "tokens/s, the bubble and the memory estimate against the measurement, instead of the "
                        "wrappers (0 = off)")
    p.add_argument("--pp-schedule", default="1f1b", choices=PIPELINE_SCHEDULES, help="the pipeline schedule")
    p.add_argument("--pp-virtual", type=int, default=0,
                   help="stages per rank (0 = 2 for interleaved and looped_bfs, else 1)")
    p.add_argument("--pp-microbatches", type=int, default=0, help="micro-batches per step (0 = 2 x --pp)")
    p.add_argument("--cp", type=int, default=0,
                   help="context parallelism: train shardwise with each sequence split over this many ranks "
                        "(--nproc divisible by it, the sequence length by 2 x it) and report tokens/s and the "
                        "activation estimate against the measurement, instead of the wrappers (0 = off)")
    p.add_argument("--optimizer", default="adamw",
                   help="comma list of adamw, muon: each runs in turn (muon: torch.optim.Muon on the layers' "
                        "matrices, whole on one owner rank each, AdamW on the rest; under shardwise and none)")
    p.add_argument("--save-traces", action="store_true",
                   help="also write rank 0's chrome trace of the profiled steps to OUT/traces/")
    return p


def _per_size(text: str, flag: str) -> dict:
    values = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, _, value = item.rpartition("=")
        key = key or "*"
        if key != "*" and key not in SIZES:
            raise UsageError(f"{flag} {text}: unknown size {key!r}")
        try:
            values[key] = int(value)
        except ValueError:
            raise UsageError(f"{flag} {text}: {value!r} is not an integer") from None
        if values[key] < (1 if flag == "--steps" else 0):
            raise UsageError(f"{flag} {text}: {values[key]} is too small")
    return values


def parse_options(argv) -> tuple[BenchOptions, argparse.Namespace]:
    """Flags -> options, with every check that needs no process group."""
    args = build_parser().parse_args(argv)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available")
    sizes = [s.strip() for s in (args.sizes or ("tiny" if device == "cpu" else GPU_SIZES)).split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            raise UsageError(f"--sizes {args.sizes}: unknown size {s!r}; choose from {', '.join(SIZES)}")
    wrappers = [w.strip() for w in args.wrappers.split(",") if w.strip()]
    for w in wrappers:
        if w not in WRAPPERS:
            raise UsageError(f"--wrappers {args.wrappers}: unknown wrapper {w!r}; "
                             f"choose from {', '.join(WRAPPERS)}")
    if not wrappers or len(set(wrappers)) != len(wrappers):
        raise UsageError(f"--wrappers {args.wrappers}: name each wrapper once")
    try:
        strategy = resolve_strategy(args.strategy)
    except ValueError:
        raise UsageError(f"--strategy {args.strategy}: unknown strategy") from None
    fp8 = [m.strip() for m in args.fp8.split(",") if m.strip()]
    for mode in fp8:
        if mode not in FP8_MODES:
            raise UsageError(f"--fp8 {args.fp8}: unknown mode {mode!r}; choose from {', '.join(FP8_MODES)}")
    if not fp8 or len(set(fp8)) != len(fp8):
        raise UsageError(f"--fp8 {args.fp8}: name each mode once")
    if any(mode != "off" for mode in fp8):
        try:
            require_torchao()
        except ImportError as e:
            raise UsageError(f"--fp8 {args.fp8}: {e}") from None
        given = list(argv or [])
        if "--compile" not in given and not any(a.startswith("--compile=") for a in given):
            args.compile = "on"  # FP8 matmuls pay only compiled
    optimizers = [m.strip() for m in args.optimizer.split(",") if m.strip()]
    if not optimizers or len(set(optimizers)) != len(optimizers) or any(m not in OPTIMIZERS for m in optimizers):
        raise UsageError(f"--optimizer {args.optimizer}: a comma list of {', '.join(OPTIMIZERS)}, each once")
    graphs = [m.strip() for m in args.cuda_graphs.split(",") if m.strip()]
    if not graphs or len(set(graphs)) != len(graphs) or any(m not in GRAPH_MODES for m in graphs):
        raise UsageError(f"--cuda-graphs {args.cuda_graphs}: a comma list of on and off, each once")
    if "on" in graphs and device != "cuda":
        raise UsageError(f"--cuda-graphs {args.cuda_graphs}: CUDA graphs need CUDA; this run is on the CPU "
                         "(use --cuda-graphs off, or a GPU)")
    if args.compile != "off":
        from torch import _dynamo

        backends = _dynamo.list_backends(exclude_tags=())
        if args.compile_backend not in backends:
            raise UsageError(f"--compile-backend {args.compile_backend}: unknown backend; "
                             f"choose from {', '.join(backends)}")
    if not 0.0 <= args.offload <= 1.0:
        raise UsageError(f"--offload {args.offload}: must be a fraction in [0, 1]")
    if not args.max_grad_norm >= 0.0:  # NaN too
        raise UsageError(f"--max-grad-norm {args.max_grad_norm}: must be 0 (no clipping) or positive")
    for flag in ("repeats", "nproc", "profile_steps", "micro_batch", "seq_len"):
        value = getattr(args, flag)
        if value < (1 if flag == "repeats" else 0):
            raise UsageError(f"--{flag.replace('_', '-')} {value}: too small")
    for flag in ("pp", "pp_virtual", "pp_microbatches"):
        if getattr(args, flag) < 0:
            raise UsageError(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must not be negative")
    if args.pp and args.pp_virtual > 1 and args.pp_schedule not in MULTI_STAGE_SCHEDULES:
        raise UsageError(f"--pp-virtual {args.pp_virtual}: --pp-schedule {args.pp_schedule} runs one stage per rank; "
                         f"use one of {', '.join(MULTI_STAGE_SCHEDULES)}")
    if not args.pp and (args.pp_virtual or args.pp_microbatches):
        raise UsageError("--pp-virtual and --pp-microbatches need --pp")
    opts = BenchOptions(
        sizes=sizes, wrappers=wrappers, device=device, steps=_per_size(args.steps, "--steps"),
        warmup=_per_size(args.warmup, "--warmup"), profile_steps=args.profile_steps, repeats=args.repeats,
        strategy=strategy, seed=args.seed, micro_batch=args.micro_batch, seq_len=args.seq_len,
        loss_rtol=args.loss_rtol, trace_dir=str(Path(args.out) / "traces") if args.save_traces else "",
        compile=args.compile, compile_backend=args.compile_backend, offload=args.offload,
        grad_comm_dtype=args.grad_comm_dtype, max_grad_norm=args.max_grad_norm, clip_mode=args.clip_mode,
        fp8=tuple(fp8), pp=args.pp, pp_schedule=args.pp_schedule, pp_virtual=args.pp_virtual,
        pp_microbatches=args.pp_microbatches, cuda_graphs=tuple(GRAPH_MODES[m] for m in graphs),
        cp=args.cp, optimizers=tuple(optimizers))
    why = check_context_parallel_options(opts, wrappers_given=any(a.startswith("--wrappers") for a in argv or []))
    if why:
        raise UsageError(why)
    return opts, args


def _meta(opts: BenchOptions, out: str, command: str) -> dict:
    cuda = opts.device == "cuda"
    nccl = None
    if cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001
            nccl = "unknown"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": command, "out": out,
        "world_size": dist.get_world_size(), "device": opts.device,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "nccl": nccl, "python": sys.version.split()[0],
        "versions": {w: wrapper_version(w) for w in opts.wrappers if w not in ("fsdp2", "ddp", "none", "none-fp32main")},
        "loss_rtol": opts.loss_rtol,
        "options": {k: v for k, v in vars(opts).items()},
        "sizes": {s: {"seq_len": opts.shape_for(SIZES[s])[1], "micro_batch": opts.shape_for(SIZES[s])[0],
                      "steps": opts.steps_for(SIZES[s]), "warmup": opts.warmup_for(SIZES[s]),
                      "profile_steps": opts.profile_steps if cuda else 0,
                      **SIZES[s].model} for s in opts.sizes},
    }


def worker(opts: BenchOptions, out: str, command: str = "") -> list[dict]:
    """One rank: set up the device and group (unless already up), run, and (rank 0) write the reports."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if opts.device == "cuda":
        torch.cuda.set_device(local_rank)
    owns_group = not dist.is_initialized()
    if owns_group:
        if opts.device == "cuda":
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", 1)))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
            dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        meta = _meta(opts, out, command) if rank == 0 else {}
        finished: list[dict] = []
        if rank == 0:
            what = (f"a {opts.pp}-stage {opts.pp_schedule} pipeline of shardwise stages" if opts.pp
                    else f"shardwise with each sequence over {opts.cp} ranks" if opts.cp > 1
                    else f"wrappers {','.join(opts.wrappers)}")
            print(f"shardwise bench: sizes {','.join(opts.sizes)}, {what}, "
                  f"{meta['world_size']} x {meta['device_name']}, torch {meta['torch']}"
                  + (f", NCCL {meta['nccl']}" if meta["nccl"] else "") + f" -> {out}", flush=True)

        def on_result(run: dict) -> None:
            finished.append(run)
            print(format_run(run), flush=True)
            write_reports(out, meta, finished, png=False)

        if opts.pp:
            return _pipeline_worker(opts, out, meta)
        if opts.cp > 1:
            return _context_parallel_worker(opts, out, meta)
        runs = run_benchmark(opts, on_result)
        if rank == 0:
            table = write_reports(out, meta, runs, png=True)
            print("\n" + table + f"\nwrote {out}/bench.json, bench.md, bench.png", flush=True)
        return runs
    finally:
        if owns_group:  # every group's threads joined now, not raced by the interpreter's exit (a SIGABRT)
            destroy_process_groups()


def _pipeline_worker(opts: BenchOptions, out: str, meta: dict) -> list[dict]:
    """``--pp``: the pipeline runs, printed as they end; rank 0 writes ``bench_pp.json``."""
    import json

    def on_result(run: dict) -> None:
        print(format_pipeline_run(run), flush=True)

    runs = run_pipeline_benchmark(opts, on_result)
    if dist.get_rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bench_pp.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1, default=str))
        print(f"wrote {out}/bench_pp.json", flush=True)
    return runs


def _context_parallel_worker(opts: BenchOptions, out: str, meta: dict) -> list[dict]:
    """``--cp``: the CP runs, printed as they end; rank 0 writes ``bench_cp.json``."""
    import json

    runs = run_context_parallel_benchmark(opts, lambda run: print(format_context_parallel_run(run), flush=True))
    if dist.get_rank() == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "bench_cp.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1, default=str))
        print(f"wrote {out}/bench_cp.json", flush=True)
    return runs


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = "shardwise bench " + shlex.join(argv)
    try:
        opts, args = parse_options(argv)
        launched = under_launcher()
        if launched:
            world = int(os.environ["WORLD_SIZE"])
        else:
            world = args.nproc or (torch.cuda.device_count() if opts.device == "cuda" else 2)
            if opts.device == "cuda" and world > torch.cuda.device_count():
                raise UsageError(f"--nproc {world}: more processes than GPUs ({torch.cuda.device_count()})")
        if opts.pp and world % opts.pp:
            raise UsageError(f"--pp {opts.pp}: must divide the number of processes, {world}")
        if opts.cp > 1 and world % opts.cp:
            raise UsageError(f"--cp {opts.cp}: must divide the number of processes, {world}")
        if world < 2:
            print("shardwise bench: warning: one process measures no communication", file=sys.stderr)
    except UsageError as e:
        print(f"shardwise bench: error: {e}", file=sys.stderr)
        return 2
    if launched:
        worker(opts, args.out, command)
        return 0
    return launch_local(worker, world, (opts, args.out, command), "shardwise bench", preload=("torch._dynamo",))


if __name__ == "__main__":
    from shardwise.app.bench.cli import main as _main  # so spawned workers unpickle shardwise.app.bench.*

    sys.exit(_main())
