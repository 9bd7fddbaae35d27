"""The collectives a step issues: what the placements dictate per axis, all of them through the injected
``Collectives``, none over an axis of one rank."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

import shardwise

from tests.helpers.counting import CountingCollectives
from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


def _count_step_collectives(strategy, outer, micro_batches):
    """Collectives issued by one steady-state step (refresh + micro-batches), per (kind, axis).

    A gather or reduce-scatter of a group is one coalesced launch of per-parameter
    collectives (one NCCL group call), counted once; all-reduces are flat.
    """
    import shardwise.engine.collectives as buffers_module

    world, rank = dist.get_world_size(), dist.get_rank()
    dev = device()
    config = TinyConfig(reuse_last_block=False)
    torch.manual_seed(0)
    mesh = shardwise.build_dp_mesh(outer=2) if outer else shardwise.build_dp_mesh()
    model = shardwise.fully_shard(
        TinyLM(config), mesh, strategy=strategy, outer_dp_sharding_strategy=outer, unit_modules=[Block]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    axis_of = {id(mesh.get_group(n)): n for n in mesh.mesh_dim_names}
    counts: Counter = Counter()
    counting = [False]
    originals = {}
    for module, name, kind in (
        (buffers_module, "gather_pieces", "all_gather"),
        (buffers_module, "reduce_scatter_pieces", "reduce_scatter"),
        (dist, "all_reduce", "all_reduce"),
    ):
        fn = getattr(module, name)
        originals[(module, name)] = fn

        def wrapper(*args, _fn=fn, _kind=kind, **kwargs):
            if counting[0]:
                if _kind == "all_reduce":
                    axis = axis_of.get(id(kwargs.get("group")), "other")
                else:
                    axis = args[2].name
                counts[(_kind, axis)] += 1
            return _fn(*args, **kwargs)

        setattr(module, name, wrapper)
    try:
        for step in range(2):
            tokens, targets = (t.to(dev) for t in batch(step, 4 * world, config))
            counting[0] = step == 1
            for i in range(micro_batches):
                part = slice(rank * 4 + i, rank * 4 + i + 1)
                if i < micro_batches - 1:
                    with model.no_sync():
                        model(tokens[part], targets[part]).backward()
                else:
                    model(tokens[part], targets[part]).backward()
            counting[0] = False
            opt.step()
            opt.zero_grad()
    finally:
        for (module, name), fn in originals.items():
            setattr(module, name, fn)
    return dict(counts)


# 3 block units (one trainable group each) + the root (a trainable and a frozen group):
# 4 trainable groups, 5 groups. M = 4 micro-batches.
M, TRAINABLE, UNIT_GATHERS = 4, 4, 3 * 2 + 2  # each block twice (forward, backward), root groups once
EXPECTED = {
    # ZeRO-3: every micro-batch gathers each unit twice and reduce-scatters each trainable group once.
    ("optim_grads_params", None): {("all_gather", "dp_shard"): M * UNIT_GATHERS, ("reduce_scatter", "dp_shard"): M * TRAINABLE},
    # ZeRO-2: grads reduce-scattered every micro-batch; weights refreshed by one gather per step.
    ("optim_grads", None): {("all_gather", "dp_shard"): TRAINABLE, ("reduce_scatter", "dp_shard"): M * TRAINABLE},
    # ZeRO-1: grads stay Partial inside no_sync: one reduce-scatter per group per step.
    ("optim", None): {("all_gather", "dp_shard"): TRAINABLE, ("reduce_scatter", "dp_shard"): TRAINABLE},
    # ZeRO-0 (DDP): one all-reduce per group per step.
    ("no_shard", None): {("all_reduce", "dp_shard"): TRAINABLE},
    # HSDP: inner ZeRO-3 every micro-batch, outer axis all-reduced once per step.
    ("optim_grads_params", "no_shard"): {
        ("all_gather", "dp_shard"): M * UNIT_GATHERS,
        ("reduce_scatter", "dp_shard"): M * TRAINABLE,
        ("all_reduce", "dp_outer"): TRAINABLE,
    },
    # HFSDP: the outer axis is reduce-scattered once per step and gathered once to refresh.
    ("optim_grads_params", "optim"): {
        ("all_gather", "dp_shard"): M * UNIT_GATHERS,
        ("reduce_scatter", "dp_shard"): M * TRAINABLE,
        ("reduce_scatter", "dp_outer"): TRAINABLE,
        ("all_gather", "dp_outer"): TRAINABLE,
    },
}


@pytest.mark.slow
@pytest.mark.parametrize("strategy,outer", list(EXPECTED))
def test_collectives_per_step_are_what_the_placements_dictate(strategy, outer):
    counts = run_distributed(_count_step_collectives, 4, strategy, outer, M)
    for rank_counts in counts:
        assert rank_counts == EXPECTED[(strategy, outer)]


def _with_collectives(collectives):
    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    torch.manual_seed(0)
    mesh = shardwise.build_dp_mesh(outer=min(2, world))
    model = shardwise.fully_shard(TinyLM(config).to(device()), mesh=mesh,
                                  strategy="optim_grads_params", outer_dp_sharding_strategy="no_shard",
                                  unit_modules=[Block], collectives=collectives)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        tokens, targets = (t.to(device()) for t in batch(step, world, config))
        loss = model(tokens[rank : rank + 1], targets[rank : rank + 1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, dict(collectives.calls) if collectives is not None else None


def _both_collectives():
    return _with_collectives(None), _with_collectives(CountingCollectives())


@pytest.mark.slow
def test_injected_collectives_carry_every_transition():
    for (losses, _), (counted_losses, calls) in run_distributed(_both_collectives, 4):
        assert counted_losses == losses  # the same collectives, only counted
        assert calls["gather"] > 0 and calls["reduce_scatter"] > 0 and calls["all_reduce"] > 0, calls


def _counted():
    return _with_collectives(CountingCollectives())[1]


def test_axes_of_one_rank_issue_no_collectives():
    # world 1: a (1, 1) mesh splits nothing; world 2: a (2, 1) mesh, only the outer replicas' all-reduce
    assert run_distributed(_counted, 1) == [{}]
    for calls in run_distributed(_counted, 2):
        assert "gather" not in calls and "reduce_scatter" not in calls and calls["all_reduce"] > 0, calls
