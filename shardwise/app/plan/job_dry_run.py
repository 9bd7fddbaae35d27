"""``shardwise train --dry-run``: the dry run (``dry_run.py``) of the job ``train`` is about to launch, in the
launcher before any worker starts (a worker's process group would leave no room for the fake one).

The job's flags become one planner ``Candidate`` on a ``Cluster`` of the job's world size; the answer is
whether rank 0's measured memory, with NCCL's modelled buffers, fits this device, and its tokens/s.
"""

from __future__ import annotations

import os

import torch

from ...models import GPTConfig
from ..host_memory import host_available_bytes
from .estimate import DoesNotFit
from .candidates import Candidate
from .dry_run import DryRun, dry_run
from .hardware import GPUS, Cluster
from .model_source import gpt_source

__all__ = ["job_candidate", "dry_run_job"]


def job_candidate(cfg, model_cfg: GPTConfig) -> Candidate:
    """The planner's name for what ``cfg`` runs (``--pp`` and ``--cp`` have none: refused by name)."""
    for flag, value in (("pp", cfg.pp), ("cp", cfg.cp)):
        if value > 1:
            raise DoesNotFit(f"--dry-run does not model --{flag} {value} yet (the planner's candidates are "
                             "data-parallel layouts); run without --dry-run")
    return Candidate(strategy=cfg.strategy, replicas=cfg.outer_dp or 1, outer_strategy=cfg.outer_strategy or "no_shard",
                     activation_checkpointing=bool(model_cfg.activation_checkpointing),
                     micro_batch=cfg.micro_batch_size, offload_fraction=cfg.offload_fraction if cfg.offload else 0.0,
                     fp8=cfg.fp8 == "tensorwise", fp8_gather=cfg.fp8 == "tensorwise" and cfg.fp8_all_gather)


def dry_run_job(cfg, model_cfg: GPTConfig, world: int, device_type: str) -> tuple[DryRun, str]:
    """The job's dry run and one line saying whether it fits and its expected tokens/s; raises
    ``DoesNotFit`` (with that line) when it does not."""
    cand = job_candidate(cfg, model_cfg)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpu = GPUS["H100"]
    if device_type == "cuda":
        name = torch.cuda.get_device_name().upper()
        gpu = next((spec for key, spec in GPUS.items() if key in name), gpu)
    cluster = Cluster(world, min(local, world), gpu)
    source = gpt_source(model_cfg, vocab_units=False)  # train's units are the layers
    found = dry_run(source, cluster, cand, cfg.seq_len, world * cfg.micro_batch_size * cfg.grad_accum,
                    compiled=bool(cfg.compile), cuda_graphs=cfg.cuda_graphs, device=device_type)
    if device_type == "cuda":
        need = found.process_device_bytes + found.nccl_bytes
        have = torch.cuda.mem_get_info()[1]
        where = "per GPU (measured peak reserved, context and workspaces, NCCL's buffers modelled)"
    else:
        need = found.traced_peak * local
        have = host_available_bytes() or float("inf")
        where = f"for {local} CPU ranks (traced storages of the real steps)"
    fits = need <= have
    line = (f"dry run ({cand.label()}, rank 0 of {world} on one {found.device}): needs {need / 2**30:.2f} GiB {where} "
            f"of {have / 2**30:.2f}: {'fits' if fits else 'does not fit'}; expected {found.tokens_per_s_per_gpu:,.0f} "
            f"tokens/s per {'GPU' if device_type == 'cuda' else 'rank'} ({found.step_s:.3f} s a step, the wire "
            "modelled)")
    if not fits:
        raise DoesNotFit(line)
    return found, line
