"""One rank per gradient axis: a micro-batch's grads are added straight into the accumulation buffer.

On one GPU the accumulation buffer already holds the earlier micro-batches' sum in the rows and dtype the
reduction would produce, so loading this micro-batch's grads into a staged buffer and adding that is one pass
too many (Megatron-LM's loop: every micro-batch but the last under ``no_sync()``). What must hold, on gloo:

- training is bit for bit what the staged path gives (the add promotes bf16 to fp32 exactly as the copy did);
- no micro-batch takes a staging buffer for its gradients: the first lands in the fresh buffer itself;
- also where the main grads' dtype is not the comm dtype but the comm dtype holds the grads exactly (the
  bench's bf16-main recipe: bf16 grads and main grads, fp32 on the wire): the staged fp32 copy changed no
  value, and in graph-safe mode it was a static buffer kept for good (a model's worth of fp32 at rest).
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


RECIPES = {
    "fp32_main": dict(param_dtype=torch.bfloat16, main_params_dtype=torch.float32),
    "fp32_main_kept_bf16": dict(param_dtype=torch.bfloat16, main_params_dtype=torch.float32,
                                keep_compute_weights=True),
    "bf16_main_fp32_comm": dict(param_dtype=torch.bfloat16, main_params_dtype=torch.bfloat16,
                                main_grads_dtype=torch.bfloat16, grad_comm_dtype=torch.float32),
}


def _train(staged_only: bool, recipe: str) -> dict:
    adds_in_place = GradWindow._adds_in_place
    if staged_only:  # the path before: every micro-batch through a staged buffer (a pooled worker: put back below)
        GradWindow._adds_in_place = lambda self: False
    try:
        return _run(recipe)
    finally:
        GradWindow._adds_in_place = adds_in_place


def _run(recipe: str) -> dict:
    torch.manual_seed(0)
    policy = shardwise.MixedPrecisionPolicy(**RECIPES[recipe])
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


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_one_rank_micro_batches_add_in_place_bit_for_bit(recipe):
    ours = run_distributed(_train, 1, False, recipe)[0]
    staged = run_distributed(_train, 1, True, recipe)[0]
    assert ours["losses"] == staged["losses"]
    for name, value in staged["state"].items():
        assert torch.equal(ours["state"][name], value), name
    # no micro-batch takes a staging buffer (the first lands in the fresh buffer)
    assert all(n == 0 for n in ours["taken"]), ours["taken"]
    assert any(n for i, n in enumerate(staged["taken"]) if i % MICRO), staged["taken"]  # the probe sees staging
