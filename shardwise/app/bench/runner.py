"""Train one model under each wrapper in one job and measure it.

For each size, every rank builds the same model (same seed) directly on its
device, hands it to a wrapper, and trains it on the same random tokens (a
fixed ``torch.Generator`` per rank) for ``warmup`` + ``steps`` steps, then
``profile_steps`` more under the torch profiler. Measured per run:

* tokens/s per GPU: ``steps x micro_batch x seq_len`` over the wall clock of the
  timed steps, device-synchronized at both ends, slowest rank;
* MFU: tokens/s x (6 x params + 12 x layers x dim x seq) / 989e12 (CUDA only);
* peak allocated / reserved memory: maximum over ranks of the CUDA caching
  allocator's peaks over the warm-up and timed steps; the statistics are reset
  after wrapping and building the optimizer (and emptying the cache), so the
  unsharded fp32 model built before wrapping is not counted, while optimizer
  state created during the first step is. On CPU: peak resident set size of the
  process over the same window (host memory, whole process);
* loss at the first warm-up step and at the last timed step (mean over ranks);
* exposed communication (CUDA only): over the profiled steps on every rank, the
  time during which a NCCL kernel runs on the GPU while no other kernel, memcpy
  or memset does (union of intervals), divided by the wall time of those steps;
  the largest rank is reported;
* with ``compile`` (each layer's forward compiled, see ``wrappers``): dynamo's
  graph breaks over the run and the frames it compiled during the timed steps
  (0 unless something recompiles every step); the first warm-up step, which
  compiles, is timed on its own (``first_step_s``).

``compile="both"`` runs every wrapper eager and compiled in the same job,
interleaved: each run is compared with FSDP2 and with the ceiling (``none``)
of its own mode.

Everything between runs is freed (``gc.collect``, ``empty_cache``); the allocated
memory left at the start of a run is reported too (``base_alloc_gib``).
"""

from __future__ import annotations

import gc
import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from ...engine.device import device_for
from ...models import GPT
from ..host_memory import host_available_bytes, host_peak_bytes, reset_host_peak
from ..plan.estimate import DoesNotFit, check_fits, estimate_for_run
from .sizes import SIZES, BenchSize, ddp_bytes_estimate, model_config
from .fp8 import after_each_step, prepare as prepare_fp8
from .graphs import graphed_step, unavailable_reason as graphs_reason
from .muon import muon_stats, unavailable_reason as muon_reason, wrap_for_muon
from .wrappers import DEFAULT_ORDER, WRAPPERS, make_clip, unavailable_reason

__all__ = ["BenchOptions", "run_benchmark", "run_one", "merge_intervals", "interval_length",
           "exposed_length", "kernel_intervals", "PEAK_FLOPS_PER_GPU", "COMPILE_MODES", "GRAD_COMM_DTYPES"]

PEAK_FLOPS_PER_GPU = 989e12  # H100/H200 dense bf16
GIB = 2**30
DDP_FIT_MARGIN = 0.9  # skip DDP when its estimate passes this fraction of free memory
HOST_BYTES_PER_PARAM = 16  # offloaded: fp32 main weights, fp32 grads, two fp32 AdamW moments
HOST_FIT_MARGIN = 0.85  # skip an offloaded run whose host state passes this fraction of available memory
COMPILE_MODES = {"off": (False,), "on": (True,), "both": (False, True)}
GRAD_COMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class BenchOptions:
    sizes: Sequence[str] = ("tiny",)
    wrappers: Sequence[str] = DEFAULT_ORDER
    device: str = "cpu"  # "cpu" or "cuda"
    steps: dict = field(default_factory=dict)  # size -> timed steps (default: the size's)
    warmup: dict = field(default_factory=dict)  # size -> warm-up steps
    profile_steps: int = 2
    repeats: int = 1
    strategy: str = "optim_grads_params"
    seed: int = 0
    micro_batch: int = 0  # 0: the size's
    seq_len: int = 0  # 0: the size's
    loss_rtol: float = 1.6e-2  # torch.testing's default bf16 rtol
    trace_dir: str = ""  # where rank 0 writes a chrome trace per run ("" = none)
    compile: str = "off"  # "off" (eager), "on" (each layer's forward compiled) or "both", interleaved
    compile_backend: str = "inductor"
    offload: float = 0.0  # share of parameters with main weights and optimizer state on the host (shardwise, fsdp2)
    grad_comm_dtype: str = "fp32"  # dtype shardwise's gradients travel in ("bf16": half the traffic, fp32 accumulation)
    max_grad_norm: float = 0.0  # clip the global grad norm to this under every wrapper (0: no clipping)
    clip_mode: str = "fold"  # shardwise: "fold" (the factor goes into the fused AdamW step) or "in-place"
    fp8: Sequence[str] = ("off",)  # FP8 modes run in turn: "off" (bf16 linears), "tensorwise", "rowwise" (bench/fp8.py)
    pp: int = 0  # > 0: a pipeline of this many stages of shardwise modules instead of the wrappers (bench/pipeline.py)
    pp_schedule: str = "1f1b"
    pp_virtual: int = 0  # stages per rank (0: 2 for interleaved and looped_bfs, else 1)
    pp_microbatches: int = 0  # micro-batches per step (0: 2 x pp)
    cuda_graphs: Sequence[bool] = (False,)  # eager and/or each step a replayed CUDA graph (bench/graphs.py)
    cp: int = 0  # > 1: shardwise with each sequence split over this many ranks (bench/context_parallel.py)
    optimizers: Sequence[str] = ("adamw",)  # run in turn: "adamw", "muon" (torch's Muon on Owned() matrices, bench/muon.py)

    def compile_kwargs(self) -> dict:
        """What every wrapper passes to torch.compile: whole layers, static shapes (as torchtitan)."""
        return {"backend": self.compile_backend, "fullgraph": True, "dynamic": False}

    def steps_for(self, size: BenchSize) -> int:
        return int(self.steps.get(size.name, self.steps.get("*", size.steps)))

    def warmup_for(self, size: BenchSize) -> int:
        return int(self.warmup.get(size.name, self.warmup.get("*", size.warmup)))

    def shape_for(self, size: BenchSize) -> tuple[int, int]:
        return self.micro_batch or size.micro_batch, self.seq_len or size.seq_len


# ------------------------------------------------------------------ interval arithmetic
def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint union of ``(start, end)`` intervals (empty ones dropped)."""
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def interval_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (overlaps counted once)."""
    return sum(e - s for s, e in merge_intervals(intervals))


def exposed_length(comm: Iterable[tuple[float, float]], compute: Iterable[tuple[float, float]]) -> float:
    """Length of time covered by ``comm`` but not by ``compute``: union(comm) minus union(compute)."""
    cover = merge_intervals(compute)
    total, j = 0.0, 0
    for start, end in merge_intervals(comm):
        while j < len(cover) and cover[j][1] <= start:
            j += 1
        cursor, k = start, j
        while k < len(cover) and cover[k][0] < end:
            if cover[k][0] > cursor:
                total += cover[k][0] - cursor
            cursor = max(cursor, cover[k][1])
            if cursor >= end:
                break
            k += 1
        if cursor < end:
            total += end - cursor
    return total


def _is_comm_kernel(name: str) -> bool:
    return "nccl" in name.lower()


def kernel_intervals(prof) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(communication, other) GPU activity intervals in ns from a finished ``torch.profiler.profile``.

    Communication: kernels whose name contains ``nccl``. Other: every other
    kernel, memcpy and memset. Annotations on the GPU timeline are ignored.
    """
    from torch.autograd import DeviceType

    comm, other = [], []
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != DeviceType.CUDA:
            continue
        kind = event.activity_type() if hasattr(event, "activity_type") else None
        if kind is not None and kind not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        if kind is None and event.is_user_annotation():
            continue
        start = event.start_ns()
        span = (start, start + event.duration_ns())
        (comm if _is_comm_kernel(event.name()) else other).append(span)
    return comm, other


# ------------------------------------------------------------------ helpers
def _sync(device: torch.device) -> None:
    """Wait for this rank's device, then for every rank (a tiny all-reduce)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        # torch keeps freed pinned host blocks cached (FSDP2's offloaded state, ~45 GiB at 2.8b):
        # without this the next run's host peak counts them
        host_empty_cache = getattr(torch._C, "_host_emptyCache", None)
        if host_empty_cache is not None:
            host_empty_cache()


def _make_batches(vocab: int, micro_batch: int, seq_len: int, count: int, seed: int, rank: int,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    tokens = torch.randint(0, vocab, (count, micro_batch, seq_len + 1), generator=generator).to(device)
    return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]


def _train_step(model, optimizer, batch, clip: Callable[[], None] | None = None) -> torch.Tensor:
    inputs, targets = batch
    loss = model(inputs, targets)
    loss.backward()
    if clip is not None:
        clip()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _reduce(values: list[float], device: torch.device, op) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _skip_reason(name: str, size: BenchSize, config, n_params: int, micro_batch: int, seq_len: int,
                 device: torch.device, compiled: bool = False, offload: float = 0.0,
                 clipped: bool = False, fp8: str = "off") -> str | None:
    why = unavailable_reason(name, device, compiled, fp8)
    if why:
        return why
    if clipped and name == "shardwise-obo":
        return "a BackwardOptimizer steps each group inside backward: it cannot clip by the global norm"
    offloaded = (offload if name.startswith("shardwise") else 1.0 if name == "fsdp2" else 0.0) if offload else 0.0
    if offloaded and name == "fsdp2" and device.type != "cuda":
        return "FSDP2's CPUOffloadPolicy offloads from an accelerator; there is none here"
    # FSDP2's host state by rule of thumb (shardwise's runs are checked against their own estimate in run_one)
    if offloaded and name == "fsdp2" and device.type == "cuda":  # every local rank's host state shares this host
        need = HOST_BYTES_PER_PARAM * n_params * offloaded
        free = host_available_bytes() or float("inf")  # unknown: let the run try
        if need > HOST_FIT_MARGIN * free:
            return (f"does not fit in host memory: offloading {offloaded:.0%} of {n_params / 1e9:.1f}B parameters "
                    f"needs ~{need / GIB:.0f} GiB (fp32 weights, grads, AdamW moments), {free / GIB:.0f} GiB available")
    if name != "ddp" or device.type != "cuda":
        return None
    need = ddp_bytes_estimate(config, n_params, seq_len, micro_batch)
    free = _reduce([torch.cuda.mem_get_info(device)[0]], device, dist.ReduceOp.MIN)[0]
    if need > DDP_FIT_MARGIN * free:
        return (f"does not fit: needs ~{need / GIB:.0f} GiB (16 B/param states + bf16 autocast copy "
                f"+ activations), {free / GIB:.0f} GiB free")
    return None


# ------------------------------------------------------------------ one run
def run_one(name: str, size: BenchSize, opts: BenchOptions, device: torch.device, batches,
            repeat: int = 0, compiled: bool = False, fp8: str = "off", graphs: bool = False,
            optimizer: str = "adamw") -> dict:
    """Wrap a fresh model with wrapper ``name`` (layers compiled when ``compiled``), train and measure it;
    every rank returns the result."""
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_batch, seq_len = opts.shape_for(size)
    steps, warmup = opts.steps_for(size), opts.warmup_for(size)
    config = model_config(size)
    config.max_seq_len = max(config.max_seq_len, seq_len)
    with torch.device("meta"):
        shape = GPT(config)
    n_params, flops_per_token = shape.num_params(), shape.flops_per_token(seq_len)
    del shape
    result = {"size": size.name, "wrapper": name, "repeat": repeat, "world_size": world,
              "device": device.type, "params": n_params, "micro_batch": micro_batch, "seq_len": seq_len,
              "activation_checkpointing": config.activation_checkpointing, "steps": steps, "warmup": warmup,
              "tokens_per_step_per_gpu": micro_batch * seq_len, "compiled": compiled,
              "compile_backend": opts.compile_backend if compiled else None,
              "max_grad_norm": opts.max_grad_norm, "fp8": None if fp8 == "off" else fp8, "cuda_graphs": graphs,
              "optimizer": optimizer}
    why = muon_reason(name, optimizer, fp8, graphs, opts.offload) or graphs_reason(name, device, graphs) or _skip_reason(
        name, size, config, n_params, micro_batch, seq_len, device, compiled, opts.offload, opts.max_grad_norm > 0,
        fp8)
    if why:
        return {**result, "status": "skipped", "reason": why}
    if name.startswith("shardwise") and device.type == "cuda":  # the estimate train prints, checked here
        est = estimate_for_run(config, seq_len, micro_batch, world, opts.strategy, opts.offload,
                               backward_optimizer=name == "shardwise-obo", ranks_per_host=torch.cuda.device_count())
        result.update(estimate_gib=est.gpu_bytes / GIB, estimate_host_gib=est.host_bytes / GIB)
        if rank == 0:
            print(f"{size.name} {name}: memory estimate {est.describe()}", flush=True)
        free = _reduce([torch.cuda.mem_get_info(device)[0]], device, dist.ReduceOp.MIN)[0]
        try:
            check_fits(est, free, host_available_bytes())
        except DoesNotFit as e:
            return {**result, "status": "skipped", "reason": str(e)}
    try:
        tag = (f"{size.name}-{name}{'-compiled' if compiled else ''}{'' if fp8 == 'off' else '-' + fp8}"
               f"{'-graphs' if graphs else ''}{'-muon' if optimizer == 'muon' else ''}-r{repeat}")
        result.update(_measure(name, config, opts, device, batches, steps, warmup, flops_per_token,
                               micro_batch * seq_len, tag, compiled, fp8, graphs, optimizer))
        result["status"] = "ok"
    except torch.cuda.OutOfMemoryError:
        result.update(status="failed", reason="out of memory")
        if rank == 0:
            traceback.print_exc()
    except Exception as e:  # noqa: BLE001 - recorded; later wrappers still run
        result.update(status="failed", reason=f"{type(e).__name__}: {e}"[:300])
        traceback.print_exc()
    return result


def _dynamo_counts() -> tuple[int, int]:
    """(graph breaks, frames compiled) so far in this process (0, 0 before anything compiled)."""
    import sys

    if "torch._dynamo" not in sys.modules:
        return 0, 0
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["frames"]["ok"]


def _measure(name, config, opts, device, batches, steps, warmup, flops_per_token, tokens_per_step,
             tag, compiled=False, fp8="off", graphs=False, optimizer_kind="adamw") -> dict:
    cuda = device.type == "cuda"
    world = dist.get_world_size()
    base_alloc = torch.cuda.memory_allocated(device) if cuda else 0
    if compiled:  # every compiled run compiles from scratch, as a fresh process would
        from torch import _dynamo

        _dynamo.reset()
    torch.manual_seed(opts.seed)
    t0 = time.perf_counter()
    with torch.device(device):
        model = GPT(config)
    t1 = time.perf_counter()
    extra = ({"strategy": opts.strategy, "grad_comm_dtype": GRAD_COMM_DTYPES[opts.grad_comm_dtype]}
             if name.startswith("shardwise") else {})
    if opts.offload and (name.startswith("shardwise") or name == "fsdp2"):
        extra["offload"] = opts.offload
    if compiled:
        extra["compile"] = opts.compile_kwargs()
    if graphs and name.startswith("shardwise"):
        extra["graph_safe"] = True
    after_step = prepare_fp8(name, model, fp8, opts.strategy, opts.offload if name.startswith("shardwise") else 0.0)
    muon = None
    if optimizer_kind == "muon":
        model, optimizer, *muon = wrap_for_muon(name, model, device, extra)
    else:
        model, optimizer = WRAPPERS[name](model, device, **extra)
    after_each_step(optimizer, after_step)
    clip, clip_mode = make_clip(name, model, optimizer, opts.max_grad_norm, opts.clip_mode)
    model.train()
    _sync(device)
    wrap_s = time.perf_counter() - t1
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        after_wrap = torch.cuda.memory_allocated(device)
    else:
        after_wrap = 0
    reset_host_peak()  # on CUDA too: host memory matters when state is offloaded

    breaks_before, _ = _dynamo_counts()
    losses = []
    first_step_s = None
    step = lambda batch: _train_step(model, optimizer, batch, clip)  # noqa: E731
    for i in range(warmup):
        step_start = time.perf_counter()
        if graphs and i == 0:  # the first step is the capture's eager warm-up: the same steps as an eager run
            step, first_loss = graphed_step(model, optimizer, clip, batches[0])
            losses.append(first_loss)
        else:
            losses.append(step(batches[i]))
        if i == 0:  # compiles, when compiled
            _sync(device)
            first_step_s = time.perf_counter() - step_start
    _sync(device)
    _, frames_warm = _dynamo_counts()
    start = time.perf_counter()
    for i in range(warmup, warmup + steps):
        losses.append(step(batches[i]))
    _sync(device)
    elapsed = time.perf_counter() - start
    breaks_after, frames_after = _dynamo_counts()
    host_peak = host_peak_bytes()
    if cuda:
        peak_alloc, peak_reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    else:
        peak_alloc, peak_reserved = host_peak, float("nan")
    first_loss, last_loss = (float(x) for x in torch.stack([losses[0], losses[-1]]).float().cpu())

    exposed = _profile(model, optimizer, clip, batches[warmup + steps:], device, opts, tag, step) if cuda else None
    stats = muon_stats(model, *muon, device, warmup + steps) if muon else {}
    del model, optimizer, clip, losses, step

    # Count only what this run added: a peer that leaks (megatron-fsdp keeps its buffers
    # alive after its run) must not inflate the next run's peak.
    peak_alloc_raw = peak_alloc
    peak_alloc = peak_alloc - base_alloc
    elapsed, peak_alloc, peak_alloc_raw, peak_reserved, base_alloc, after_wrap = _reduce(
        [elapsed, peak_alloc, peak_alloc_raw, peak_reserved, base_alloc, after_wrap], device, dist.ReduceOp.MAX)
    first_loss, last_loss = (x / world for x in _reduce([first_loss, last_loss], device, dist.ReduceOp.SUM))
    host_peak_max, = _reduce([host_peak], device, dist.ReduceOp.MAX)
    tokens_per_s = steps * tokens_per_step / elapsed
    out = {
        "build_s": t1 - t0, "wrap_s": wrap_s, "timed_s": elapsed, "step_s": elapsed / steps,
        "tokens_per_s_per_gpu": tokens_per_s,
        "mfu": tokens_per_s * flops_per_token / PEAK_FLOPS_PER_GPU if cuda else None,
        "flops_per_token": flops_per_token,
        "peak_alloc_gib": peak_alloc / GIB, "peak_alloc_raw_gib": peak_alloc_raw / GIB,
        "peak_reserved_gib": peak_reserved / GIB if cuda else None,
        "base_alloc_gib": base_alloc / GIB, "after_wrap_alloc_gib": after_wrap / GIB,
        "host_peak_gib": host_peak_max / GIB,  # peak resident host memory of one rank's process (max over ranks)
        "memory_measured": ("CUDA allocator peak, reset after wrap + optimizer, over warm-up and timed steps, "
                            "minus what was still allocated when the run started, max over ranks") if cuda else
                           ("host peak RSS of the whole process over warm-up and timed steps, max over ranks"),
        "loss_first": first_loss, "loss_last": last_loss, "first_step_s": first_step_s,
        "clip_mode": clip_mode,  # how the clipping factor was applied: "fold", "in-place" or None (no clipping)
        "graph_breaks": breaks_after - breaks_before if compiled else None,
        "frames_compiled_timed": frames_after - frames_warm if compiled else None,
    }
    out.update(stats)
    out.update(exposed or {"exposed_comm_frac": None, "exposed_comm_ms_per_step": None,
                           "comm_ms_per_step": None, "gpu_idle_frac": None})
    return out


def _profile(model, optimizer, clip, batches, device, opts, tag, step=None) -> dict | None:
    """Exposed communication over ``len(batches)`` profiled steps; runs on every rank (collectives).
    ``step(batch)``: the step to run (a graph's replay) instead of the eager one."""
    if not batches:
        return None
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = ([ProfilerActivity.CUDA] if cuda else []) + (
        [ProfilerActivity.CPU] if opts.trace_dir or not cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for batch in batches:
            if step is None:
                _train_step(model, optimizer, batch, clip)
            else:
                step(batch)
        if cuda:
            torch.cuda.synchronize(device)
        window = time.perf_counter() - start
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        comm, other = kernel_intervals(prof)
        exposed_ns = exposed_length(comm, other)
        comm_ns, busy_ns = interval_length(comm), interval_length(comm + other)
        local = [exposed_ns / 1e9 / window, exposed_ns / 1e6 / len(batches), comm_ns / 1e6 / len(batches),
                 1.0 - busy_ns / 1e9 / window]
    except Exception:  # noqa: BLE001 - a profiler API difference must not stop the benchmark
        traceback.print_exc()
        local = [float("nan")] * 4
    if opts.trace_dir and rank == 0:
        os.makedirs(opts.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(opts.trace_dir, f"{tag}-rank0.json"))
    del prof
    gathered = [torch.zeros(4, dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor(local, dtype=torch.float64, device=device))
    per_rank = [t.tolist() for t in gathered]
    worst = max(per_rank, key=lambda r: r[0] if r[0] == r[0] else float("-inf"))  # NaN last
    frac, exposed_ms, comm_ms, idle = worst
    return {"exposed_comm_frac": frac, "exposed_comm_ms_per_step": exposed_ms, "comm_ms_per_step": comm_ms,
            "gpu_idle_frac": idle, "exposed_comm_frac_per_rank": [r[0] for r in per_rank],
            "profiled_steps": len(batches)}


# ------------------------------------------------------------------ the whole job
def run_benchmark(opts: BenchOptions, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Run every size x repeat x wrapper in this process group; ``on_result`` is called on rank 0."""
    device = device_for()  # the process group's backend decides: NCCL -> this rank's GPU, gloo -> the CPU
    rank = dist.get_rank()
    results = []
    for size_name in opts.sizes:
        size = SIZES[size_name]
        micro_batch, seq_len = opts.shape_for(size)
        total = opts.warmup_for(size) + opts.steps_for(size) + (opts.profile_steps if device.type == "cuda" else 0)
        batches = _make_batches(size.model["vocab_size"], micro_batch, seq_len, total, opts.seed, rank, device)
        for repeat in range(opts.repeats):
            order = [(fp8, compiled, graphs, optimizer, name) for fp8 in opts.fp8
                     for compiled in COMPILE_MODES[opts.compile] for graphs in opts.cuda_graphs
                     for optimizer in opts.optimizers for name in opts.wrappers]
            if repeat % 2:
                order.reverse()
            for fp8, compiled, graphs, optimizer, name in order:
                _release(device)
                result = run_one(name, size, opts, device, batches, repeat, compiled, fp8, graphs, optimizer)
                _release(device)
                results.append(result)
                if rank == 0 and on_result is not None:
                    on_result(result)
        del batches
    return results
