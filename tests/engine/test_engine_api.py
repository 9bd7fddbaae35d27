"""The engine's public API for the faces (issue 16, item 2), and the import rules that keep the faces on it.

- no underscore name is imported across a package boundary inside ``shardwise/``;
- ``shardwise.megatron`` does not import ``shardwise.models`` (unit types come from the registry);
- only ``sharded_state`` reads the engine's state attribute;
- the API functions do what the faces rely on (2 gloo processes).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardwise
from shardwise.engine.model_ops import (broadcast_from_first_replica, install_grads, is_sharded, load_full_state_dict,
                                        refresh_model_weights, sharded_state, wait_for_reductions)
from shardwise.engine.mesh import DENSE, EXPERT, experts_by_mark
from shardwise.engine.registry import EXPERTS, LAYER, module_types, register_module_type

from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch

PACKAGE = Path(shardwise.__file__).parent


def _imports():
    """``(file, line, importing package, imported module, names)`` for every ``from ... import`` of shardwise."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = ("shardwise",) + path.relative_to(PACKAGE).with_suffix("").parts
        package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    target = ".".join(base + ((node.module,) if node.module else ()))
                else:
                    target = node.module or ""
                if target == "shardwise" or target.startswith("shardwise."):
                    yield path, node.lineno, ".".join(package), target, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("shardwise"):
                        yield path, node.lineno, ".".join(package), alias.name, []


def _package_of(module: str) -> str:
    """The package a module name lives in (a package is its own)."""
    path = PACKAGE.parent / module.replace(".", "/")
    return module if path.is_dir() else module.rsplit(".", 1)[0]


def test_scan_sees_relative_imports():
    found = {(str(p.relative_to(PACKAGE)), target) for p, _, _, target, _ in _imports()}
    assert ("megatron/v1.py", "shardwise.megatron.base") in found
    assert ("megatron/base.py", "shardwise.engine.model_ops") in found
    assert ("checkpoint/full.py", "shardwise.engine.model_ops") in found


def test_no_underscore_name_crosses_a_package_boundary():
    crossing = []
    for path, line, package, target, names in _imports():
        if _package_of(target) == package:
            continue
        private = [n for n in names if n.startswith("_")]
        if private or any(part.startswith("_") and part != "__init__" for part in target.split(".")):
            crossing.append(f"{path.relative_to(PACKAGE.parent)}:{line}: from {target} import {', '.join(names)}")
    assert not crossing, "\n".join(crossing)


def test_megatron_does_not_import_models():
    found = [f"{p.relative_to(PACKAGE.parent)}:{line}: {target}" for p, line, package, target, _ in _imports()
             if package.startswith("shardwise.megatron") and (target == "shardwise.models" or target.startswith("shardwise.models."))]
    assert not found, found


def test_only_the_accessor_reads_the_engine_state_attribute():
    from shardwise.engine.sharded_module import STATE_ATTR

    readers = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if STATE_ATTR in p.read_text()]
    assert readers == ["engine/sharded_module.py"], readers


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
    return unknown, weights, grads, before, after, same


def test_engine_api_on_two_ranks():
    (unknown, weights, grads, before, after, same), (_, weights1, *_) = run_distributed(_api_on_two_ranks, 2)
    assert "axes ['dp_outer'] are not data-parallel axes" in unknown and "dp_shard" in unknown
    assert all(torch.equal(weights[n], weights1[n]) for n in weights)  # rank 1 now holds rank 0's weights
    assert grads and same and before == after
