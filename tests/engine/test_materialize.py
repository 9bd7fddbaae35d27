"""Meta-device materialization: one module, one unit, and the RNG-order replay."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardwise.engine.materialize import MetaInitializer, has_meta_tensors, materialize_meta_module, materialize_owned_meta_modules
from shardwise.models import GPT, UNIT_MODULES, GPTConfig, TransformerLayer, init_weights

CPU = torch.device("cpu")


class Replacing(nn.Module):
    """reset_parameters replaces the Parameter object with setattr (Transformer Engine style)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3, 4))
        self.weight.partition_dim = 1

    def reset_parameters(self):
        self.weight = nn.Parameter(torch.arange(12.0, device=self.weight.device).view(3, 4))


class InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(5))
        self.weight.tensor_model_parallel = True
        self.frozen = nn.Parameter(torch.empty(2), requires_grad=False)
        self.register_buffer("table", torch.empty(3))
        self.child = nn.Linear(2, 2)

    def reset_parameters(self):
        with torch.no_grad():
            self.weight.fill_(2.0)
            self.frozen.fill_(-1.0)
            self.table.copy_(torch.tensor([1.0, 2.0, 3.0]))


class NoReset(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(2))


def test_replacing_reset_parameters_is_honoured():
    with torch.device("meta"):
        module = Replacing()
    materialize_meta_module(module, CPU)
    assert not module.weight.is_meta
    assert torch.equal(module.weight.detach(), torch.arange(12.0).view(3, 4))


def test_in_place_reset_keeps_attributes_requires_grad_and_children_alone():
    with torch.device("meta"):
        module = InPlace()
    materialize_meta_module(module, CPU)
    assert torch.equal(module.weight.detach(), torch.full((5,), 2.0))
    assert module.weight.tensor_model_parallel is True  # TP marks survive
    assert module.frozen.requires_grad is False and torch.equal(module.frozen.detach(), torch.full((2,), -1.0))
    assert torch.equal(module.table, torch.tensor([1.0, 2.0, 3.0]))
    assert module.child.weight.is_meta  # only the module's own tensors
    assert has_meta_tensors(module) and not has_meta_tensors(module, recurse=False)


def test_owned_modules_are_all_materialized():
    with torch.device("meta"):
        module = nn.Sequential(InPlace(), Replacing())
    materialize_owned_meta_modules(module, CPU)
    assert not has_meta_tensors(module)
    assert torch.equal(module[1].weight.detach(), torch.arange(12.0).view(3, 4))


def test_meta_module_without_reset_is_a_clear_error():
    with torch.device("meta"):
        module = nn.Sequential(NoReset())
    with pytest.raises(ValueError, match=r"NoReset holds \['weight'\] on the meta device but has no reset_parameters"):
        materialize_owned_meta_modules(module, CPU)
    assert module[0].weight.is_meta  # left untouched
    with pytest.raises(ValueError, match="NoReset"):
        MetaInitializer(module, CPU).plan()  # caught before any sharding starts


def test_tied_parameters_stay_tied():
    with torch.device("meta"):
        a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    b.weight = a.weight
    model = nn.Sequential(a, b)
    materialize_owned_meta_modules(model, CPU)
    assert model[0].weight is model[1].weight and not model[0].weight.is_meta


def _engine_order(model: nn.Module, unit_types) -> list[nn.Module]:
    """Units deepest first, then the root: the order fully_shard calls init_fn in."""
    depth = {id(m): n.count(".") + 1 for n, m in model.named_modules()}
    units = [m for m in model.modules() if isinstance(m, unit_types) and m is not model]
    return sorted(units, key=lambda m: -depth[id(m)]) + [model]


@pytest.mark.parametrize("replay", [True, False])
def test_replayed_rng_order_equals_a_direct_build(replay):
    config = GPTConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, layer_pattern="AEM", mamba_head_dim=8)
    torch.manual_seed(3)
    direct = GPT(config)
    after_direct = torch.rand(2)
    torch.manual_seed(3)
    with torch.device("meta"):
        model = GPT(config)
    init = MetaInitializer(model, CPU, replay_rng_order=replay)
    init.plan()
    for owner in _engine_order(model, UNIT_MODULES):
        init(owner, CPU)
    init.finish()
    assert not has_meta_tensors(model)
    assert list(model.state_dict()) == list(direct.state_dict())
    same = [torch.equal(p, q) for p, q in zip(model.state_dict().values(), direct.state_dict().values(), strict=True)]
    if replay:
        assert all(same) and torch.equal(torch.rand(2), after_direct)
    else:  # units first draws the numbers in another order
        assert not all(same)


def test_plan_leaves_the_model_on_meta_and_runs_replacing_resets_on_scratch():
    with torch.device("meta"):
        model = nn.Sequential(Replacing(), InPlace())
    meta_weight = model[0].weight
    init = MetaInitializer(model, CPU)
    init.plan()
    assert model[0].weight is meta_weight and has_meta_tensors(model)
    init(model, CPU)
    assert torch.equal(model[0].weight.detach(), torch.arange(12.0).view(3, 4))


def test_materialize_meta_module_is_a_no_op_off_meta():
    layer = TransformerLayer(GPTConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2))
    init_weights(layer)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    for m in layer.modules():
        materialize_meta_module(m, CPU)
    assert all(torch.equal(before[k], v) for k, v in layer.state_dict().items())
