"""The compute weights are rebuilt after every step that had gradients, whatever the optimizer's kernels do."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise

from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import compare, train_both
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


class _UncountedSGD(torch.optim.Optimizer):
    """SGD whose update moves no version counter, as torch's foreach AdamW over DTensors on CUDA does."""

    def __init__(self, params, lr: float):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                local = p.to_local() if hasattr(p, "to_local") else p
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                with torch.autograd._unsafe_preserve_version_counter(local):
                    local.add_(grad, alpha=-group["lr"])


def _update_without_version_bump(strategy: str):
    config = TinyConfig()

    def build():
        torch.manual_seed(0)
        return TinyLM(config).to(device())

    sharded, reference = train_both(
        build, lambda model: shardwise.fully_shard(model, strategy=strategy, unit_modules=[Block]),
        lambda model: _UncountedSGD(model.parameters(), 0.5), lambda step: batch(step, dist.get_world_size(), config), 3,
    )
    compare(sharded, reference)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads"])
def test_an_update_that_moves_no_version_counter_still_reaches_the_next_forward(strategy):
    """The model weights are rebuilt after every step that had grads, whatever the optimizer's kernels do."""
    run_distributed(_update_without_version_bump, 2, strategy)
