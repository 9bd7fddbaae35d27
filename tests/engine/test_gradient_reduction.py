"""How gradients reduce: ``no_sync`` micro-batches equal one large batch; ``bucket_size``,
``gradient_reduction="sum"`` and ``zero_grad_buffer`` change nothing else."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise

from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import STRATEGY_MESHES, Run, assert_parity
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


@pytest.mark.parametrize("world,strategy,outer", STRATEGY_MESHES)
def test_no_sync_over_four_micro_batches_equals_one_large_batch(world, strategy, outer):
    run_distributed(assert_parity, world, Run(strategy=strategy, outer=outer, micro_batches=4, global_batch=16))


def _grads_with(bucket_size, reduction, discard_first):
    """Full gradients after one backward (optionally after a discarded no_sync micro-batch)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    torch.manual_seed(0)
    model = shardwise.fully_shard(
        TinyLM(config), unit_modules=[Block], bucket_size=bucket_size, gradient_reduction=reduction
    )
    tokens, targets = (t.to(device()) for t in batch(0, 2 * world, config))
    mine = slice(2 * rank, 2 * rank + 2)
    if discard_first:
        with model.no_sync():
            model(tokens[mine].flip(0), targets[mine]).backward()
        model.zero_grad_buffer()
    model(tokens[mine], targets[mine]).backward()
    root_groups = len(model.sharded_state.root.groups)
    grads = {}
    for group in model.sharded_state.groups:
        for fqn, p in zip(group.fqns, group.sharded_params):
            if p.grad is not None:
                grads[fqn] = p.grad.full_tensor().cpu()
    return root_groups, grads


def test_bucket_size_sum_reduction_and_zero_grad_buffer():
    world = 2
    base_groups, base = run_distributed(_grads_with, world, None, "mean", False)[0]
    bucket_groups, bucketed = run_distributed(_grads_with, world, 40, "mean", False)[0]
    assert bucket_groups > base_groups  # the root's own parameters were split into buckets
    _, summed = run_distributed(_grads_with, world, None, "sum", False)[0]
    _, discarded = run_distributed(_grads_with, world, None, "mean", True)[0]
    for name, grad in base.items():
        torch.testing.assert_close(bucketed[name], grad, rtol=1e-6, atol=0)
        torch.testing.assert_close(summed[name], grad * world, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(discarded[name], grad, rtol=1e-6, atol=0)
