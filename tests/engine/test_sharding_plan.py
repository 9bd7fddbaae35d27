"""The arithmetic of ``shardwise.engine.mesh.ShardingPlan``, single process (the strategy table: test_placements.py).

No process group: the plan only asks its mesh for axis names, sizes, this
rank's coordinates and process groups, so a fake mesh stands in for a
``DeviceMesh`` (its "process groups" are names, and ``dist.get_backend`` is
patched to answer for them).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard

import shardwise.engine.mesh as mesh_module
from shardwise.engine.arguments import build_plans
from shardwise.engine.fully_shard_options import FullyShardOptions
from shardwise.engine.mesh import ShardingPlan
from shardwise.engine.placements import (
    OUTER_STRATEGY_PLACEMENTS,
    STRATEGY_PLACEMENTS,
    AxisPlacements,
    strategy_placements,
)

from tests.helpers.fake_mesh import FakeMesh

R, S, P = Replicate(), Shard(0), Partial("avg")


@pytest.fixture
def backend(monkeypatch):
    """``dist.get_backend`` answering ``gloo`` (or what the test sets) for the fake groups."""
    answer = {"name": "gloo"}
    monkeypatch.setattr(dist, "get_backend", lambda group=None: answer["name"])
    return answer


def _plan(sizes, placements, coords=None, **kw) -> ShardingPlan:
    return ShardingPlan(FakeMesh(sizes, coords), placements, **kw)


def _names(axes) -> list[str]:
    return [a.name for a in axes]


# ------------------------------------------------------------ the plan's axis levels
@pytest.mark.parametrize(
    "strategy,param,grad,opt,finalize",
    [
        ("no_shard", [], [], [], ["dp_shard"]),
        ("optim", [], [], ["dp_shard"], []),
        ("optim_grads", [], ["dp_shard"], ["dp_shard"], []),
        ("optim_grads_params", ["dp_shard"], ["dp_shard"], ["dp_shard"], []),
    ],
)
def test_plan_levels_per_zero_stage(backend, strategy, param, grad, opt, finalize):
    plan = _plan({"dp_shard": 4}, strategy_placements(strategy))
    assert _names(plan.param_axes) == param
    assert _names(plan.grad_axes) == grad
    assert _names(plan.opt_axes) == opt and plan.opt_axis_names == opt
    assert _names(plan.finalize_allreduce_axes) == finalize
    assert plan.dp_size == 4 and plan.grad_scale == 1.0 and plan.model_parallel == {}


@pytest.mark.parametrize(
    "outer,param,grad,opt,finalize",
    [
        ("no_shard", ["dp_shard"], ["dp_shard"], ["dp_shard"], ["dp_outer"]),  # HSDP
        ("optim", ["dp_shard"], ["dp_shard"], ["dp_shard", "dp_outer"], []),  # HFSDP
    ],
)
def test_plan_levels_hybrid(backend, outer, param, grad, opt, finalize):
    plan = _plan({"dp_outer": 2, "dp_shard": 4}, strategy_placements(3, outer))
    assert _names(plan.param_axes) == param
    assert _names(plan.grad_axes) == grad
    assert _names(plan.opt_axes) == opt  # an axis nests below the ones sharding an earlier buffer
    assert _names(plan.finalize_allreduce_axes) == finalize
    assert plan.dp_size == 8


def test_levels_nest_param_then_grad_then_optimizer_axes(backend):
    """Each buffer's axes begin with the previous buffer's, in mesh order within a kind."""
    placements = {
        "a": AxisPlacements(R, P, S),  # optimizer only
        "b": AxisPlacements(R, S, S),  # gradient and optimizer
        "c": AxisPlacements(S, S, S),  # everything
        "d": AxisPlacements(R, S, S),
        "e": AxisPlacements(R, P, R),  # replicated: all-reduced at finalize
    }
    plan = _plan(dict(a=2, b=2, c=3, d=2, e=2), placements)
    assert _names(plan.param_axes) == ["c"]
    assert _names(plan.grad_axes) == ["c", "b", "d"]
    assert _names(plan.opt_axes) == ["c", "b", "d", "a"]
    assert _names(plan.finalize_allreduce_axes) == ["e"]
    assert plan.dp_size == 48


def test_axis_groups_carry_size_coordinate_group_and_backend(backend):
    plan = _plan({"dp_outer": 2, "dp_shard": 3}, strategy_placements(3, "no_shard"), coords={"dp_outer": 1, "dp_shard": 2})
    inner = plan.axes["dp_shard"]
    assert (inner.size, inner.index, inner.group, inner.averages_natively) == (3, 2, "group:dp_shard", False)
    assert (plan.axes["dp_outer"].size, plan.axes["dp_outer"].index) == (2, 1)
    backend["name"] = "nccl"  # NCCL averages natively
    plan = _plan({"dp_shard": 3}, strategy_placements(3))
    assert plan.axes["dp_shard"].averages_natively is True


def test_placements_are_kept_in_mesh_order(backend):
    plan = _plan({"dp_outer": 2, "dp_shard": 2}, {"dp_shard": STRATEGY_PLACEMENTS["optim_grads_params"],
                                                   "dp_outer": OUTER_STRATEGY_PLACEMENTS["optim"]})
    assert list(plan.placements) == ["dp_outer", "dp_shard"]
    assert _names(plan.opt_axes) == ["dp_shard", "dp_outer"]


def test_model_parallel_axes_are_not_data_parallel(backend):
    plan = _plan({"dp_shard": 2, "tp": 4}, strategy_placements(3), coords={"dp_shard": 1, "tp": 3},
                 model_parallel_axes=["tp"])
    assert list(plan.axes) == ["dp_shard"] and plan.dp_size == 2
    tp = plan.model_parallel["tp"]
    assert (tp.size, tp.index, tp.averages_natively) == (4, 3, False)
    assert plan.global_shape(torch.Size([3, 5]), {"tp": 1}) == torch.Size([3, 20])
    assert plan.global_shape(torch.Size([3, 5]), {}) == torch.Size([3, 5])


def test_plan_rejects_axes_it_cannot_place(backend):
    with pytest.raises(ValueError, match="does not have"):
        _plan({"dp_shard": 2}, {"dp_shard": STRATEGY_PLACEMENTS["optim"], "dp_outer": STRATEGY_PLACEMENTS["optim"]})
    with pytest.raises(ValueError, match=r"mesh axes \['tp'\] are neither"):
        _plan({"dp_shard": 2, "tp": 2}, strategy_placements(3))
    mesh = FakeMesh({"dp_shard": 2})
    mesh.mesh_dim_names = None
    with pytest.raises(ValueError, match="mesh_dim_names"):
        ShardingPlan(mesh, strategy_placements(3))


# ------------------------------------------------------------ grad_scale
def _build(mesh, gradient_reduction, expert_mesh=None, strategy=3, outer=None):
    return build_plans(FullyShardOptions(mesh=mesh, strategy=strategy, outer_dp_sharding_strategy=outer,
                                         expert_mesh=expert_mesh, gradient_reduction=gradient_reduction))


@pytest.mark.parametrize("outer", [None, "no_shard", "optim"])
def test_grad_scale_is_one_for_mean_and_the_dp_size_for_sum(backend, outer):
    mesh = FakeMesh({"dp_outer": 2, "dp_shard": 4} if outer else {"dp_shard": 4})
    plan, expert = _build(mesh, "mean", outer=outer)
    assert plan.grad_scale == 1.0 and expert is None
    plan, _ = _build(mesh, "sum", outer=outer)
    assert plan.grad_scale == plan.dp_size == (8 if outer else 4)  # undoes the average: a sum over all ranks


def test_grad_scale_sum_ignores_the_tp_axis(backend):
    plan, _ = _build(FakeMesh({"dp_shard": 2, "tp": 4}), "sum")
    assert plan.grad_scale == 2


def test_expert_grad_scale_averages_over_the_global_batch(backend):
    """Experts average over their expert-data-parallel peers; edp/dp makes it the global average."""
    dense, experts = FakeMesh({"dp_shard": 8}), FakeMesh({"dp_shard": 2, "ep": 4})
    plan, expert = _build(dense, "mean", experts)
    assert expert.dp_size == 2 and expert.grad_scale == 2 / 8 and plan.grad_scale == 1.0
    assert list(expert.model_parallel) == ["ep"]
    plan, expert = _build(dense, "sum", experts)
    assert plan.grad_scale == 8 and expert.grad_scale == 2  # (2 / 8) * 8: the sum over all ranks


def test_gradient_reduction_must_be_mean_or_sum(backend):
    with pytest.raises(ValueError, match="gradient_reduction='avg'"):
        _build(FakeMesh({"dp_shard": 2}), "avg")


# ------------------------------------------------------------ dtensor_spec's axis order
class _Regrouped:
    """Records what ``DeviceMesh.from_group`` would build (it needs real process groups)."""

    @staticmethod
    def from_group(groups, device_type, mesh, mesh_dim_names):
        out = FakeMesh(dict(zip(mesh_dim_names, mesh.shape)), device_type=device_type)
        out.groups, out.mesh = list(groups), mesh
        return out


@pytest.fixture
def regroup(monkeypatch):
    monkeypatch.setattr(mesh_module, "DeviceMesh", _Regrouped)


def test_dtensor_spec_keeps_the_mesh_when_it_is_in_order(backend, regroup):
    mesh = FakeMesh({"dp_outer": 2, "dp_shard": 4})
    plan = ShardingPlan(mesh, strategy_placements(3, "no_shard"))  # HSDP: replicated, then sharded
    spec_mesh, placements = plan.dtensor_spec()
    assert spec_mesh is mesh and placements == (R, S)


def test_dtensor_spec_orders_model_parallel_replicated_then_sharded_axes(backend, regroup):
    mesh = FakeMesh({"dp_shard": 2, "dp_outer": 3, "tp": 2})
    placements = {"dp_shard": STRATEGY_PLACEMENTS["optim_grads_params"], "dp_outer": OUTER_STRATEGY_PLACEMENTS["no_shard"]}
    plan = ShardingPlan(mesh, placements, model_parallel_axes=["tp"])
    spec_mesh, spec = plan.dtensor_spec({"tp": 1})
    assert spec_mesh.mesh_dim_names == ("dp_outer", "tp", "dp_shard")  # unsharded in mesh order, then opt axes
    assert spec == (R, Shard(1), S)
    assert spec_mesh.groups == ["group:dp_outer", "group:tp", "group:dp_shard"]
    assert torch.equal(spec_mesh.mesh, mesh.mesh.permute(1, 2, 0))
    assert plan.dtensor_spec({"tp": 1})[0] is spec_mesh  # built once


def test_dtensor_spec_follows_the_nesting_order_of_the_optimizer_axes(backend, regroup):
    """HFSDP nests dp_outer below dp_shard, so the DTensor mesh lists dp_shard first."""
    plan = ShardingPlan(FakeMesh({"dp_outer": 2, "dp_shard": 4}), strategy_placements(3, "optim"))
    spec_mesh, spec = plan.dtensor_spec()
    assert spec_mesh.mesh_dim_names == ("dp_shard", "dp_outer") and spec == (S, S)
    assert torch.equal(spec_mesh.mesh, torch.arange(8).reshape(2, 4).T)


@pytest.mark.parametrize("outer_size,regrouped", [(1, False), (2, True)])
def test_dtensor_spec_size_one_axes_do_not_force_a_regroup(backend, regroup, outer_size, regrouped):
    """A size-1 axis splits nothing: when only it is out of order, the given mesh is kept."""
    mesh = FakeMesh({"dp_outer": outer_size, "dp_shard": 4})
    plan = ShardingPlan(mesh, strategy_placements(3, "optim"))
    spec_mesh, spec = plan.dtensor_spec()
    assert (spec_mesh is not mesh) == regrouped
    assert spec == (S, S)  # both axes are optimizer axes either way
    assert spec_mesh.mesh_dim_names == (("dp_shard", "dp_outer") if regrouped else ("dp_outer", "dp_shard"))


@pytest.mark.parametrize("strategy,expected", [("no_shard", (R,)), ("optim", (S,)), ("optim_grads", (S,)),
                                               ("optim_grads_params", (S,))])
def test_dtensor_spec_is_the_optimizer_placement(backend, regroup, strategy, expected):
    mesh = FakeMesh({"dp_shard": 4})
    spec_mesh, spec = ShardingPlan(mesh, strategy_placements(strategy)).dtensor_spec()
    assert spec_mesh is mesh and spec == expected
