"""What the engine holds and frees: only the placements' shards at rest, nothing gathered after an eval
forward, no reduction buffer past its step, nothing (and no global hook) after the model is dropped."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise

from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


def _memory_at_rest_and_during(strategy):
    world = dist.get_world_size()
    dev = device()
    config = TinyConfig(reuse_last_block=False)
    torch.manual_seed(0)
    model = shardwise.fully_shard(TinyLM(config), strategy=strategy, unit_modules=[Block])
    state = model.sharded_state
    units = state.units
    seen = {"after_forward": [], "during_backward": []}

    def storage(unit):
        return sum(g.unsharded.untyped_storage().nbytes() for g in unit.groups)

    def probe(i):
        def after_forward(module, args, output):
            seen["after_forward"].append(storage(units[i]))

            def in_backward(grad):
                # backward has finished with every later unit by now
                seen["during_backward"].append(sum(storage(u) for u in units[i + 1 :]))

            output.register_hook(in_backward)

        return after_forward

    for i, unit in enumerate(units):
        unit.module.register_forward_hook(probe(i))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = (t.to(dev) for t in batch(0, world, config))
    model(tokens[dist.get_rank() :][:1], targets[dist.get_rank() :][:1]).backward()
    opt.step()
    report = {"groups": []}
    for g in state.groups:
        main_grad = g.window.kept_main_grad()
        report["groups"].append(
            dict(
                opt_total=g.layouts[-1].total,
                full_total=g.layouts[0].total,
                trainable=g.requires_grad,
                unsharded=g.storage_bytes_unsharded // 4 if not g.persistent_unsharded else None,
                model=g.model_shard.numel(),
                main_alias=g.main_aliases_model,
                main_grad=None if main_grad is None else main_grad.untyped_storage().nbytes() // 4,
                grad_acc=g.grad_acc,
            )
        )
    opt.zero_grad()  # dropping the .grad DTensors frees the gradient buffers
    report["grads_after_zero_grad"] = sum(g.resident_bytes()["main_grad"] for g in state.groups)
    report.update(seen)
    return report


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim_grads", "optim", "no_shard"])
def test_memory_at_rest_holds_only_the_placements_shards(strategy):
    world = 4
    reports = run_distributed(_memory_at_rest_and_during, world, strategy)
    sharded_params = strategy == "optim_grads_params"
    for report in reports:
        for g in report["groups"]:
            total, opt_total = g["full_total"], g["opt_total"]
            if strategy != "no_shard":  # a 1/world piece of every parameter (+ row and alignment padding)
                assert opt_total < total // world + 32 * 8
            assert g["main_alias"]  # fp32: the main weights are the model weights, one copy
            assert g["model"] == (opt_total if sharded_params else total)
            if sharded_params:
                assert g["unsharded"] == 0, "unsharded storage must be freed at rest"
            # ZeRO-1's full Partial accumulation buffer lives only inside a step's backward
            assert g["grad_acc"] is None
            if g["trainable"]:
                opt_shard = total if strategy == "no_shard" else opt_total
                assert g["main_grad"] == opt_shard, "gradients are held in the optimizer placement"
            else:
                assert g["main_grad"] is None  # frozen groups never allocate gradients
        assert report["grads_after_zero_grad"] == 0
        if sharded_params:
            assert report["after_forward"] == [0, 0, 0], "a unit must free its weights after forward"
            assert report["during_backward"] == [0, 0, 0][: len(report["during_backward"])]
            assert len(report["during_backward"]) == 3


def _no_grad_forward_frees_everything():
    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    torch.manual_seed(0)
    model = shardwise.fully_shard(TinyLM(config), unit_modules=[Block])
    tokens, targets = (t.to(device()) for t in batch(0, world, config))
    with torch.no_grad():
        loss = model(tokens[rank : rank + 1], targets[rank : rank + 1])
    assert all(g.storage_bytes_unsharded == 0 for g in model.sharded_state.groups)
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
    return loss.item()


def test_eval_forward_without_grad_frees_all_units():
    run_distributed(_no_grad_forward_frees_everything, 2)


def _buffers_held_after_step(strategy: str, offload: bool):
    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    model = shardwise.fully_shard(
        TinyLM(config).to(device()), strategy=strategy, unit_modules=[Block],
        offload_policy=shardwise.OffloadPolicy(fraction=1.0) if offload else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = (t.to(device()) for t in batch(0, world, config))
    model(tokens[rank : rank + 1], targets[rank : rank + 1]).backward()
    opt.step()
    opt.zero_grad()
    # Buffers a reduction read (ZeRO-1's accumulation buffer, an offloaded group's device grads)
    # belong to its in-flight record only: once that is waited on, nothing may keep them.
    return sum(len(g.window.released) for g in model.sharded_state.groups)


@pytest.mark.parametrize("strategy,offload", [("optim", False), ("optim_grads_params", True)])
def test_no_reduction_buffer_outlives_its_step(strategy, offload):
    assert run_distributed(_buffers_held_after_step, 2, strategy, offload) == [0, 0]


def _freed_when_dropped():
    import gc
    import weakref

    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

    world, rank = dist.get_world_size(), dist.get_rank()
    config = TinyConfig()
    model = shardwise.fully_shard(TinyLM(config), unit_modules=[Block])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens, targets = (t.to(device()) for t in batch(0, world, config))
    model(tokens[rank : rank + 1], targets[rank : rank + 1]).backward()
    opt.step()
    state = weakref.ref(model.sharded_state)
    group = weakref.ref(model.sharded_state.groups[0])
    del model, opt
    gc.collect()
    shardwise.fully_shard(TinyLM(config), unit_modules=[Block])  # a second model: no second hook
    return state() is None and group() is None, len(_global_optimizer_post_hooks), len(_global_optimizer_pre_hooks)


def test_a_dropped_model_is_freed_and_no_global_hooks_are_installed():
    for freed, post_hooks, pre_hooks in run_distributed(_freed_when_dropped, 2):
        assert freed, "the sharded state outlived its model"
        assert post_hooks == 0, "importing shardwise must not hook every optimizer in the process"
        # per process, however many models: replaced_params' (an optimizer built before fully_shard) and
        # step_checks' (the misuses FSDP2 trains through, issue 59)
        assert pre_hooks == 2, "two step pre-hooks per process, none per model"
