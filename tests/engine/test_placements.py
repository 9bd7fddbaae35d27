"""``shardwise.engine.placements``: the strategy table (ZeRO 0-3, HSDP, HFSDP), its aliases and what it refuses."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from shardwise.engine.placements import (
    OUTER_STRATEGY_PLACEMENTS,
    STRATEGY_PLACEMENTS,
    AxisPlacements,
    describe,
    normalize_placements,
    resolve_strategy,
    strategy_placements,
    validate_axis_placements,
)

R, S, P = Replicate(), Shard(0), Partial("avg")


def test_strategy_table_is_zero_0_to_3():
    assert STRATEGY_PLACEMENTS == {
        "no_shard": AxisPlacements(R, P, R),
        "optim": AxisPlacements(R, P, S),
        "optim_grads": AxisPlacements(R, S, S),
        "optim_grads_params": AxisPlacements(S, S, S),
    }
    assert OUTER_STRATEGY_PLACEMENTS == {"no_shard": AxisPlacements(R, P, R), "optim": AxisPlacements(R, P, S)}
    # the gradient is averaged, not summed, across replicas
    assert all(p.gradient.reduce_op == "avg" for p in STRATEGY_PLACEMENTS.values() if isinstance(p.gradient, Partial))


@pytest.mark.parametrize(
    "alias,name",
    [(0, "no_shard"), (1, "optim"), (2, "optim_grads"), (3, "optim_grads_params"),
     ("2", "optim_grads"), ("zero1", "optim"), ("ZeRO3", "optim_grads_params"), ("ddp", "no_shard"),
     ("OPTIM", "optim")],
)
def test_resolve_strategy_aliases(alias, name):
    assert resolve_strategy(alias) == name


@pytest.mark.parametrize("bad,error", [(4, ValueError), ("zero4", ValueError), (True, TypeError), (1.0, TypeError)])
def test_resolve_strategy_rejects(bad, error):
    with pytest.raises(error, match="strategy"):
        resolve_strategy(bad)


def test_hsdp_and_hfsdp_placements():
    hsdp = strategy_placements(3, "no_shard")
    assert list(hsdp) == ["dp_outer", "dp_shard"]  # outer first
    assert hsdp == {"dp_outer": AxisPlacements(R, P, R), "dp_shard": AxisPlacements(S, S, S)}
    assert strategy_placements("optim_grads_params", "optim") == {
        "dp_outer": AxisPlacements(R, P, S), "dp_shard": AxisPlacements(S, S, S)}
    assert describe(hsdp) == "dp_outer[R,P,R] dp_shard[S,S,S]"
    assert strategy_placements(1, inner_axis="x") == {"x": AxisPlacements(R, P, S)}


def test_hybrid_strategies_that_are_refused():
    with pytest.raises(ValueError, match="HFSDP.*optim_grads_params"):
        strategy_placements("optim_grads", "optim")
    with pytest.raises(ValueError, match="outer_dp_sharding_strategy='optim_grads' is not supported"):
        strategy_placements(3, "optim_grads")


@pytest.mark.parametrize(
    "placements,match",
    [
        ((S, P, S), "parameter is Shard but gradient"),
        ((R, S, R), "gradient is Shard but optimizer"),
        ((Shard(1), S, S), r"parameter=Shard\(dim=1\) is not supported"),
        ((P, P, R), "parameter=.*Partial"),
        ((R, R, R), "gradient=Replicate"),
        ((R, P, P), "optimizer=.*Partial"),
    ],
)
def test_validate_axis_placements_rejects(placements, match):
    with pytest.raises(ValueError, match=match):
        validate_axis_placements("dp", placements)


def test_every_table_row_is_valid_and_tuples_normalize():
    for row in list(STRATEGY_PLACEMENTS.values()) + list(OUTER_STRATEGY_PLACEMENTS.values()):
        validate_axis_placements("dp", row)
    assert normalize_placements({"dp": (R, P, S)}) == {"dp": AxisPlacements(R, P, S)}
    with pytest.raises(TypeError):
        validate_axis_placements("dp", (R, P))
