"""``shardwise train``'s pre-launch memory check, through the planner: the run's estimate, and when it cannot
fit, the configuration that would (the planner's candidates, weighed by the same estimate).

A training worker already has its process group, so it cannot simulate another world; it uses the reference
GPT's estimate (``app/memory.py``), which ``tests/app/test_plan.py`` holds to the traced step (equal state
terms; the peak plus the RoPE tables and under 64 KiB). Candidates are tried in the order a user would
change least: checkpointing, a smaller micro-batch, ZeRO-3, then offload.
"""

from __future__ import annotations

from ...models import GPTConfig
from ..memory import DoesNotFit, check_fits, estimate_for_run
from .candidates import Candidate

__all__ = ["run_estimate", "check_run", "fitting_candidate"]


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


def _flags(c: Candidate) -> str:
    flags = [f"--strategy {c.strategy}", f"--micro-batch-size {c.micro_batch}"]
    if c.activation_checkpointing:
        flags.append("--activation-checkpointing")
    if c.offload_fraction:
        flags.append(f"--offload --offload-fraction {c.offload_fraction:g}")
    return " ".join(flags)


def fitting_candidate(estimate, gpu_free: float, host_free: float | None) -> tuple[Candidate, object] | None:
    """The first candidate (fewest changes first) whose estimate fits, with that estimate."""
    inputs = estimate.inputs
    if "config" not in inputs:
        return None
    ckpt = inputs["activation_checkpointing"]
    ckpt = inputs["config"].activation_checkpointing if ckpt is None else ckpt
    mb = inputs["micro_batch"]
    tried = []
    for strategy in dict.fromkeys([inputs["strategy"], "optim_grads_params"]):
        for ac in dict.fromkeys([ckpt, True]):
            m = mb
            while m >= 1:
                for frac in dict.fromkeys([inputs["offload_fraction"], 0.5, 1.0]):
                    tried.append(Candidate(strategy=str(strategy), activation_checkpointing=ac, micro_batch=m,
                                           offload_fraction=frac))
                m //= 2
    for cand in tried:
        e = estimate_for_run(**{**inputs, "strategy": cand.strategy, "activation_checkpointing": cand.activation_checkpointing,
                                "micro_batch": cand.micro_batch, "offload_fraction": cand.offload_fraction})
        if e.gpu_bytes <= gpu_free and (host_free is None or e.host_bytes <= host_free):
            return cand, e
    return None


def check_run(estimate, gpu_free: float, host_free: float | None) -> str:
    """``check_fits``; when it raises, the message also names the configuration the planner finds that fits
    (same global batch: a smaller micro-batch raises the accumulation steps)."""
    try:
        return check_fits(estimate, gpu_free, host_free)
    except DoesNotFit as error:
        found = fitting_candidate(estimate, gpu_free, host_free)
        if found is None:
            raise DoesNotFit(f"{error} No configuration on these GPUs fits (shardwise plan weighs more GPUs).") from None
        cand, e = found
        raise DoesNotFit(f"{error} The planner's configuration that fits: {_flags(cand)} (per GPU "
                         f"{e.gpu_bytes / 2**30:.1f} GiB; keep the global batch with --grad-accum).") from None
