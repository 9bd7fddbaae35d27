"""``shardwise bench --optimizer adamw,muon``: the same step with torch's Muon on the layers' matrices.

A Muon run wraps with the layers' matrices ``Owned()`` (whole on one owner rank each) and steps
``app.muon.MuonAdamW`` (Muon there, AdamW on the embedding, head, norms and biases). Beside
tokens/s it reports the mechanism: each rank's Newton-Schulz FLOPs (the matrices it owns), their
imbalance (largest over mean), and on the CPU each rank's measured time in Muon's step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..muon import MuonAdamW, muon_names, ns_flops_per_rank, owned_placement_fn
from .wrappers import LR, WEIGHT_DECAY, wrap_none, wrap_shardwise

__all__ = ["MUON_WRAPPERS", "unavailable_reason", "wrap_for_muon", "muon_stats"]

MUON_WRAPPERS = ("shardwise", "none")  # owned matrices; the one-process ceiling (plain tensors)


def unavailable_reason(name: str, optimizer: str, fp8: str, graphs: bool, offload: float) -> str | None:
    if optimizer != "muon":
        return None
    if name not in MUON_WRAPPERS:
        return f"--optimizer muon runs under {', '.join(MUON_WRAPPERS)} (shardwise's Owned() matrices)"
    if fp8 != "off" or graphs or (offload and name == "shardwise"):
        return "--optimizer muon: not with --fp8, --cuda-graphs or --offload (refused for Owned() matrices)"
    return None


class _TimedMuon:
    """Times each Muon step on this rank (CPU runs only: a GPU step would have to synchronize)."""

    def __init__(self, optimizer: MuonAdamW):
        self.seconds = 0.0
        step = optimizer.muon.step

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = step(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            return out

        optimizer.muon.step = timed


def wrap_for_muon(name: str, model, device: torch.device, extra: dict):
    """``(model, optimizer, names, timer)``: wrapper ``name`` with Muon's matrices owned, and the optimizers."""
    names = muon_names(model)
    if name == "shardwise":
        model, _ = wrap_shardwise(model, device, shard_placement_fn=owned_placement_fn(model), **extra)
    else:
        model, _ = wrap_none(model, device, **extra)
    impl = {"fused": True} if device.type == "cuda" else {"foreach": True}
    optimizer = MuonAdamW(model, names, lr=LR, weight_decay=WEIGHT_DECAY, **impl)
    return model, optimizer, names, _TimedMuon(optimizer) if device.type == "cpu" else None


def muon_stats(model, names: set[str], timer: _TimedMuon | None, device: torch.device, steps: int) -> dict:
    """The mechanism: Newton-Schulz FLOPs each rank owns and their imbalance; CPU: each rank's Muon step time."""
    flops = ns_flops_per_rank(model, names)
    mean = sum(flops) / len(flops)
    out = {"ns_flops_per_rank": flops, "ns_imbalance": max(flops) / mean if mean else None,
           "ns_predicted_ms": _predicted_ms(max(flops), device)}
    if timer is not None:
        seconds = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(dist.get_world_size())]
        dist.all_gather(seconds, torch.tensor(timer.seconds, dtype=torch.float64, device=device))
        out["muon_step_s_per_rank"] = [t.item() / max(steps, 1) for t in seconds]
    return out


def _predicted_ms(flops: float, device: torch.device) -> float | None:
    """The planner's Newton-Schulz term (``plan.step_time``) for the busiest rank on this GPU, when the planner
    knows the GPU (H100, H200, B200, GB200 by name); ``None`` on the CPU."""
    if device.type != "cuda":
        return None
    from ..plan.hardware import EFFICIENCY, GPUS

    name = torch.cuda.get_device_name(device)
    spec = next((g for key, g in GPUS.items() if key in name), None)
    return None if spec is None else 1000 * flops / (spec.bf16_flops * EFFICIENCY.matmul)
