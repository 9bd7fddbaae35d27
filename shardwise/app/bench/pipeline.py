"""``shardwise bench --pp N``: train the GPT as an ``N``-stage pipeline of shardwise stages and measure it.

The stages, their sharding and the schedule are ``shardwise train --pp``'s
(:func:`shardwise.app.pipeline_train.build_pipeline`: built on the meta device,
each stage initialized as the whole model would be and sharded over its
data-parallel sub-mesh, ``--pp-virtual`` stages per rank; bf16 compute, as the
``shardwise`` wrapper), one optimizer over this rank's stages. Measured per
run, after warm-up:

* tokens/s per GPU (rank): the tokens of one step over all data-parallel
  replicas, over the slowest rank's wall clock, over the world size;
* bubble: :class:`~shardwise.app.pipeline_train.StageTimer`'s, the number
  ``train --pp`` logs as ``pp_bubble`` (the share of the schedule step outside
  the stages' forward, backward and gradient-reduction calls), the mean over
  the ranks and the timed steps; next to the textbook ``(pp - 1) / (v m + pp - 1)``;
* activations held for backward: the peak over the timed steps of the bytes
  autograd saved and has not released (each storage once, parameters and
  buffers left out; ``torch.autograd.graph.saved_tensors_hooks``), per pipeline
  rank, next to the estimate's "activations in flight"
  (:func:`shardwise.app.plan.pipeline_estimate.estimate_pipeline_rank`, the planner's fast path). Activation
  checkpointing hides a layer's saved tensors from these hooks, so with it this
  is not measured;
* on CUDA, the allocator's peak per rank next to the estimate's peak.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from ...engine.device import device_for
from ..pipeline_order import textbook_bubble
from ..config import TrainConfig
from ..plan.pipeline_estimate import estimate_pipeline_rank
from ..pipeline_train import build_pipeline
from .sizes import SIZES, model_config
from .wrappers import make_optimizer

__all__ = ["SavedBytes", "run_pipeline_benchmark", "format_pipeline_run", "MULTI_STAGE_SCHEDULES"]

GIB = 2**30
MULTI_STAGE_SCHEDULES = ("interleaved", "looped_bfs")


class _Held:
    """A saved tensor, counted until autograd lets go of it."""

    __slots__ = ("tensor", "owner", "key")

    def __init__(self, tensor, owner: "SavedBytes", key: int):
        self.tensor, self.owner, self.key = tensor, owner, key

    def __del__(self):
        self.owner._release(self.key)


class SavedBytes:
    """Bytes autograd holds for backward right now and at most, each storage once, ``exclude``'s storages and
    parameters left out. Use ``with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack)``."""

    def __init__(self, exclude: set[int] = frozenset()):
        self.exclude = set(exclude)
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, saved references]
        self.now = self.peak = 0

    def pack(self, tensor):
        # a weight is saved as itself or a view of it (``weight.t()``); its gathered storage moves every gather
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter) or tensor.device.type == "meta":
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.exclude or storage.nbytes() == 0:
            return tensor
        entry = self.live.get(key)
        if entry is None:
            self.live[key] = [storage.nbytes(), 1]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now)
        else:
            entry[1] += 1
        return _Held(tensor, self, key)  # holds the tensor: its storage (and pointer) stays until released

    @staticmethod
    def unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self.live[key]
            self.now -= entry[0]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def run_pipeline(opts, size_name: str) -> dict:
    """One pipeline run of size ``size_name`` on every rank of the default group; every rank returns the result."""
    import shardwise

    device, world = device_for(), dist.get_world_size()
    pp, schedule_name = opts.pp, opts.pp_schedule
    if world % pp:
        raise ValueError(f"--pp {pp} must divide the number of processes, {world}")
    dp = world // pp
    pp_rank, dp_rank = divmod(dist.get_rank(), dp)  # the rows of the (pp, dp_shard) mesh are pipeline ranks
    virtual = opts.pp_virtual or (2 if schedule_name in MULTI_STAGE_SCHEDULES else 1)
    n_mb = opts.pp_microbatches or 2 * pp
    size = SIZES[size_name]
    micro_batch, seq_len = opts.shape_for(size)
    config = model_config(size)
    cfg = TrainConfig(pp=pp, pp_schedule=schedule_name, pp_virtual_stages=virtual, seq_len=seq_len,
                      strategy=opts.strategy)  # the flags build_pipeline reads; the rest are train's defaults
    estimate = estimate_pipeline_rank(config, seq_len, micro_batch, pp=pp, pp_rank=pp_rank, dp=dp,
                                      schedule=schedule_name, n_microbatches=n_mb, virtual=virtual,
                                      strategy=opts.strategy, vocab_units=False,
                                      optimizer="fused" if device.type == "cuda" else "foreach")
    result = {"size": size_name, "wrapper": "shardwise-pp", "device": device.type, "world_size": world, "pp": pp,
              "dp": dp, "schedule": schedule_name, "virtual": virtual, "n_microbatches": n_mb,
              "micro_batch": micro_batch, "seq_len": seq_len, "strategy": opts.strategy,
              "activation_checkpointing": config.activation_checkpointing,
              "bubble_textbook": textbook_bubble(pp, n_mb, virtual)}

    torch.manual_seed(opts.seed)
    run, (n_params, _, _) = build_pipeline(cfg, config, device, world,
                                           shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
                                           say=lambda message: None)
    optimizer = make_optimizer(run.parameters(), device)
    steps, warmup = opts.steps_for(size), opts.warmup_for(size)
    generator = torch.Generator().manual_seed(opts.seed * 1_000_003 + dp_rank)  # same data along the pipeline
    tokens = torch.randint(0, config.vocab_size, (steps + warmup, n_mb, micro_batch, seq_len + 1),
                           generator=generator).to(device)
    buffers = {b.untyped_storage().data_ptr() for module in run.modules for b in module.buffers()}
    counter = SavedBytes(buffers)

    def step(i: int) -> torch.Tensor:
        loss_sum = run.forward_backward(((t[:, :-1], t[:, 1:]) for t in tokens[i]), n_mb, device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss_sum / n_mb

    for i in range(warmup):
        step(i)
    _sync(device)
    run.timer.bubble()  # forget the warm-up steps
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        loss = torch.zeros((), device=device)
        for i in range(warmup, warmup + steps):
            loss = step(i)
    _sync(device)
    elapsed = time.perf_counter() - start
    peak_alloc = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    local = torch.tensor([elapsed, run.timer.bubble(), counter.peak,
                          estimate.parts.get("activations in flight", 0),
                          peak_alloc, estimate.gpu_bytes, loss.item() if run.last else 0.0,
                          float(run.last and dp_rank == 0), sum(estimate.inputs["pipeline"]["in_flight"])],
                         dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    rows = [g.tolist() for g in gathered]
    slowest = max(r[0] for r in rows)
    per_pp_rank = {}
    for r, row in enumerate(rows):
        per_pp_rank.setdefault(r // dp, row)
    last_losses = [row[6] for row in rows if row[7]]
    result.update(
        status="ok", params=n_params, steps=steps, warmup=warmup, timed_s=slowest, step_s=slowest / steps,
        tokens_per_s_per_gpu=steps * dp * n_mb * micro_batch * seq_len / slowest / world,
        bubble=sum(row[1] for row in rows) / world,
        bubble_per_pp_rank=[per_pp_rank[r][1] for r in range(pp)],
        activations_measured=None if config.activation_checkpointing else [per_pp_rank[r][2] for r in range(pp)],
        activations_estimate=[per_pp_rank[r][3] for r in range(pp)],
        in_flight_per_pp_rank=[int(per_pp_rank[r][8]) for r in range(pp)],
        peak_alloc_gib=[per_pp_rank[r][4] / GIB for r in range(pp)] if device.type == "cuda" else None,
        estimate_gib=[per_pp_rank[r][5] / GIB for r in range(pp)],
        loss_last=last_losses[0] if last_losses else None)
    return result


def format_pipeline_run(run: dict) -> str:
    """One line per run: throughput, bubble, and activations (and peak) estimate vs measured per pipeline rank."""
    head = (f"{run['size']} pp={run['pp']} dp={run['dp']} {run['schedule']} v={run['virtual']} "
            f"m={run['n_microbatches']}")
    if run.get("status") != "ok":
        return f"{head}: {run.get('status')} ({run.get('reason', '')})"
    unit = "GPU" if run["device"] == "cuda" else "rank"
    mib = lambda b: f"{b / 2**20:.1f}"  # noqa: E731
    acts = run["activations_estimate"]
    measured = run["activations_measured"]
    pairs = ", ".join(f"{mib(e)}/{mib(m)}" if measured else f"{mib(e)}/-" for e, m in zip(acts, measured or acts))
    line = (f"{head}: {run['tokens_per_s_per_gpu']:,.0f} tok/s/{unit}, bubble {run['bubble']:.0%} "
            f"(textbook {run['bubble_textbook']:.0%}), activations in flight MiB estimate/measured per pp rank "
            f"[{pairs}]")
    if run.get("peak_alloc_gib"):
        peaks = ", ".join(f"{e:.2f}/{m:.2f}" for e, m in zip(run["estimate_gib"], run["peak_alloc_gib"]))
        line += f", peak GiB estimate/measured [{peaks}]"
    return line


def run_pipeline_benchmark(opts, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Every size of ``opts`` as a pipeline run; ``on_result`` is called on rank 0."""
    results = []
    for size_name in opts.sizes:
        result = run_pipeline(opts, size_name)
        results.append(result)
        if dist.get_rank() == 0 and on_result is not None:
            on_result(result)
    return results
