"""``shardwise bench --pp N``: train the GPT as an ``N``-stage pipeline of shardwise stages and measure it.

Each rank builds the whole model on the meta device, keeps its stages
(:func:`shardwise.models.pipeline_stage`, torch's numbering for
``--pp-virtual`` stages per rank), initializes them as the whole model would
be (:class:`~shardwise.models.StageInitializer`), shards each over its
data-parallel sub-mesh (a ``(pp, dp_shard)`` mesh; bf16 compute, as the
``shardwise`` wrapper) and runs ``--pp-schedule`` through
:func:`shardwise.pipeline.build_schedule`. Measured per run, after warm-up:

* tokens/s per GPU (rank): the tokens of one step over all data-parallel
  replicas, over the slowest rank's wall clock, over the world size;
* bubble: per rank, the share of the step not spent in its stages' forward and
  backward computations (``forward_one_chunk``/``backward_one_chunk``; the rest is
  waiting for neighbours, sends and receives, the reduction and the optimizer),
  max over ranks; next to the textbook ``(pp - 1) / (v m + pp - 1)``;
* activations held for backward: the peak over the timed steps of the bytes
  autograd saved and has not released (each storage once, parameters and
  buffers left out; ``torch.autograd.graph.saved_tensors_hooks``), per pipeline
  rank, next to the estimate's "activations in flight"
  (:func:`shardwise.app.pipeline_memory.estimate_pipeline_rank`). Activation
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
from torch.distributed.device_mesh import init_device_mesh

from ...device import device_for
from ...models import GPT, StageInitializer, pipeline_stage, stage_indices
from ...pipeline_order import textbook_bubble
from ..pipeline_memory import estimate_pipeline_rank
from ..pipeline_train import lm_loss
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


def _timed(stage, busy: list[float]) -> None:
    """Add the time of each of ``stage``'s forward and backward computations to ``busy[0]``."""
    for name in ("forward_one_chunk", "backward_one_chunk"):
        inner = getattr(stage, name)

        def run(*args, _inner=inner, **kwargs):
            start = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - start
        setattr(stage, name, run)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def run_pipeline(opts, size_name: str) -> dict:
    """One pipeline run of size ``size_name`` on every rank of the default group; every rank returns the result."""
    import shardwise
    from ...pipeline import ShardedPipelineStage, build_schedule, pipeline_groups

    device, world = device_for(), dist.get_world_size()
    pp, schedule_name = opts.pp, opts.pp_schedule
    if world % pp:
        raise ValueError(f"--pp {pp} must divide the number of processes, {world}")
    dp = world // pp
    virtual = opts.pp_virtual or (2 if schedule_name in MULTI_STAGE_SCHEDULES else 1)
    n_mb = opts.pp_microbatches or 2 * pp
    size = SIZES[size_name]
    micro_batch, seq_len = opts.shape_for(size)
    config = model_config(size)
    num_stages = pp * virtual
    mesh = init_device_mesh(device.type, (pp, dp), mesh_dim_names=("pp", "dp_shard"))
    pp_group, pp_rank, _ = pipeline_groups(mesh)
    dp_rank = mesh["dp_shard"].get_local_rank()
    estimate = estimate_pipeline_rank(config, seq_len, micro_batch, pp=pp, pp_rank=pp_rank, dp=dp,
                                      schedule=schedule_name, n_microbatches=n_mb, virtual=virtual,
                                      strategy=opts.strategy, optimizer="fused" if device.type == "cuda" else "foreach")
    result = {"size": size_name, "wrapper": "shardwise-pp", "device": device.type, "world_size": world, "pp": pp,
              "dp": dp, "schedule": schedule_name, "virtual": virtual, "n_microbatches": n_mb,
              "micro_batch": micro_batch, "seq_len": seq_len, "strategy": opts.strategy,
              "activation_checkpointing": config.activation_checkpointing,
              "bubble_textbook": textbook_bubble(pp, n_mb, virtual)}

    torch.manual_seed(opts.seed)
    with torch.device("meta"):
        whole = GPT(config)
    n_params = whole.num_params()
    parts = [pipeline_stage(whole, i, num_stages) for i in stage_indices(pp_rank, pp, virtual)]
    init = StageInitializer(whole, parts, device)
    init.plan()
    policy = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    sharded = []
    for part in parts:
        units = list(dict.fromkeys(type(layer) for layer in part.layers.values()))
        units += [m for m in (part.embed, part.output) if m is not None]
        sharded.append(shardwise.fully_shard(part, mesh["dp_shard"], strategy=opts.strategy, unit_modules=units,
                                             mixed_precision=policy, init_fn=init))
    init.finish()
    del whole
    stages = [ShardedPipelineStage(part, part.stage_index, num_stages, group=pp_group) for part in sharded]
    busy = [0.0]
    for stage in stages:
        _timed(stage, busy)
    schedule = build_schedule(schedule_name, stages, n_mb, lm_loss)
    optimizer = make_optimizer([p for part in sharded for p in part.parameters()], device)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    steps, warmup = opts.steps_for(size), opts.warmup_for(size)
    generator = torch.Generator().manual_seed(opts.seed * 1_000_003 + dp_rank)  # same data along the pipeline
    tokens = torch.randint(0, config.vocab_size, (steps + warmup, micro_batch * n_mb, seq_len + 1),
                           generator=generator).to(device)
    buffers = {b.untyped_storage().data_ptr() for part in sharded for b in part.buffers()}
    counter = SavedBytes(buffers)

    def step(i: int) -> torch.Tensor:
        inputs, targets = tokens[i, :, :-1].contiguous(), tokens[i, :, 1:].contiguous()
        losses: list = []
        schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                      losses=losses if last else None, return_outputs=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return torch.stack(losses).mean().detach() if last else torch.zeros((), device=device)

    for i in range(warmup):
        step(i)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    busy[0] = 0.0
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        loss = torch.zeros((), device=device)
        for i in range(warmup, warmup + steps):
            loss = step(i)
    _sync(device)
    elapsed = time.perf_counter() - start
    peak_alloc = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    local = torch.tensor([elapsed, 1.0 - busy[0] / elapsed, counter.peak,
                          estimate.parts.get("activations in flight", 0),
                          peak_alloc, estimate.gpu_bytes, loss.item() if last else 0.0, float(last and dp_rank == 0),
                          sum(estimate.inputs["pipeline"]["in_flight"])],
                         dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    rows = [g.tolist() for g in gathered]
    slowest = max(r[0] for r in rows)
    per_pp_rank = {}
    for r, row in enumerate(rows):  # the pipeline rank of global rank r: mesh rows are pipeline ranks
        per_pp_rank.setdefault(r // dp, row)
    last_losses = [row[6] for row in rows if row[7]]
    result.update(
        status="ok", params=n_params, steps=steps, warmup=warmup, timed_s=slowest, step_s=slowest / steps,
        tokens_per_s_per_gpu=steps * dp * n_mb * micro_batch * seq_len / slowest / world,
        bubble=max(row[1] for row in rows),
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
