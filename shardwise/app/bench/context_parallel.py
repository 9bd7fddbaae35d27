"""``shardwise bench --cp N``: train the GPT with each sequence split over ``N`` ranks, and measure it.

The recipe is ``shardwise train --cp``'s: a ``(dp_shard, cp)`` mesh
(``shardwise.build_dp_mesh(cp=N)``), the GPT built with ``cp_group`` (zig-zag
chunks, K/V all-gathered, each query chunk against the keys before it), each
layer, the embedding and the head ``fully_shard`` units over ``dp_shard x cp``,
bf16 compute, fused / foreach AdamW. The ``cp`` ranks of a data rank read the
same rows and each trains its zig-zag slice. Only shardwise runs (the other
wrappers have no CP here), so ``--wrappers`` and the options only they take
are refused with ``--cp`` (:func:`check_options`). Measured per run, after
warm-up:

* tokens/s per GPU (rank): every data rank's whole sequences of one step over
  the slowest rank's wall clock, over the world size;
* activations held for backward: the peak over the timed steps of the bytes
  autograd saved (each storage once; :class:`~shardwise.app.bench.pipeline.SavedBytes`),
  next to the estimate's (``estimate_for_run(cp=N)``: a rank's ``seq / N``
  tokens, the keys and values its query chunks see; on the CPU also the
  causal masks SDPA materializes there). Activation checkpointing hides a
  layer's saved tensors from the hooks, so with it this is not measured;
* on CUDA, the allocator's peak next to the estimate's.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import torch
import torch.distributed as dist

from ...engine.device import device_for
from ..plan.estimate import activation_bytes, estimate_for_run
from .pipeline import GIB, SavedBytes
from .sizes import SIZES, model_config
from .wrappers import DEFAULT_ORDER, make_optimizer

__all__ = ["check_options", "run_context_parallel_benchmark", "format_context_parallel_run"]


def check_options(opts, wrappers_given: bool) -> str | None:
    """Why ``--cp`` cannot run with these options (the flag and value first), or ``None``."""
    cp = opts.cp
    if cp < 0:
        return f"--cp {cp}: must not be negative"
    if cp <= 1:
        return None
    unbuilt = [("--pp", opts.pp, opts.pp > 0, "pipeline stages"),
               ("--compile", opts.compile, opts.compile != "off", "compiled layers"),
               ("--fp8", ",".join(opts.fp8), tuple(opts.fp8) != ("off",), "FP8 linears"),
               ("--offload", opts.offload, opts.offload > 0, "CPU offload"),
               ("--max-grad-norm", opts.max_grad_norm, opts.max_grad_norm > 0, "clipping")]
    for flag, value, used, what in unbuilt:
        if used:
            return f"{flag} {value}: with --cp {cp} is not built yet in the benchmark ({what})"
    if wrappers_given and list(opts.wrappers) not in (["shardwise"], list(DEFAULT_ORDER)):
        return (f"--wrappers {','.join(opts.wrappers)}: --cp {cp} trains shardwise only (the other wrappers have "
                "no context parallelism here)")
    for name in opts.sizes:
        size = SIZES[name]
        _, seq_len = opts.shape_for(size)
        if seq_len % (2 * cp):
            flag = "--seq-len" if opts.seq_len else "--sizes"
            value = opts.seq_len if opts.seq_len else f"{name} (seq_len {seq_len})"
            return f"{flag} {value}: the sequence length must be divisible by 2 x --cp = {2 * cp}"
        kinds = set(model_config(size).layer_kinds) - {"A"}
        if kinds:
            return f"--sizes {name}: --cp {cp} is built for attention layers (A) only, not {sorted(kinds)}"
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def run_context_parallel(opts, size_name: str) -> dict:
    """One CP run of size ``size_name`` on every rank of the default group; every rank returns the result."""
    import shardwise
    from ...models import GPT
    from ...models.context_parallel import zigzag_split

    device, world, cp = device_for(), dist.get_world_size(), opts.cp
    if world % cp:
        raise ValueError(f"--cp {cp} must divide the number of processes, {world}")
    dp = world // cp
    size = SIZES[size_name]
    micro_batch, seq_len = opts.shape_for(size)
    mesh = shardwise.build_dp_mesh(cp=cp)
    cp_group = mesh.get_group("cp")
    config = replace(model_config(replace(size, seq_len=seq_len)), cp_group=cp_group)
    data_rank = mesh.get_local_rank("dp_shard")
    estimate = estimate_for_run(config, seq_len, micro_batch, world, opts.strategy, vocab_units=True,
                                optimizer="fused" if device.type == "cuda" else "foreach", cp=cp)
    acts = activation_bytes(config, seq_len, micro_batch, compute_dtype=torch.bfloat16, cp=cp,
                            materialized_mask=device.type != "cuda")
    result = {"size": size_name, "wrapper": "shardwise-cp", "device": device.type, "world_size": world, "cp": cp,
              "dp": dp, "micro_batch": micro_batch, "seq_len": seq_len, "tokens_per_rank": micro_batch * seq_len // cp,
              "strategy": opts.strategy, "activation_checkpointing": config.activation_checkpointing}

    torch.manual_seed(opts.seed)
    model = GPT(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    units = [type(model.layers[0]), model.embed] + ([model.output] if model.output is not None else [])
    model = shardwise.fully_shard(model, mesh, strategy=opts.strategy, unit_modules=units,
                                  mixed_precision=shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    optimizer = make_optimizer(model.parameters(), device)
    steps, warmup = opts.steps_for(size), opts.warmup_for(size)
    generator = torch.Generator().manual_seed(opts.seed * 1_000_003 + data_rank)  # the same rows on a data rank's CP ranks
    rows = torch.randint(0, config.vocab_size, (steps + warmup, micro_batch, seq_len + 1), generator=generator)
    batches = [(zigzag_split(r[:, :-1], cp_group).to(device), zigzag_split(r[:, 1:], cp_group).to(device))
               for r in rows]
    counter = SavedBytes({b.untyped_storage().data_ptr() for b in model.buffers()})

    def step(i: int) -> torch.Tensor:
        loss = model(*batches[i])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    for i in range(warmup):
        step(i)
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    loss = torch.zeros((), device=device)
    with torch.autograd.graph.saved_tensors_hooks(counter.pack, counter.unpack):
        for i in range(warmup, warmup + steps):
            loss = step(i)
    _sync(device)
    elapsed = time.perf_counter() - start
    peak_alloc = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
    local = torch.tensor([elapsed, counter.peak, peak_alloc, loss.item()], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    table = [g.tolist() for g in gathered]
    slowest = max(row[0] for row in table)
    result.update(
        status="ok", params=n_params, steps=steps, warmup=warmup, timed_s=slowest, step_s=slowest / steps,
        tokens_per_s_per_gpu=steps * dp * micro_batch * seq_len / slowest / world,
        activations_measured=None if config.activation_checkpointing else max(row[1] for row in table),
        activations_estimate=acts.saved_at_loss,
        peak_alloc_gib=max(row[2] for row in table) / GIB if device.type == "cuda" else None,
        estimate_gib=estimate.gpu_bytes / GIB,
        loss_last=sum(row[3] for row in table) / world)  # every CP rank holds its data rank's whole-row loss
    return result


def format_context_parallel_run(run: dict) -> str:
    """One line per run: throughput, and saved activations (and peak) estimate vs measured."""
    head = f"{run['size']} cp={run['cp']} dp={run['dp']} seq={run['seq_len']} mb={run['micro_batch']}"
    unit = "GPU" if run["device"] == "cuda" else "rank"
    measured = run["activations_measured"]
    line = (f"{head}: {run['tokens_per_s_per_gpu']:,.0f} tok/s/{unit}, activations MiB estimate/measured "
            f"{run['activations_estimate'] / 2**20:.1f}/" + (f"{measured / 2**20:.1f}" if measured else "-"))
    if run.get("peak_alloc_gib") is not None:
        line += f", peak GiB estimate/measured {run['estimate_gib']:.2f}/{run['peak_alloc_gib']:.2f}"
    return line


def run_context_parallel_benchmark(opts, on_result: Callable[[dict], None] | None = None) -> list[dict]:
    """Every size of ``opts`` as a CP run; ``on_result`` is called on rank 0."""
    results = []
    for size_name in opts.sizes:
        result = run_context_parallel(opts, size_name)
        results.append(result)
        if dist.get_rank() == 0 and on_result is not None:
            on_result(result)
    return results
