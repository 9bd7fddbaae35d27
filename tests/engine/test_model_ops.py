"""``shardwise.engine.model_ops``, the faces' door to a wrapped model: each function does what the faces rely on
(2 gloo processes), and the registry and default ``plan_fn`` the faces read. ``tests/test_layering.py`` holds
the faces to this door."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardwise
from shardwise.engine.model_ops import (add_grad_alias, broadcast_from_first_replica, compute_parameters, install_grads,
                                        is_sharded, load_full_state_dict, parameter_groups, refresh_model_weights,
                                        set_grad_attribute, sharded_state, sharding_plan, wait_for_reductions)
from shardwise.engine.mesh import DENSE, EXPERT, experts_by_mark
from shardwise.engine.registry import EXPERTS, LAYER, module_types, register_module_type

from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


# ------------------------------------------------------------ without processes
def test_sharded_state_names_a_model_that_is_not_wrapped():
    model = nn.Linear(2, 2)
    assert not is_sharded(model)
    with pytest.raises(ValueError, match="Linear is not sharded by shardwise.fully_shard"):
        sharded_state(model)
    with pytest.raises(ValueError, match="Linear is not sharded"):
        wait_for_reductions(model)


def test_models_register_their_layers_and_experts():
    from shardwise.models import UNIT_MODULES, Experts

    assert module_types(LAYER)[: len(UNIT_MODULES)] == UNIT_MODULES
    assert Experts in module_types(EXPERTS)
    with pytest.raises(ValueError, match="not one of"):
        module_types("unit")
    with pytest.raises(TypeError, match="needs a class"):
        register_module_type(LAYER, Block(TinyConfig()))


def test_default_plan_fn_reads_the_mark_not_the_name():
    marked, plain = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    marked.allreduce = False
    assert experts_by_mark("anything", marked) == EXPERT
    assert experts_by_mark("layers.0.mlp.experts.w1", plain) == DENSE


# ------------------------------------------------------------ on 2 gloo ranks
def _api_on_two_ranks():
    dev, config = device(), TinyConfig()
    torch.manual_seed(dist.get_rank())  # every rank initializes its own weights
    model = shardwise.fully_shard(TinyLM(config).to(dev), strategy="no_shard", unit_modules=[Block],
                                  check_module_states=False)  # synced below, by broadcast_from_first_replica
    assert is_sharded(model) and sharded_state(model) is model.sharded_state
    try:
        broadcast_from_first_replica(model, axes=["dp_outer"])
        unknown = None
    except ValueError as exc:
        unknown = str(exc)
    broadcast_from_first_replica(model, axes=["dp_shard"])
    weights = {n: p.to_local().detach().cpu().clone() for n, p in model.named_parameters()}

    tokens, targets = (t.to(dev) for t in batch(0, 4, config))
    model(tokens, targets).backward()
    wait_for_reductions(model)  # nothing left in flight: returns at once
    install_grads(model)  # already installed: changes nothing
    grads = all(p.grad is not None for p in model.parameters() if p.requires_grad)
    refresh_model_weights(model)

    with torch.no_grad():
        before = model(tokens, targets).item()
        full = shardwise.full_state_dict(model)
        for p in model.parameters():
            p.to_local().zero_()
        load_full_state_dict(model, full)
        after = model(tokens, targets).item()
    again = shardwise.full_state_dict(model)
    same = all(torch.equal(full[k], again[k]) for k in full)

    plan = sharding_plan(model)
    described = (plan is sharded_state(model).plan, list(plan.placements), plan.mesh.mesh_dim_names)
    groups = parameter_groups(model)
    listed = [id(p) for params, _ in groups for p in params]
    once = sorted(listed) == sorted(id(p) for p in model.parameters()) and {d for _, d in groups} == {torch.float32}

    model.zero_grad_buffer()
    model(tokens, targets).backward()
    plain = {n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad_buffer()
    set_grad_attribute(model, "decoupled_grad")
    add_grad_alias(model, "main_grad")
    for param in compute_parameters(model):
        param.main_grad = torch.zeros(1)  # what Megatron's fused wgrad kernels keep: dropped with .grad
    model(tokens, targets).backward()
    decoupled = {n: p.decoupled_grad.to_local() for n, p in model.named_parameters()
                 if getattr(p, "decoupled_grad", None) is not None}
    moved = (all(p.grad is None for p in model.parameters()), decoupled.keys() == plain.keys(),
             all(torch.equal(plain[n], decoupled[n]) for n in plain),
             all(getattr(p, "main_grad", None) is None for p in compute_parameters(model)))
    return unknown, weights, grads, before, after, same, described, once, moved


def test_model_ops_on_two_ranks():
    results = run_distributed(_api_on_two_ranks, 2)
    (unknown, weights, grads, before, after, same, described, once, moved), (_, weights1, *_) = results
    assert "axes ['dp_outer'] are not data-parallel axes" in unknown and "dp_shard" in unknown
    assert all(torch.equal(weights[n], weights1[n]) for n in weights)  # rank 1 now holds rank 0's weights
    assert grads and same and before == after
    assert described == (True, ["dp_shard"], ("dp_shard",)) and once
    assert moved == (True, True, True, True)  # fp32 grads: the decoupled ones are the plain ones, bit for bit


def test_grad_attribute_names_are_checked_first():
    with pytest.raises(ValueError, match="set_grad_attribute: name='decoupled grad' is not an attribute name"):
        set_grad_attribute(nn.Linear(2, 2), "decoupled grad")
    with pytest.raises(ValueError, match="add_grad_alias: name='grad' is not an attribute name other than 'grad'"):
        add_grad_alias(nn.Linear(2, 2), "grad")
    with pytest.raises(ValueError, match="Linear is not sharded"):
        add_grad_alias(nn.Linear(2, 2), "main_grad")
