"""Held-out loss and perplexity for ``shardwise train --eval-data / --eval-fraction``.

The evaluation set is fixed by the run, not by how it is spread: the first
``--eval-batches K`` global batches (``K x micro-batch x grad-accum x ranks``
windows of ``seq_len + 1`` tokens, in order, cut like the training windows; ``K
= 0``: every window) of the held-out tokens. So every world size and strategy
with the same global batch evaluates the same windows. Rank ``r`` takes its
slice of each group of ``micro-batch x ranks`` windows (as the training loader
does) and every rank runs the same number of forwards (ZeRO-3 gathers in each);
a rank left without windows at the end runs one and counts nothing.

The loss is the token-level cross-entropy of the model's logits (an MoE
auxiliary loss is not part of it), each window summed in float64 and the sums
all-reduced in float64: ``eval_loss = sum / (windows x seq_len)``,
``perplexity = exp(eval_loss)``. It runs under ``torch.no_grad()`` in eval mode
(no dropout) inside ``torch.random.fork_rng``, and reads no training state, so
the training stream and its RNG are exactly as without it (resume stays exact).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["Evaluator"]


class Evaluator:
    """``evaluator(model) -> {"eval_loss", "eval_perplexity", "eval_tokens", "eval_time_s"}`` on every rank."""

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int, global_batch: int, batches: int,
                 every: int, last_step: int, rank: int = 0, world_size: int = 1, device="cpu"):
        self.tokens, self.seq_len, self.batch = tokens, seq_len, micro_batch_size
        self.rank, self.world, self.device = rank, world_size, torch.device(device)
        self.every, self.last_step = every, last_step
        available = (len(tokens) - 1) // seq_len
        if available < 1:
            raise ValueError(f"{len(tokens)} held-out tokens are too few for one window of seq_len={seq_len}")
        self.available = available
        self.windows = available if batches == 0 else min(available, batches * global_batch)
        self.short = batches and self.windows < batches * global_batch  # fewer than asked for

    def describe(self) -> str:
        """One line: how much of the held-out data each evaluation covers (by default a few batches of it)."""
        if self.windows == self.available:
            covered = "all of the held-out data" + (" (fewer than --eval-batches asks for)" if self.short else "")
        else:
            covered = (f"{100 * self.windows / self.available:.3g}% of the {self.available} held-out windows "
                       f"(the first ones; --eval-batches 0 evaluates all, more batches more of them)")
        return f"eval: {self.windows} windows of {self.seq_len} tokens, {covered}"

    def due(self, step: int) -> bool:
        """Evaluate after ``step``: every ``--eval-every`` steps and after the last."""
        return step == self.last_step or bool(self.every and step % self.every == 0)

    def _rows(self, indices: list[int]) -> torch.Tensor:
        rows = np.stack([np.asarray(self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1], dtype=np.int64)
                         for i in indices])
        return torch.from_numpy(rows).to(self.device)

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module) -> dict:
        import time

        t0 = time.perf_counter()
        group = self.batch * self.world
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        was_training = model.training
        devices = [self.device] if self.device.type == "cuda" else []  # CPU's generator is always forked
        model.eval()
        try:
            with torch.random.fork_rng(devices=devices, device_type="cuda"):
                for first in range(0, self.windows, group):
                    start = first + self.rank * self.batch
                    mine = list(range(start, min(start + self.batch, self.windows)))
                    rows = self._rows(mine or [0])  # no windows left here: forward anyway, count nothing
                    logits = model(rows[:, :-1])
                    losses = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(), reduction="none")
                    if mine:
                        total += losses.view(len(mine), self.seq_len).sum(dim=1, dtype=torch.float64).sum()
        finally:
            model.train(was_training)
        if self.world > 1 and dist.is_initialized():
            dist.all_reduce(total)
        loss = total.item() / (self.windows * self.seq_len)
        return {"eval_loss": loss, "eval_perplexity": math.exp(min(loss, 700.0)),
                "eval_tokens": self.windows * self.seq_len, "eval_time_s": time.perf_counter() - t0}
