"""``shardwise.app.plan.plan(...)``: every candidate's memory (traced) and step time (modelled), ranked, one recommended.

A candidate that does not fit the GPU's memory (less ``headroom`` for the allocator and NCCL) is listed but
never recommended; the rest are ranked by tokens per second per GPU. The recommendation says which term of
its step dominates (compute, exposed all-gather, exposed reduce-scatter, host, optimizer).

Memory is the one model's (:func:`memory_of`): the trace, after its fast path (``estimate.state_bound``: what
the reference GPT must hold at once, counted) has ruled out the candidates that cannot fit; those are
not traced, and their rows show that lower bound (``MemoryTrace.bound``).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field, replace
from typing import Callable

from .candidates import Candidate, candidates as all_candidates
from .hardware import EFFICIENCY, Cluster, Efficiency
from .model_source import ModelSource
from .step_time import StepTime, step_time, unit_costs
from .simulate import simulated_world
from .trace import MemoryTrace, settled_heap, trace_memory

__all__ = ["Row", "Plan", "plan", "evaluate", "memory_of", "HEADROOM"]

#: the part of HBM a plan leaves to what the trace does not see: the CUDA context and NCCL's buffers (about
#: 1-2 GiB on an H100/H200), the caching allocator's fragmentation (a few percent of the peak)
HEADROOM = 0.08


@dataclass
class Row:
    candidate: Candidate
    memory: MemoryTrace
    time: StepTime
    tokens_per_s_per_gpu: float
    mfu: float
    fits: bool

    def as_dict(self) -> dict:
        return {"config": self.candidate.as_dict(), "label": self.candidate.label(), "fits": self.fits,
                "peak_gib": self.memory.peak / 2**30, "peak_phase": self.memory.phase,
                "peak_is_lower_bound": self.memory.bound,
                "host_gib": self.memory.host / 2**30,
                "memory_parts_gib": {k: v / 2**30 for k, v in self.memory.parts.items()},
                "step_s": self.time.seconds, "terms_s": dict(self.time.terms),
                "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "mfu": self.mfu,
                "dominant": self.time.dominant()}


@dataclass
class Plan:
    model: str
    cluster: Cluster
    seq: int
    global_batch: int
    rows: list[Row] = field(default_factory=list)  # ranked: fitting ones first, fastest first
    dry_run: object = None  # the recommended row's ``DryRun`` (``dry_run.py``) when one was asked for
    would_fit: object = None  # where no row fits: what ``fit.search`` found that would (``fit.Fit``), or None

    @property
    def recommended(self) -> Row | None:
        return next((r for r in self.rows if r.fits), None)

    def why(self) -> str:
        best = self.recommended
        if best is None:
            from .fit import advice

            return "no candidate fits. " + advice(self.would_fit, _peak)
        terms = best.time.terms
        top = best.time.dominant()
        share = terms[top] / best.time.seconds
        comm = terms["exposed all-gather"] + terms["exposed reduce-scatter"]
        text = f"{top} dominates ({share:.0%} of the step); exposed communication {comm / best.time.seconds:.1%}"
        fastest = max(self.rows, key=lambda r: r.tokens_per_s_per_gpu)
        if not fastest.fits:
            text += (f"; faster but over memory: {fastest.candidate.label()} "
                     f"({'at least ' if fastest.memory.bound else ''}{fastest.memory.peak / 2**30:.1f} GiB)")
        return text


def _peak(memory: MemoryTrace) -> str:
    unit, name = (2**30, "GiB") if memory.peak >= 2**30 else (2**20, "MiB")
    return f"peak {memory.peak / unit:.1f} {name} per GPU"


def memory_of(source: ModelSource, world: int, cand: Candidate, seq: int, limit: float | None = None) -> MemoryTrace:
    """The candidate's memory per rank, from the one model: where ``source`` is the reference GPT and the fast
    path's lower bound (``estimate.state_bound``: what must be live at once, at the optimizer step or at the
    start of backward) is over ``limit``, that bound (``MemoryTrace.bound``; the candidate cannot fit, nothing is traced); else the trace."""
    if limit is not None and source.config is not None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from .estimate import state_bound

        with unset_fake_temporarily():  # counted on the meta device, outside the simulation's fake mode
            bound = state_bound(source.config, world, cand, seq, vocab_units=source.vocab_units)
        if bound > limit:
            return MemoryTrace(bound, {}, phase="optimizer step", bound=True)
    return trace_memory(source, world, cand, seq)


def evaluate(source: ModelSource, cluster: Cluster, cand: Candidate, seq: int, global_batch: int, *,
             compiled: bool = True, eff: Efficiency = EFFICIENCY, memory: MemoryTrace | None = None,
             headroom: float = HEADROOM, units: list | None = None, flops_per_token: float | None = None) -> Row:
    """One candidate's row: its traced memory (or ``memory``) and modelled step (``units`` and
    ``flops_per_token``: ``unit_costs`` and the source's count, when the caller has them already)."""
    memory = memory or trace_memory(source, cluster.gpus, cand, seq)
    units = unit_costs(source, seq, cand.activation_checkpointing) if units is None else units
    t = step_time(units, cand, cluster, seq, global_batch, compiled=compiled, eff=eff)
    tokens = global_batch * seq / cluster.gpus
    tps = tokens / t.seconds
    flops = source.flops_per_token(seq) if flops_per_token is None else flops_per_token
    mfu = tps * flops / cluster.gpu.bf16_flops
    fits = memory.peak <= (1 - headroom) * cluster.gpu.hbm_bytes
    return Row(cand, memory, t, tps, mfu, fits)


def plan(source: ModelSource, cluster: Cluster, seq: int, global_batch: int, *, compiled: bool = True,
         eff: Efficiency = EFFICIENCY, offload: bool = False, fp8: bool = True, hybrid: bool = True,
         micro_batches: list[int] | None = None, only: Callable[[Candidate], bool] | None = None,
         headroom: float = HEADROOM, progress: Callable[[str], None] | None = None) -> Plan:
    """Rank every candidate (see :func:`.candidates.candidates`) for ``source`` on ``cluster``.

    Memory is traced once per distinct memory configuration (FP8 is timed, not traced: the bf16 model's
    buffers stand for it, an upper bound for the FP8 gather's uint8 ones). ``only`` filters candidates.
    """
    found = Plan(source.name, cluster, seq, global_batch)
    # the objects alive before the plan (torch, the caller's) set aside from the garbage collector while it runs
    # (``trace.settled_heap``), and one simulation for every trace: its meshes made once
    with settled_heap(collect=True), simulated_world(cluster.gpus):
        _rank(found, source, cluster, seq, global_batch, compiled, eff, offload, fp8, hybrid, micro_batches, only,
              headroom, progress)
    found.rows.sort(key=lambda r: (not r.fits, -r.tokens_per_s_per_gpu))
    if found.rows and found.recommended is None:
        found.would_fit = _would_fit(found, source, cluster, seq, headroom)
    return found


def _settle() -> None:
    """What the last trace left goes now, and what outlives it (the simulation's meshes, FakeTensorMode's cache)
    is set aside like the heap before the plan: each traced step's ``gc.collect()`` then walks only that
    step's objects (it walked every trace's leftovers before, a twentieth of a plan)."""
    gc.collect()
    gc.freeze()


def _would_fit(found: Plan, source: ModelSource, cluster: Cluster, seq: int, headroom: float):
    """Nothing weighed fits: ``fit.search`` (the same search as ``shardwise train``'s refusal) from the row of
    the smallest peak, with the trace, over offload and on more GPUs."""
    from .fit import search

    start = min(found.rows, key=lambda r: (r.memory.bound, r.memory.peak))  # a traced row where there is one
    traced = {(replace(r.candidate, fp8=False, fp8_gather=False), cluster.gpus): r.memory for r in found.rows}
    limit = (1 - headroom) * cluster.gpu.hbm_bytes

    def weigh(cand: Candidate, gpus: int) -> MemoryTrace:
        key = (replace(cand, fp8=False, fp8_gather=False), gpus)
        if key not in traced:
            traced[key] = memory_of(source, gpus, key[0], seq, limit)
        return traced[key]

    return search(start.candidate, cluster.gpus, weigh, lambda m: m.peak <= limit,
                  worlds=[cluster.gpus * k for k in (2, 4, 8, 16)])


def _rank(found, source, cluster, seq, global_batch, compiled, eff, offload, fp8, hybrid, micro_batches, only,
          headroom, progress) -> None:
    traces: dict[Candidate, MemoryTrace] = {}
    costs: dict[bool, list] = {}  # unit_costs by activation checkpointing
    flops = source.flops_per_token(seq)
    limit = (1 - headroom) * cluster.gpu.hbm_bytes
    for cand in all_candidates(cluster.gpus, cluster.gpus_per_node, global_batch, micro_batches=micro_batches,
                               offload=offload, fp8=fp8, hybrid=hybrid):
        if only is not None and not only(cand):
            continue
        key = replace(cand, fp8=False, fp8_gather=False)
        if key not in traces:
            if progress:
                progress(f"weighing {key.label()}")
            traces[key] = memory_of(source, cluster.gpus, key, seq, limit)
            _settle()
        ac = cand.activation_checkpointing
        if ac not in costs:
            costs[ac] = unit_costs(source, seq, ac)
        found.rows.append(evaluate(source, cluster, cand, seq, global_batch, compiled=compiled, eff=eff,
                                   memory=traces[key], headroom=headroom, units=costs[ac], flops_per_token=flops))
