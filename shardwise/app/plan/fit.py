"""What would fit: the one search behind ``shardwise train``'s refusal and ``shardwise plan``'s answer when
no candidate fits, and train's pre-launch memory check.

:func:`search` walks the planner's candidates (:class:`.candidates.Candidate`) from a configuration that does
not fit, fewest changed fields first (checkpointing, a smaller micro-batch, ZeRO-3, offload), then the same
configuration on other world sizes (more GPUs; on the CPU one rank), and returns the first that fits. The
memory model is the planner's one; each caller weighs with the path of it that it can run, and says the
answer with :func:`advice`, one sentence:

* ``shardwise train`` (:func:`check_run`, :func:`check_run_on_cpu`): a training worker already has its process
  group, so it cannot simulate another world; it weighs with the model's fast path (``estimate.py``: the
  reference GPT counted), which ``tests/app/test_plan.py`` holds to the traced step (equal state terms; the
  peak plus the RoPE tables and under 64 KiB);
* ``shardwise plan`` (``planner.plan``): with the trace (the fast path first ruling out what cannot fit),
  once every candidate on the asked GPUs is over.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from itertools import product
from typing import Callable, Generic, Iterable, TypeVar

from ...engine.placements import resolve_strategy
from ...models import GPTConfig
from .estimate import DoesNotFit, check_fits, check_fits_on_cpu, cpu_bytes, estimate_for_run
from .candidates import Candidate

__all__ = ["run_estimate", "check_run", "check_run_on_cpu", "search", "Fit", "advice", "flags"]

E = TypeVar("E")


@dataclass
class Fit(Generic[E]):
    """The configuration the search found: the candidate, its world size and what its memory model said."""

    candidate: Candidate
    gpus: int
    memory: E
    start: Candidate
    start_gpus: int


def _fractions(start: float) -> list[float]:
    """Offload fractions to try: the start's, then the planner's (0, 0.5, 1) nearest first."""
    return list(dict.fromkeys([start, *sorted((0.0, 0.5, 1.0), key=lambda f: abs(f - start))]))


def _choices(start: Candidate) -> Iterable[Candidate]:
    """The candidates reachable from ``start`` on its world, fewest changed fields first (checkpointing, a
    smaller micro-batch, ZeRO-3, then offload)."""
    mbs, m = [], start.micro_batch
    while m >= 1:
        mbs.append(m)
        m //= 2
    grid = [replace(start, strategy=s, activation_checkpointing=ac, micro_batch=mb, offload_fraction=f)
            for s, ac, mb, f in product(dict.fromkeys([start.strategy, "optim_grads_params"]),
                                        dict.fromkeys([start.activation_checkpointing, True]), mbs,
                                        _fractions(start.offload_fraction))]

    def changes(c: Candidate) -> tuple:  # how many fields change; among as many, offload last, then ZeRO-3
        which = [getattr(c, name) != getattr(start, name) for name in _LAST_CHANGED]
        return (sum(getattr(c, f.name) != getattr(start, f.name) for f in fields(Candidate)), *which)

    return sorted(grid[1:], key=changes)


#: among candidates with as many changes, the ones that leave these alone first (the order a user changes least)
_LAST_CHANGED = ("offload_fraction", "strategy", "micro_batch", "activation_checkpointing")


def search(start: Candidate, gpus: int, weigh: Callable[[Candidate, int], E], fits: Callable[[E], bool],
           worlds: Iterable[int] = ()) -> Fit[E] | None:
    """The first configuration that fits, from ``start`` on ``gpus`` GPUs (which does not): the candidates of
    the same world (:func:`_choices`), then ``start`` on each of ``worlds`` (its replicas scaled alike).
    ``weigh(candidate, gpus)`` is the caller's memory model, ``fits`` its limit."""
    for cand in _choices(start):
        memory = weigh(cand, gpus)
        if fits(memory):
            return Fit(cand, gpus, memory, start, gpus)
    for world in worlds:
        scale = world / gpus
        cand = replace(start, replicas=max(1, round(start.replicas * scale))) if start.replicas > 1 else start
        memory = weigh(cand, world)
        if fits(memory):
            return Fit(cand, world, memory, start, gpus)
    return None


def flags(c: Candidate) -> str:
    """``shardwise train``'s flags for a candidate's choices."""
    out = [f"--strategy {c.strategy}", f"--micro-batch-size {c.micro_batch}"]
    if c.activation_checkpointing:
        out.append("--activation-checkpointing")
    if c.offload_fraction:
        out.append(f"--offload --offload-fraction {c.offload_fraction:g}")
    return " ".join(out)


def advice(found: Fit | None, numbers: Callable[[object], str], where: str = "GPUs") -> str:
    """The one sentence of what would fit: the configuration ``search`` found with its numbers, or that
    nothing tried does."""
    if found is None:
        return ("Nothing the planner's search tries fits (checkpointing, smaller micro-batches, ZeRO-3, offload, "
                "other world sizes): a smaller model (--preset, --dim, --n-layers).")
    what = f"{found.candidate.label()} ({flags(found.candidate)})"
    on = f" on {found.gpus} {where}" if found.gpus != found.start_gpus else ""
    batch = ("; keep the global batch with --grad-accum" if found.candidate.micro_batch < found.start.micro_batch
             or found.gpus != found.start_gpus else "")
    return f"What fits: {what}{on} ({numbers(found.memory)}){batch}."


# ------------------------------------------------------------------------------- shardwise train
def run_estimate(cfg, model_cfg: GPTConfig, world: int, device_type: str, ranks_per_host: int, fused: bool):
    """The memory estimate of a ``shardwise train`` run without ``--pp`` (``None`` for a Hugging Face model)."""
    if cfg.pp > 1 or cfg.hf_config or cfg.init_from:
        return None
    return estimate_for_run(
        model_cfg, cfg.seq_len, cfg.micro_batch_size, world, cfg.strategy,
        cfg.offload_fraction if cfg.offload else 0.0, outer=cfg.outer_dp or None,
        outer_strategy=cfg.outer_strategy or "no_shard", precision=cfg.precision, vocab_units=False,
        grad_accum=cfg.grad_accum, optimizer="fused" if fused else "default",
        build_on_device=not cfg.meta_init, ranks_per_host=ranks_per_host, cp=cfg.cp,
        materialized_mask=device_type == "cpu")


def _start(inputs: dict) -> Candidate:
    """The candidate an ``estimate_for_run`` estimate was made for."""
    ckpt = inputs["activation_checkpointing"]
    return Candidate(strategy=resolve_strategy(inputs["strategy"]), replicas=inputs["outer"] or 1,
                     outer_strategy=inputs["outer_strategy"],
                     activation_checkpointing=inputs["config"].activation_checkpointing if ckpt is None else ckpt,
                     micro_batch=inputs["micro_batch"], offload_fraction=inputs["offload_fraction"])


def _weigh(inputs: dict, ranks_per_host: Callable[[int], int | None]) -> Callable[[Candidate, int], object]:
    """``estimate_for_run`` of a candidate, the rest of the run as estimated."""
    def weigh(c: Candidate, world: int):
        return estimate_for_run(**{**inputs, "strategy": c.strategy, "activation_checkpointing": c.activation_checkpointing,
                                   "micro_batch": c.micro_batch, "offload_fraction": c.offload_fraction,
                                   "world": world, "outer": c.replicas if c.replicas > 1 else None,
                                   "ranks_per_host": ranks_per_host(world)})
    return weigh


def _gpu_numbers(e) -> str:
    host = f", per host {e.host_bytes / 2**30:.1f} GiB" if e.host_bytes else ""
    return f"per GPU {e.gpu_bytes / 2**30:.1f} GiB{host}"


def check_run(estimate, gpu_free: float, host_free: float | None) -> str:
    """``check_fits`` (``estimate.py``): when the run does not fit, the refusal names the numbers and what
    :func:`search` finds that fits on these GPUs or more (same global batch: a smaller micro-batch raises the
    accumulation steps). Returns ``check_fits``'s warning line when it fits."""
    try:
        return check_fits(estimate, gpu_free, host_free)
    except DoesNotFit as error:
        inputs = estimate.inputs
        if "config" not in inputs:
            raise
        world, per_host = inputs["world"], inputs["ranks_per_host"]
        found = search(_start(inputs), world, _weigh(inputs, lambda w: per_host),
                       lambda e: e.gpu_bytes <= gpu_free and (host_free is None or e.host_bytes <= host_free),
                       worlds=[world * k for k in (2, 4, 8, 16)])
        raise DoesNotFit(f"{error} {advice(found, _gpu_numbers)}") from None


def check_run_on_cpu(estimate, available: float | None, ranks_on_host: int) -> None:
    """``check_fits_on_cpu``: when a CPU run's ranks together pass the host's memory, the refusal names the
    numbers and what :func:`search` finds that fits (one rank where there are more)."""
    try:
        check_fits_on_cpu(estimate, available, ranks_on_host)
    except DoesNotFit as error:
        inputs = estimate.inputs
        if "config" not in inputs:
            raise
        world = inputs["world"]
        alone = ranks_on_host == world and world > 1 and not inputs["outer"]  # every rank here: try one
        found = search(_start(inputs), world, _weigh(inputs, lambda w: ranks_on_host if w == world else w),
                       lambda e: available is None or cpu_bytes(e, e.ranks_per_host) <= available,
                       worlds=[1] if alone else [])
        raise DoesNotFit(f"{error} {advice(found, lambda e: f'{cpu_bytes(e, e.ranks_per_host) / 2**30:.1f} GiB of host memory', 'rank (--nproc)')}") from None
