"""``shardwise.BackwardOptimizer``: each group steps as its gradients land and the gradients are freed."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise

from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


def _backward_optimizer_frees_grads():
    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    torch.manual_seed(0)
    model = shardwise.fully_shard(TinyLM(config), unit_modules=[Block])
    opt = shardwise.BackwardOptimizer(model, torch.optim.AdamW, lr=1e-2)
    before = [p.detach().to_local().clone() for p in model.parameters()]
    tokens, targets = (t.to(device()) for t in batch(0, world, config))
    model(tokens[rank : rank + 1], targets[rank : rank + 1]).backward()
    opt.step()
    resident = sum(g.resident_bytes()["main_grad"] for g in model.sharded_state.groups)
    moved = sum(not torch.equal(a, p.detach().to_local()) for a, p in zip(before, model.parameters()))
    return resident, moved, all(p.grad is None for p in model.parameters())


def test_backward_optimizer_steps_during_backward_and_frees_gradients():
    for resident, moved, no_grads in run_distributed(_backward_optimizer_frees_grads, 2):
        assert resident == 0 and no_grads
        assert moved > 0
