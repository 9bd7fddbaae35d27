"""The library call behind ``shardwise.plan``: what the model argument may be, and the defaults."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch.nn as nn

from ...engine.placements import hybrid_problem
from ...models import GPTConfig
from .hardware import EFFICIENCY, Cluster, GpuSpec, load_calibration, parse_gpu
from .model_source import ModelSource, factory_source, gpt_source, hf_source, preset_source, shape_source
from .planner import Plan, plan as rank_candidates

__all__ = ["plan", "resolve_model"]

_SHAPE_KEYS = {"layers", "hidden", "heads", "ffn", "vocab", "kv_heads"}


def resolve_model(model, seq: int | None, *, unit_modules: Sequence | None = None,
                  inputs: Callable[[int, int], tuple] | None = None,
                  flops_per_token: Callable[[int], float] | None = None) -> ModelSource:
    """A ``ModelSource`` from a preset name, a Hugging Face config folder, a Megatron-style shape dict
    (``layers, hidden, heads, ffn, vocab[, kv_heads]``), a ``GPTConfig`` or an ``nn.Module`` factory."""
    if isinstance(model, ModelSource):
        return model
    if isinstance(model, GPTConfig):
        return gpt_source(model if not seq else GPTConfig(**{**model.to_dict(), "max_seq_len": max(seq, model.max_seq_len)}))
    if isinstance(model, dict):
        unknown = set(model) - _SHAPE_KEYS
        if unknown:
            raise ValueError(f"model shape keys {sorted(unknown)} are not among {sorted(_SHAPE_KEYS)}")
        return shape_source(**model, seq=seq)
    if isinstance(model, (str, Path)):
        if isinstance(model, str) and not Path(model).exists():
            return preset_source(model, seq=seq)
        return hf_source(model, seq=seq)
    if callable(model):
        if unit_modules is None or inputs is None:
            raise ValueError("a model factory needs unit_modules= (what fully_shard shards unit by unit) and "
                             "inputs=(micro_batch, seq) -> forward's arguments")
        return factory_source(model, unit_modules, inputs, flops_per_token,
                              name=getattr(model, "__name__", "model"))
    raise ValueError(f"model={model!r}: expected a preset name, a Hugging Face config folder, a shape dict, a "
                     "GPTConfig or an nn.Module factory")


def plan(model, *, gpus: int, gpus_per_node: int = 8, gpu: str | GpuSpec = "H100", seq: int = 4096,
         global_batch: int | None = None, micro_batches: Sequence[int] | None = None, compiled: bool = True,
         offload: bool = False, fp8: bool = True, hybrid: bool = True, calibration: str | Path | None = None,
         unit_modules: Sequence[type | nn.Module] | None = None, inputs: Callable[[int, int], tuple] | None = None,
         flops_per_token: Callable[[int], float] | None = None, strategies: Sequence[str] | None = None,
         checkpointing: bool | None = None, reshard_after_forward: bool | None = None,
         replicas: int | None = None, outer_strategy: str | None = None, dry_run: bool = False,
         dry_run_steps: int = 3, move_bytes: bool = False, cuda_graphs: bool = False, progress=None) -> Plan:
    """Per-GPU peak memory, step time, tokens/s/GPU and MFU of every candidate configuration, ranked.

    ``global_batch`` (sequences per optimizer step) defaults to one sequence per GPU. ``calibration``: a
    file ``shardwise plan --calibrate`` wrote (its efficiencies replace the fitted ones). ``strategies``,
    ``checkpointing``, ``reshard_after_forward``, ``replicas`` (1: no HSDP), ``outer_strategy`` (``no_shard``:
    HSDP, ``optim``: HFSDP): weigh only those (``None``: every choice). ``dry_run``: then run
    ``dry_run_steps`` real steps of rank 0 of the recommended row on the local device (``Plan.dry_run``,
    ``dry_run.py``; ``move_bytes``, ``cuda_graphs`` its options).
    """
    if replicas is not None and (replicas < 1 or gpus % replicas):
        raise ValueError(f"replicas={replicas} must be a positive divisor of gpus={gpus}")
    if outer_strategy is not None and (problem := hybrid_problem("optim_grads_params", outer_strategy)):
        raise ValueError(f"outer_strategy={outer_strategy!r} {problem}")
    spec = gpu if isinstance(gpu, GpuSpec) else parse_gpu(gpu)
    eff = EFFICIENCY
    if calibration:  # the measured machine replaces the named GPU and the fitted efficiencies
        eff, measured = load_calibration(calibration)
        spec = GpuSpec(**measured) if measured else spec
    cluster = Cluster(gpus, min(gpus_per_node, gpus), spec)
    source = resolve_model(model, seq, unit_modules=unit_modules, inputs=inputs, flops_per_token=flops_per_token)
    found = rank_candidates(source, cluster, seq, global_batch or gpus, compiled=compiled, eff=eff, offload=offload,
                            fp8=fp8, hybrid=hybrid, micro_batches=list(micro_batches) if micro_batches else None,
                            progress=progress, only=lambda c: (
                                (strategies is None or c.strategy in strategies)
                                and (checkpointing is None or c.activation_checkpointing == checkpointing)
                                and (reshard_after_forward is None or c.reshard_after_forward == reshard_after_forward)
                                and (replicas is None or c.replicas == replicas)
                                and (outer_strategy is None or c.replicas == 1 or c.outer_strategy == outer_strategy)))
    if dry_run and found.recommended is not None:
        from .dry_run import dry_run as run_dry

        if progress:
            progress(f"dry run of {found.recommended.candidate.label()}")
        found.dry_run = run_dry(source, cluster, found.recommended.candidate, seq, found.global_batch,
                                steps=dry_run_steps, compiled=compiled, cuda_graphs=cuda_graphs, move_bytes=move_bytes)
    return found
