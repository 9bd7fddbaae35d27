"""``shardwise bench --cuda-graphs on,off``: each step captured in a CUDA graph and replayed.

Graphed runs exist for the wrappers whose step a graph can hold: ``shardwise`` (wrapped with
``fully_shard(graph_safe=True)``) and the ceiling ``none`` (a plain bf16 replica); the others
are skipped by name. The first warm-up step runs eagerly inside ``shardwise.capture_step`` (it
trains, and the capture computes nothing), so a graphed run trains the same steps on the same
batches as an eager one; the optimizer (fused AdamW) is made capturable and stepped in the graph,
clipping too.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["GRAPH_MODES", "GRAPHED_WRAPPERS", "unavailable_reason", "graphed_step"]

GRAPH_MODES = {"off": False, "on": True}
GRAPHED_WRAPPERS = ("shardwise", "shardwise-fp8ag", "shardwise-bf16main", "none", "none-fp32main")


def unavailable_reason(name: str, device: torch.device, graphs: bool) -> str | None:
    """Why wrapper ``name`` has no graphed run here (``None`` when it has, or the run is eager)."""
    if not graphs:
        return None
    if device.type != "cuda":
        return "CUDA graphs need CUDA (skipped on CPU)"
    if name not in GRAPHED_WRAPPERS:
        return "no CUDA-graph variant in the benchmark (its buffers are freed and reallocated between steps)"
    return None


def graphed_step(model, optimizer, clip: Callable[[], None] | None, first_batch) -> tuple[Callable, torch.Tensor]:
    """The step as a replay of a captured graph, and the loss of the first step (the eager warm-up)."""
    import shardwise

    for group in optimizer.param_groups:  # before the first step: its state is made on the device
        group["capturable"] = True

    def step(inputs, targets):
        optimizer.zero_grad(set_to_none=True)  # the captured step overwrites the grads, as the eager loop's
        loss = model(inputs, targets)
        loss.backward()
        if clip is not None:
            clip()
        optimizer.step()
        return loss.detach()

    captured = shardwise.capture_step(step, tuple(first_batch), models=model, num_warmup_iters=1)
    return (lambda batch: captured(*batch).clone()), captured.warmup_outputs[0].clone()
