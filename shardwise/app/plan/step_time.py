"""Step time of one candidate, from FLOPs, bytes and the engine's overlap rule (every term readable).

Per unit (``fully_shard``'s unit: a layer, the embedding, the head):

* compute: forward FLOPs per token x tokens / (peak x matmul efficiency) plus the layer's memory-bound
  elementwise bytes over HBM bandwidth (``Efficiency``); backward twice that; a checkpointed layer its
  forward once more; FP8 compute ``fp8_speedup`` faster on the matmuls;
* all-gather (parameters sharded: ZeRO-3, HSDP, HFSDP): the unit's compute-dtype bytes (1 per parameter with
  the FP8 gather) over the shard group; reduce-scatter: its fp32 gradients (the engine reduces in the gradient
  dtype); each ``latency + (n - 1) / n x bytes / bus bandwidth`` of the link the group spans
  (:meth:`Cluster.link`: a ring across nodes adds a latency per step, as NCCL models it); HSDP all-reduces
  each unit's gradient shard over the replicas (``2 (r - 1) / r``), HFSDP reduce-scatters it there and
  gathers the main shard back after the step;
* overlap, as the engine schedules it: forward prefetches the next unit's gather while this unit computes;
  backward prefetches the previous unit's gather and runs the last unit's reduction while this unit computes;
  so the first gather and the last reduction are exposed, and elsewhere only what a unit's communication
  takes beyond its compute;
* host: each unit's Python and launches per pass; the GPU waits where a unit's host time passes its compute;
* a CPU (a calibrated machine, ``GpuSpec.cores``): Python, kernels and gloo's collectives run one after another
  on the rank's own thread, so nothing overlaps (every collective and host time is exposed), and ranks beyond
  the node's cores share them (every term slows by ``ranks per node / cores``);
* the optimizer step streams main weights, gradients and AdamW's two moments (28 bytes per parameter of the
  shard) through HBM; an offloaded fraction steps on the host and crosses PCIe (assumed 50 GB/s, host AdamW
  1e9 parameters/s per rank: both assumptions, named here);
* with Muon (``--optimizer muon``: the layers' matrices whole on one owner rank each) the Newton-Schulz
  iterations of the matrices the busiest rank owns (``newton_schulz_flops``: the engine's own owner balance)
  at the matmul rate, beside the step (nothing overlaps the optimizer).

ZeRO-1/2 keep parameters whole: no gathers per unit; they refresh the compute weights with one all-gather of
the model after the optimizer step. ZeRO-1 reduces once per step (the last micro-batch); ZeRO-2/3 every
micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .candidates import Candidate
from .hardware import EFFICIENCY, Cluster, Efficiency

__all__ = ["UnitCost", "StepTime", "step_time", "collective_time", "unit_costs", "newton_schulz_flops"]

PCIE_BW = 50e9  # bytes/s per GPU, PCIe 5 x16 one direction (assumed)
HOST_ADAM_RATE = 1e9  # parameters/s of a host AdamW step per rank (assumed)
ADAM_BYTES = 28  # fused AdamW: reads main, grad, two moments (16), writes main and moments (12), fp32


@dataclass(frozen=True)
class UnitCost:
    """One unit in forward order: its parameters and forward FLOPs per token (matmuls and attention)."""

    name: str
    params: int
    fwd_flops_per_token: float
    checkpointed: bool = False  # recomputed in backward under activation checkpointing
    width: int = 0  # a transformer layer's model width: its memory-bound elementwise work scales with it


@dataclass
class StepTime:
    seconds: float
    terms: dict[str, float] = field(default_factory=dict)  # compute, exposed all-gather, ..., host, optimizer
    timeline: list = field(default_factory=list, repr=False)  # (pass, unit, compute, all-gather, reduce, exposed)

    def dominant(self) -> str:
        return max(self.terms, key=self.terms.get)


def collective_time(kind: str, nbytes: float, group: int, bw: float, latency: float) -> float:
    """Ring all-gather / reduce-scatter / all-reduce of ``nbytes`` (the whole, unsharded payload)."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    factor = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 2.0}[kind]
    return latency + factor * (group - 1) / group * nbytes / bw


def newton_schulz_flops(shapes, ranks: int) -> float:
    """The Newton-Schulz FLOPs of one Muon step on the busiest of ``ranks`` ranks owning ``shapes`` (the
    matrices, owners picked as ``fully_shard`` picks them for ``Owned()``)."""
    from ...engine.owner_layout import OwnerBalancer, ns_flops

    loads = [0] * ranks
    for shape, owner in zip(shapes, OwnerBalancer().assign(list(shapes), ranks)):
        loads[owner] += ns_flops(shape)
    return float(max(loads, default=0))


def step_time(units: list[UnitCost], cand: Candidate, cluster: Cluster, seq: int, global_batch: int, *,
              compiled: bool = True, eff: Efficiency = EFFICIENCY, newton_schulz: float = 0.0) -> StepTime:
    """Seconds of one optimizer step of ``global_batch`` sequences, and the terms that make it up;
    ``newton_schulz``: the busiest rank's Newton-Schulz FLOPs per step (Muon, :func:`newton_schulz_flops`)."""
    gpu = cluster.gpu
    per_rank = global_batch // cluster.gpus
    micro = max(1, per_rank // cand.micro_batch)
    tokens = cand.micro_batch * seq
    rate = gpu.bf16_flops * eff.matmul * (eff.fp8_speedup if cand.fp8 else 1.0)
    elementwise = (eff.elementwise_compiled if compiled else eff.elementwise_eager) / gpu.hbm_bw
    host = eff.host_per_unit_compiled if compiled else eff.host_per_unit_eager
    inner = cluster.gpus // cand.replicas
    bw_in, lat_in = cluster.link(inner)
    bw_out, lat_out = cluster.link(cand.replicas, stride=inner,
                                   kind="reduce_scatter" if cand.outer_strategy == "optim" else "all_reduce")
    sharded_params = cand.strategy == "optim_grads_params"
    reduce_every_micro = cand.strategy != "optim"
    gather_bytes = 1 if cand.fp8_gather else 2

    def ag(u):
        return collective_time("all_gather", gather_bytes * u.params, inner, bw_in, lat_in) if sharded_params else 0.0

    def rs(u, last: bool):
        t = collective_time("reduce_scatter", 4 * u.params, inner, bw_in, lat_in)
        if last and cand.replicas > 1:  # the step's reduction over the replicas, of this rank's shard
            kind = "reduce_scatter" if cand.outer_strategy == "optim" else "all_reduce"
            t += collective_time(kind, 4 * u.params / inner, cand.replicas, bw_out, lat_out)
        return t

    # forward a third of a layer's elementwise traffic, backward two thirds (as its FLOPs)
    fwd = [(u.fwd_flops_per_token / rate + elementwise * u.width / 3) * tokens for u in units]
    bwd = [2 * f + (f if u.checkpointed else 0.0) for f, u in zip(fwd, units)]
    terms = {"compute": 0.0, "exposed all-gather": 0.0, "exposed reduce-scatter": 0.0, "host": 0.0}

    timeline = []

    def busy(compute: float, comm_ag: float, comm_rs: float, where: tuple = ()) -> None:
        """One unit's pass: compute beside the collectives overlapping it (the excess is exposed)."""
        if gpu.synchronous:  # a CPU: one after another
            timeline.append((*where, compute, comm_ag, comm_rs, comm_ag + comm_rs))
            terms["compute"] += compute
            terms["host"] += host
            terms["exposed all-gather"] += comm_ag
            terms["exposed reduce-scatter"] += comm_rs
            return
        gpu_time = max(compute, host)
        timeline.append((*where, compute, comm_ag, comm_rs, max(0.0, comm_ag + comm_rs - gpu_time)))
        terms["compute"] += compute
        terms["host"] += gpu_time - compute
        extra = comm_ag + comm_rs - gpu_time
        if extra > 0:
            share = comm_ag / (comm_ag + comm_rs)
            terms["exposed all-gather"] += extra * share
            terms["exposed reduce-scatter"] += extra * (1 - share)

    n = len(units)
    for m in range(micro):
        last = m == micro - 1
        reduce_now = reduce_every_micro or last
        # forward: the first gather exposed, then unit i computes while unit i + 1 gathers
        terms["exposed all-gather"] += ag(units[0])
        for i in range(n):
            busy(fwd[i], ag(units[i + 1]) if i + 1 < n else 0.0, 0.0, ("forward", units[i].name))
        # backward, last unit first: it gathers again unless kept from forward
        regather = sharded_params and cand.reshard_after_forward
        if regather:  # post-forward freed it too: backward's first gather has nothing to hide behind
            terms["exposed all-gather"] += ag(units[-1])
        for k, i in enumerate(range(n - 1, -1, -1)):
            prefetch = ag(units[i - 1]) if regather and i > 0 else 0.0
            reduction = rs(units[i + 1], last) if reduce_now and i + 1 < n else 0.0
            busy(bwd[i], prefetch, reduction, ("backward", units[i].name))
        if reduce_now:
            terms["exposed reduce-scatter"] += rs(units[0], last)
    total_params = sum(u.params for u in units)
    shard = total_params / cluster.gpus if cand.strategy != "no_shard" else total_params
    if cand.replicas > 1 and cand.outer_strategy == "no_shard":
        shard = total_params / inner
    on_device = 1.0 - cand.offload_fraction
    opt = ADAM_BYTES * shard * on_device / (gpu.hbm_bw * eff.hbm)
    opt += cand.offload_fraction * shard * (1 / HOST_ADAM_RATE + 8 / PCIE_BW)  # fp32 grads down, weights up
    terms["optimizer"] = opt
    if newton_schulz:  # Muon: each owner orthogonalises its matrices (bf16 matmuls), after backward
        terms["newton-schulz"] = newton_schulz / (gpu.bf16_flops * eff.matmul)
    refresh = 0.0
    if not sharded_params:  # ZeRO-1/2: the compute weights rebuilt from the updated shards
        refresh = collective_time("all_gather", 2 * total_params, inner, bw_in, lat_in)
    elif cand.replicas > 1 and cand.outer_strategy == "optim":  # HFSDP: main shards gathered over replicas
        refresh = collective_time("all_gather", 2 * total_params / inner, cand.replicas, bw_out, lat_out)
    terms["weight refresh"] = refresh
    if gpu.synchronous:  # ranks beyond the node's cores take turns on them
        shared = max(1.0, min(cluster.gpus, cluster.gpus_per_node) / gpu.cores)
        terms = {k: v * shared for k, v in terms.items()}
    return StepTime(sum(terms.values()), terms, timeline)


def unit_costs(source, seq: int, checkpointing: bool) -> list[UnitCost]:
    """The units of ``source``'s model in forward order, counted on the meta device: the reference GPT's
    embedding (a lookup: no FLOPs), layers (2 FLOPs per parameter and token, and attention's ``4 dim seq``)
    and output head; any other model's ``unit_modules`` at 2 FLOPs per parameter and token."""
    import torch

    with torch.device("meta"):
        model = source.build(None, False)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    cfg = source.config
    if cfg is not None:
        out = [UnitCost("embed", count(model.embed), 0.0)]
        for i, layer in enumerate(model.layers):
            n = count(layer)
            out.append(UnitCost(f"layers.{i}", n, 2.0 * n + 4.0 * cfg.dim * seq, checkpointing, cfg.dim))
        if model.output is not None:
            out.append(UnitCost("output", count(model.output), 2.0 * count(model.output)))
        return out
    specs = source.unit_spec(model)
    classes = tuple(s for s in specs if isinstance(s, type))
    chosen = [m for m in model.modules() if m is not model and (isinstance(m, classes) or any(m is s for s in specs))]
    units = [UnitCost(type(m).__name__, count(m), 2.0 * count(m)) for m in chosen]
    rest = count(model) - sum(u.params for u in units)
    return units + ([UnitCost("root", rest, 2.0 * rest)] if rest else [])
