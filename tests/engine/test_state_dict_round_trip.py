"""``model.state_dict()`` / ``load_state_dict`` and the optimizer's, through a fresh model: training goes on
exactly (4 gloo processes)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import shardwise

from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


def _state_dict_round_trip(strategy, outer):
    world, rank = dist.get_world_size(), dist.get_rank()
    dev = device()
    config = TinyConfig()

    def build():
        torch.manual_seed(0)
        mesh = shardwise.build_dp_mesh(outer=2) if outer else None
        model = shardwise.fully_shard(
            TinyLM(config), mesh, strategy=strategy, outer_dp_sharding_strategy=outer, unit_modules=[Block]
        )
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def step(model, opt, i):
        tokens, targets = (t.to(dev) for t in batch(i, 2 * world, config))
        loss = model(tokens[2 * rank : 2 * rank + 2], targets[2 * rank : 2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    model, opt = build()
    for i in range(2):
        step(model, opt, i)
    model_sd = {k: v.clone() for k, v in model.state_dict().items()}  # DTensor clones keep the layout
    opt_sd = copy.deepcopy(opt.state_dict())
    expected = [step(model, opt, i) for i in range(2, 4)]

    fresh, fresh_opt = build()
    fresh.load_state_dict(model_sd)
    fresh_opt.load_state_dict(opt_sd)
    got = [step(fresh, fresh_opt, i) for i in range(2, 4)]
    assert got == expected, (got, expected)
    assert all(isinstance(v, torch.distributed.tensor.DTensor) for k, v in model_sd.items())


@pytest.mark.slow
@pytest.mark.parametrize("strategy,outer", [("optim_grads_params", None), ("optim", None), ("optim_grads_params", "optim")])
def test_state_dict_round_trip_same_world_size(strategy, outer):
    run_distributed(_state_dict_round_trip, 4, strategy, outer)
