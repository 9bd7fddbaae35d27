"""One rank per gradient axis: a micro-batch's grads are added straight into the accumulation buffer.

On one GPU the accumulation buffer already holds the earlier micro-batches' sum in the rows and dtype the
reduction would produce, so loading this micro-batch's grads into a staged buffer and adding that is one pass
too many (Megatron-LM's loop: every micro-batch but the last under ``no_sync()``). What must hold, on gloo:

- training is bit for bit what the staged path gives (the add promotes bf16 to fp32 exactly as the copy did);
- after the first micro-batch of a step (which lands in the fresh buffer itself) no micro-batch takes a
  staging buffer for its gradients.
"""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.engine.distributed_buffer import Levels
from shardwise.engine.grad_window import GradWindow
from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch

MICRO, STEPS = 3, 3


def _train(staged_only: bool, keep: bool) -> dict:
    adds_in_place = GradWindow._adds_in_place
    if staged_only:  # the path before: every micro-batch through a staged buffer (a pooled worker: put back below)
        GradWindow._adds_in_place = lambda self: False
    try:
        return _run(keep)
    finally:
        GradWindow._adds_in_place = adds_in_place


def _run(keep: bool) -> dict:
    torch.manual_seed(0)
    policy = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16, main_params_dtype=torch.float32,
                                            keep_compute_weights=keep)
    model = shardwise.fully_shard(TinyLM(TinyConfig()).to(device()), strategy="optim_grads_params",
                                  unit_modules=[Block], mixed_precision=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    taken, losses = [], []
    original_take = Levels.take

    def counting_take(self, *args, **kwargs):
        taken[-1] += 1
        return original_take(self, *args, **kwargs)

    Levels.take = counting_take
    try:
        for step in range(STEPS):
            for micro in range(MICRO):
                taken.append(0)
                tokens, targets = (t.to(device()) for t in batch(10 * step + micro, 4, model.c))
                if micro < MICRO - 1:
                    with model.no_sync():
                        model(tokens, targets).backward()
                else:
                    loss = model(tokens, targets)
                    loss.backward()
                    losses.append(loss.item())
            opt.step()
            opt.zero_grad()
    finally:
        Levels.take = original_take
    return {"losses": losses, "taken": taken,
            "state": {k: v.full_tensor() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("keep", [False, True])
def test_one_rank_micro_batches_add_in_place_bit_for_bit(keep):
    ours = run_distributed(_train, 1, False, keep)[0]
    staged = run_distributed(_train, 1, True, keep)[0]
    assert ours["losses"] == staged["losses"]
    for name, value in staged["state"].items():
        assert torch.equal(ours["state"][name], value), name
    # the first micro-batch of each step lands in the fresh buffer; the later ones take no staging buffer
    later = [n for i, n in enumerate(ours["taken"]) if i % MICRO]
    assert later and all(n == 0 for n in later), ours["taken"]
    assert any(n for i, n in enumerate(staged["taken"]) if i % MICRO), staged["taken"]  # the probe sees staging
