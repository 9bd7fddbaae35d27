"""``shardwise train --cuda-graphs``: each step's forward and backward (every micro-batch, the gradient
reductions) replayed from a CUDA graph.

The model is wrapped with ``fully_shard(graph_safe=True)`` and the step captured once by
``shardwise.capture_step`` (its first step is the eager warm-up); clipping and the optimizer step
stay eager after the replay, so the learning-rate schedule, the metrics and the checkpoints see a
step as they always do. The micro-batches of a step are copied into the graph's static inputs.

Checked at config time: :func:`check_flags` (the flags alone).
"""

from __future__ import annotations

import contextlib

import torch

from .errors import ConfigError
from .loop import DataParallelRun

__all__ = ["check_flags", "GraphedRun"]


def check_flags(cfg, model, device: str) -> None:
    """Refuse what ``--cuda-graphs`` cannot capture or is not built for, naming the flag and value."""
    if not cfg.cuda_graphs:
        return
    if device != "cuda":
        raise ConfigError("cuda_graphs", True, "CUDA graphs need CUDA; this run is on the CPU (--device "
                          f"{cfg.device}); drop --cuda-graphs or run on a GPU")
    refused = [("offload", cfg.offload, "CPU offload steps the optimizer on the host inside the step"),
               ("pp", cfg.pp > 1, "pipeline schedules keep per-micro-batch host bookkeeping"),
               ("cp", cfg.cp > 1, "not built yet with context parallelism"),
               ("hf_config", bool(cfg.hf_config), "not built yet for Hugging Face models"),
               ("init_from", bool(cfg.init_from), "not built yet for Hugging Face models")]
    for name, used, why in refused:
        if used:
            raise ConfigError(name, getattr(cfg, name), f"with --cuda-graphs: {why}")
    if "E" in model.layer_kinds:
        raise ConfigError("layer_pattern", model.layer_pattern, "with --cuda-graphs: MoE layers route a "
                          "data-dependent number of tokens to each expert (read on the host), which a CUDA graph "
                          "cannot capture")


class GraphedRun(DataParallelRun):
    """A :class:`DataParallelRun` whose forward and backward replay a captured graph."""

    def __init__(self, model: torch.nn.Module):
        super().__init__(model)
        self._captured = None

    def _step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Every micro-batch of one step (``tokens[i]``, ``targets[i]``); the sum of their mean losses."""
        self.module.zero_grad_buffer()  # the step overwrites the grads, as after the loop's zero_grad
        grad_accum = tokens.shape[0]
        loss_sum = torch.zeros((), device=tokens.device)
        for micro in range(grad_accum):
            last = micro == grad_accum - 1
            with contextlib.nullcontext() if last else self.module.no_sync():
                loss = self.module(tokens[micro], targets[micro])
                (loss / grad_accum).backward()
            loss_sum += loss.detach().float()
        return loss_sum

    def forward_backward(self, loader, grad_accum: int, device: torch.device) -> torch.Tensor:
        batches = [next(loader) for _ in range(grad_accum)]
        tokens = torch.stack([b[0] for b in batches])
        targets = torch.stack([b[1] for b in batches])
        if self._captured is None:  # the first step runs eagerly as the warm-up, then the capture
            import shardwise

            self._captured = shardwise.capture_step(self._step, (tokens, targets), models=self.module,
                                                    num_warmup_iters=1)
            return self._captured.warmup_outputs[0].clone()
        return self._captured(tokens, targets).clone()
