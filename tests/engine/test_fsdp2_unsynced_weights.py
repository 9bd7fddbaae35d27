"""Weights FSDP2 shards as each rank holds them: trained as FSDP2 trains them, and named once at the first
forward when nothing has written them (``weight_origin``); and the smaller FSDP2 behaviours around loading,
``fully_shard.state`` and torch's own walks over a model holding shardwise units.

Each case runs torch's FSDP2 and shardwise with the same code in the same test and compares (fp32: rtol 1e-5).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_managed_modules
from torch.distributed.tensor import distribute_tensor

import shardwise
from shardwise.engine.weight_origin import UnwrittenWeightsWarning
from tests.helpers.distributed import device, run_distributed

RTOL = 1e-5


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _wrap(which: str, model: nn.Module, **kwargs) -> None:
    """FSDP2's idiom: a unit, then the root (shardwise's extra keywords only for shardwise)."""
    fully_shard = torch_fully_shard if which == "fsdp2" else shardwise.fully_shard
    kwargs = kwargs if which == "shardwise" else {}
    fully_shard(model.a, **kwargs)
    fully_shard(model, **kwargs)


def _reference() -> dict:
    """The weights every rank loads: a seed-0 build's, as full tensors."""
    torch.manual_seed(0)
    return {k: v.detach().to(device()) for k, v in _Net().state_dict().items()}


def _load(model: nn.Module, how: str, path: str) -> None:
    full = _reference()
    if how == "load_state_dict":
        model.load_state_dict({k: distribute_tensor(full[k], v.device_mesh, v.placements)
                               for k, v in model.state_dict().items()})
    elif how == "set_model_state_dict":
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
    elif how == "dcp":  # writes no version counter: the sums say it was written
        dcp.save(full, checkpoint_id=path)
        dcp.load(model.state_dict(), checkpoint_id=path)
    elif how == "to_local":  # writes into the local rows, no DTensor op
        with torch.no_grad():
            for k, v in model.state_dict().items():
                v.to_local().copy_(distribute_tensor(full[k], v.device_mesh, v.placements).to_local())
    else:
        assert how is None, how


def _train(model: nn.Module, steps: int = 2) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x = torch.arange(8.0, device=device()).view(2, 4) / (8 + step + dist.get_rank())
        loss = model(x).square().sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}}


def _caught(fn) -> tuple[dict, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in caught if issubclass(w.category, UnwrittenWeightsWarning)]


def _per_rank_weights(which: str, load, path: str, **kwargs) -> dict:
    torch.manual_seed(1 + dist.get_rank())  # another model on every rank (none the reference), as torch's tests
    model = _Net().to(device())
    _wrap(which, model, **kwargs)
    _load(model, load, path)
    try:
        out, said = _caught(lambda: _train(model))
    except RuntimeError as e:
        return {"error": str(e)}
    return dict(out, warnings=said)


def _assert_same(theirs: dict, ours: dict) -> None:
    torch.testing.assert_close(torch.tensor(ours["losses"]), torch.tensor(theirs["losses"]), rtol=RTOL, atol=0)
    for name in theirs["params"]:
        torch.testing.assert_close(ours["params"][name], theirs["params"][name], rtol=RTOL, atol=1e-7, msg=name)


# ------------------------------------------------------------------ weights that differ at wrap time
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("load", ["load_state_dict", "set_model_state_dict", "dcp", "to_local"])
def test_weights_that_differ_at_wrap_and_are_loaded_after_train_as_fsdp2(world, load, tmp_path):
    """A per-rank init then a checkpoint load after wrapping: accepted, the same training as FSDP2's, and
    nothing said (the load wrote every weight)."""
    theirs = run_distributed(_per_rank_weights, world, "fsdp2", load, str(tmp_path / "fsdp2"))
    ours = run_distributed(_per_rank_weights, world, "shardwise", load, str(tmp_path / "shardwise"))
    for t, o in zip(theirs, ours):
        _assert_same(t, o)
        assert o["warnings"] == [], o["warnings"]


def test_weights_that_differ_and_are_never_written_are_named_once_at_the_first_forward(tmp_path):
    """FSDP2 trains a row-mix of the ranks' models silently; shardwise trains the same numbers and says so once
    per process, naming the first parameter and the fix; ``"raise"`` refuses on every rank, ``"off"`` is
    FSDP2's silence."""
    theirs = run_distributed(_per_rank_weights, 2, "fsdp2", None, "")
    for mode in ("warn", "off"):
        ours = run_distributed(_per_rank_weights, 2, "shardwise", None, "", check_module_states=mode)
        for t, o in zip(theirs, ours):
            _assert_same(t, o)
            if mode == "off":
                assert o["warnings"] == []
                continue
            assert len(o["warnings"]) == 1, o["warnings"]
            said = o["warnings"][0]
            assert said.startswith("shardwise: parameter 'a.weight' (and 5 more) held other values on other "
                                   "data-parallel ranks") and "\n" not in said, said
            assert "sync_module_states=True" in said and "load the same weights on every rank" in said
    strict = run_distributed(_per_rank_weights, 2, "shardwise", None, "", check_module_states="raise")
    for r in strict:
        assert r["error"].startswith("check_module_states='raise': parameter 'a.weight' (and 5 more) held other "
                                     "values on other data-parallel ranks"), r


def _one_rank_loads_after_a_strict_wrap() -> str | None:
    torch.manual_seed(dist.get_rank())
    model = _Net().to(device())
    _wrap("shardwise", model, check_module_states="raise")
    if dist.get_rank() == 0:  # rank 1's weights were never written: both ranks stop, neither waits
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    try:
        model(torch.ones(2, 4, device=device()))
    except RuntimeError as e:
        return str(e)
    return None


def test_strict_mode_stops_every_rank_when_one_rank_finds_unwritten_weights():
    first, second = run_distributed(_one_rank_loads_after_a_strict_wrap, 2)
    assert first.startswith("check_module_states='raise': another rank of the mesh holds parameters"), first
    assert second.startswith("check_module_states='raise': parameter 'a.weight'"), second


def test_check_module_states_takes_the_modes_and_booleans_only():
    with pytest.raises(ValueError, match=r"check_module_states='loud' must be 'warn' \(the default"):
        shardwise.fully_shard(_Net(), check_module_states="loud")


# ------------------------------------------------------------------ to_empty without initialisation
def _meta_to_empty(which: str, init: bool) -> dict:
    with torch.device("meta"):
        model = _Net()
    _wrap(which, model)
    model.to_empty(device=device())
    if init:
        torch.manual_seed(0)
        with torch.no_grad():
            for m in (model.a, model.b, model.c):
                m.reset_parameters()
    out, said = _caught(lambda: _train(model, steps=1))
    return dict(out, warnings=said)


@pytest.mark.parametrize("world", [1, 2])
def test_to_empty_without_initialisation_is_named_at_the_first_forward(world):
    """FSDP2 trains on the uninitialised memory silently; shardwise runs the same step and says so once. With
    the model's own init after ``to_empty`` both train the same numbers and nothing is said."""
    theirs = run_distributed(_meta_to_empty, world, "fsdp2", False)
    ours = run_distributed(_meta_to_empty, world, "shardwise", False)
    for t, o in zip(theirs, ours):
        assert len(t["losses"]) == len(o["losses"]) == 1  # both ran the step
        assert len(o["warnings"]) == 1, o["warnings"]
        said = o["warnings"][0]
        assert said.startswith("shardwise: parameter 'a.weight' (and 5 more) was given storage by to_empty() and "
                               "nothing has written it since"), said
        assert "init_weights() / reset_parameters()" in said and "load a checkpoint" in said
    theirs = run_distributed(_meta_to_empty, world, "fsdp2", True)
    ours = run_distributed(_meta_to_empty, world, "shardwise", True)
    for t, o in zip(theirs, ours):
        _assert_same(t, o)
        assert o["warnings"] == []


# ------------------------------------------------------------------ load_state_dict after a forward
def _load_after_a_forward(which: str) -> dict:
    torch.manual_seed(0)
    model = _Net().to(device())
    _wrap(which, model)
    x = torch.ones(2, 4, device=device())
    model(x)  # grad enabled, no backward: the root keeps its gathered weights
    model.load_state_dict({k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()})
    after = model(x).detach().cpu()
    return {"after": after}


@pytest.mark.parametrize("world", [1, 2])
def test_load_state_dict_after_a_forward_without_backward_is_what_the_next_forward_reads(world):
    theirs = run_distributed(_load_after_a_forward, world, "fsdp2")
    ours = run_distributed(_load_after_a_forward, world, "shardwise")
    for t, o in zip(theirs, ours):
        torch.testing.assert_close(o["after"], t["after"], rtol=RTOL, atol=0)
    expected = torch.full((2, 2), 1.75)  # every weight 0.25: 1.25, 1.5, then 1.75
    torch.testing.assert_close(ours[0]["after"], expected, rtol=RTOL, atol=0)


# ------------------------------------------------------------------ torch's own reads of the units
def _state_reads(which: str) -> dict:
    torch.manual_seed(0)
    model = _Net().to(device())
    _wrap(which, model)
    state = torch_fully_shard.state if which == "fsdp2" else shardwise.fully_shard.state
    found = {name: state(m) for name, m in model.named_modules()}
    state(model)._lazy_init()  # what torch's pipeline stage and tests read is set up by the root's lazy init
    names = {id(s): name for name, s in found.items() if s is not None}
    return {"has": {name: s is not None for name, s in found.items()},
            "groups": {name: len(s._fsdp_param_groups) for name, s in found.items() if s is not None},
            "is_root": {name: s._is_root for name, s in found.items() if s is not None},
            "all_states": [names[id(s)] for s in state(model)._state_ctx.all_states],
            "same_as_torchs": all(s is torch_fully_shard.state(m) for (_, s), m in zip(found.items(), model.modules()))}


@pytest.mark.parametrize("world", [1, 2])
def test_fully_shard_state_answers_as_torchs(world):
    theirs = run_distributed(_state_reads, world, "fsdp2")[0]
    ours = run_distributed(_state_reads, world, "shardwise")[0]
    assert ours["has"] == theirs["has"] == {"": True, "a": True, "b": False, "c": False}
    assert ours["groups"] == theirs["groups"]
    assert ours["is_root"] == theirs["is_root"] == {"": True, "a": False}
    assert ours["all_states"] == theirs["all_states"] == ["", "a"]
    assert ours["same_as_torchs"] and theirs["same_as_torchs"]


def _torch_root_over_units(inner: str) -> dict:
    """torch's ``fully_shard`` on the root of a model whose ``a`` and ``b`` are units of ``inner``."""
    torch.manual_seed(0)
    model = _Net().to(device())
    fully_shard = torch_fully_shard if inner == "fsdp2" else shardwise.fully_shard
    fully_shard(model.a)
    fully_shard(model.b)
    names = {id(m): n for n, m in model.named_modules()}
    managed = [names[id(m)] for m in _get_managed_modules((model,))]
    torch_fully_shard(model)
    out = _train(model, steps=3)
    out["managed"] = managed
    out["units"] = [isinstance(m, FSDPModule) for m in (model, model.a, model.b, model.c)]
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_torch_fully_shard_over_shardwise_units_leaves_them_to_shardwise(world):
    """torch's own walk (``_get_managed_modules``) stops at a shardwise unit as at an FSDP2 one, so a torch
    root over shardwise units manages only the rest and trains as the all-FSDP2 model."""
    theirs = run_distributed(_torch_root_over_units, world, "fsdp2")
    ours = run_distributed(_torch_root_over_units, world, "shardwise")
    for t, o in zip(theirs, ours):
        assert o["managed"] == t["managed"] == ["c", ""]
        assert o["units"] == t["units"] == [True, True, True, False]
        _assert_same(t, o)


# ------------------------------------------------------------------ a parameter tied across two calls
def _tied_across_calls(which: str) -> tuple[str, str]:
    fully_shard = torch_fully_shard if which == "fsdp2" else shardwise.fully_shard
    torch.manual_seed(0)
    model = _Net().to(device())
    model.b.weight = model.a.weight  # one tensor, held by two units
    step = "wrap"
    try:
        fully_shard(model.a)
        fully_shard(model.b)
        fully_shard(model)
        step = "forward"
        model(torch.ones(2, 4, device=device()))
    except ValueError as e:
        return step, str(e)
    return "accepted", ""


@pytest.mark.parametrize("world", [1, 2])
def test_a_parameter_tied_across_two_calls_is_refused_earlier_than_fsdp2_refuses_it(world):
    """FSDP2 refuses it at the first forward; shardwise at the second call, naming it (kept: the same program
    is refused, before any weight moves)."""
    theirs = run_distributed(_tied_across_calls, world, "fsdp2")[0]
    ours = run_distributed(_tied_across_calls, world, "shardwise")[0]
    assert theirs[0] == "forward" and "is shared with a parameter already managed" in theirs[1], theirs
    assert ours[0] == "wrap" and ours[1].startswith(
        "parameter 'weight' is tied to a parameter that an earlier fully_shard call already sharded"), ours
    assert "fully_shard([a, b])" in ours[1]
