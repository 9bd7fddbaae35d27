"""Ranks that disagree are refused at wrap time, on every rank, within seconds.

Cases are data: ``CASES[name] = (run, fragment)``. ``run()`` builds this rank's
model and arguments and calls the check (``check_rank_consistency`` directly, or
the Megatron face); ``fragment`` is what the one-line ``ValueError`` every rank
raises must contain (``None``: every rank passes).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from shardwise.engine.fully_shard_options import FullyShardOptions
from shardwise.engine.rank_consistency import check_rank_consistency, first_difference
from shardwise.megatron import (
    DistributedDataParallelConfig,
    FullyShardedDataParallelV1,
    FullyShardedDataParallelV2,
    ProcessGroupCollection,
    TransformerConfig,
    build_process_groups,
)
from shardwise.megatron.process_groups import group_layout_problem
from shardwise.engine.mesh import build_dp_mesh, build_expert_mesh
from shardwise.models import GPT, GPTConfig
from shardwise.models.tensor_parallel import ColumnParallelLinear

from tests.helpers.distributed import run_distributed


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w = nn.Linear(dim, hidden)
        self.v = nn.Linear(hidden, dim)


class Net(nn.Module):
    def __init__(self, layers: int = 2, dim: int = 8, hidden: int = 4):
        super().__init__()
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, 3)


def _rank() -> int:
    return dist.get_rank()


def _check(model, **kwargs):
    kwargs.setdefault("unit_modules", [Block])
    check_rank_consistency(model, FullyShardOptions(**kwargs))


_MESHES: dict = {}


def _mesh(kind: str):  # meshes are collective to build: build each once per worker
    if kind not in _MESHES:
        _MESHES[kind] = {"tp2": lambda: build_dp_mesh(tp=2), "ep2": lambda: build_expert_mesh(2),
                         "ep1": lambda: build_expert_mesh(1),
                         "model2": lambda: init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp_shard", "model"))}[kind]()
    return _MESHES[kind]


def _moe(**kw):
    return GPT(GPTConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2, layer_pattern="E", moe_num_experts=2, **kw))


# ------------------------------------------------------- check_rank_consistency
def extra_layer():
    _check(Net(layers=2 + _rank()))


def hidden_size():
    _check(Net(dim=8 * (1 + _rank())))


def same_numel_other_shape():
    net = Net(dim=8, hidden=4)
    if _rank() == 1:
        net.layers[1].w.weight = nn.Parameter(torch.zeros(8, 4))
    _check(net)


def strategy():
    _check(Net(), strategy=["optim_grads_params", "optim_grads"][_rank()])


def zero1_and_zero2():  # e.g. under no_sync: the gradients would stay Partial on one rank only
    _check(Net(), strategy=[1, "optim_grads"][_rank()])


def one_strategy_by_two_names():
    _check(Net(), strategy=["optim", 1][_rank()])


def strategy_with_tp_axis_model():  # the build reads 'model' as TP: ZeRO-3 over dp_shard, not HSDP over both axes
    _check(Net(), mesh=_mesh("model2"), tp_axis="model", strategy=[3, "optim_grads"][_rank()])


def same_with_tp_axis_model():
    _check(Net(), mesh=_mesh("model2"), tp_axis="model", strategy="optim_grads")


def unit_modules():
    net = Net()
    _check(net, unit_modules=[Block] if _rank() == 0 else [net.layers[0]])


def requires_grad():
    net = Net()
    net.layers[0].v.bias.requires_grad_(_rank() == 0)
    _check(net)


def dtype():
    _check(Net().to(torch.float32 if _rank() == 0 else torch.bfloat16))


def options():
    _check(Net(), reshard_after_forward=_rank() == 0, prefetch=True)


def tied():
    net = Net()
    if _rank() == 1:
        net.layers[1].w.weight = net.layers[0].w.weight
    _check(net)


def tp_params_without_tp_axis():
    _check(nn.Sequential(ColumnParallelLinear(8, 16, group=dist.group.WORLD)), unit_modules=None)


def tp_model_without_tp_group_on_tp_mesh():
    _check(nn.Sequential(ColumnParallelLinear(8, 16, group=None)), mesh=_mesh("tp2"), unit_modules=None)


def experts_without_expert_mesh():
    _check(_moe(ep_group=dist.group.WORLD), unit_modules=None)


def expert_mesh_of_the_wrong_size():
    _check(_moe(ep_group=dist.group.WORLD), expert_mesh=_mesh("ep1"), unit_modules=None)


def _own_mesh(*names):  # a mesh over this rank alone
    single = build_process_groups(tensor_model_parallel_size=2).dp_cp
    return DeviceMesh.from_group([single] * len(names), "cpu", mesh=[[_rank()]] if len(names) == 2 else [_rank()],
                                 mesh_dim_names=names)


def mesh_differs_between_ranks():
    mesh = _own_mesh("dp_shard")
    _check(Net(), mesh=None if _rank() == 0 else mesh)


def expert_mesh_not_covering_the_world():
    _check(_moe(ep_group=None), expert_mesh=_own_mesh("dp_shard", "ep"), unit_modules=None)


def mesh_not_a_mesh_on_one_rank():
    _check(Net(), mesh=None if _rank() == 0 else "dp")


def unit_modules_not_describable_on_one_rank():
    _check(Net(), unit_modules=[Block] if _rank() == 0 else 5)


def same_everywhere():
    _check(Net(), reshard_after_forward=True)


def tp_slices_on_a_tp_mesh():
    mesh = _mesh("tp2")
    _check(nn.Sequential(ColumnParallelLinear(8, 16, group=mesh.get_group("tp"))), mesh=mesh, unit_modules=None)


def gpt_marked_tp_at_size_one():  # GPT marks TP slices even without a TP group: not refused
    _check(GPT(GPTConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2)), unit_modules=None)


def expert_mesh_without_expert_params():  # e.g. experts that carry neither the mark nor a plan_fn
    _check(Net(), expert_mesh=_mesh("ep2"))


def fully_shard_onto_an_expert_mesh_nothing_goes_on():  # the whole wrap: refused before anything is sharded
    import shardwise

    shardwise.fully_shard(Net(), unit_modules=[Block], expert_mesh=_mesh("ep2"), plan_fn=lambda fqn, p: "dense")


def experts_on_their_expert_mesh():
    _check(_moe(ep_group=dist.group.WORLD), expert_mesh=_mesh("ep2"), unit_modules=None)


# ------------------------------------------------------------ the Megatron face
def _ddp(instances=1):
    return DistributedDataParallelConfig(megatron_fsdp_version=2, data_parallel_sharding_strategy="optim_grads_params",
                                         num_distributed_optimizer_instances=instances)


def _v2(pg, instances=1, version=FullyShardedDataParallelV2):
    model = GPT(GPTConfig(vocab_size=16, dim=16, n_layers=1, n_heads=2))
    version(TransformerConfig(), _ddp(instances), model, device=torch.device("cpu"), pg_collection=pg)


def _single():  # each rank's one-rank group (dp_cp of TP=2)
    return build_process_groups(tensor_model_parallel_size=2).dp_cp


def megatron_dp_cp_of_one_rank():
    _v2(ProcessGroupCollection(dp_cp=_single()))


def megatron_v1_dp_cp_of_one_rank():
    _v2(ProcessGroupCollection(dp_cp=_single()), version=FullyShardedDataParallelV1)


def megatron_dp_cp_differs_between_ranks():
    single = _single()
    _v2(ProcessGroupCollection(dp_cp=dist.group.WORLD if _rank() == 0 else single))


def megatron_instances_with_groups_for_one():
    _v2(build_process_groups(), instances=2)


def megatron_swapped_inner_outer():
    good = build_process_groups(num_distributed_optimizer_instances=2)
    _v2(ProcessGroupCollection(dp_cp=good.dp_cp, intra_dp_cp=good.inter_dist_opt, inter_dist_opt=good.intra_dp_cp),
        instances=2)


def megatron_instances_not_the_replica_count():
    _v2(build_process_groups(num_distributed_optimizer_instances=2), instances=3)


def megatron_good_hybrid_groups():
    _v2(build_process_groups(num_distributed_optimizer_instances=2), instances=2)


CASES = {
    extra_layer: "parameter 'layers.2.w.weight' exists on rank 1 but not on rank 0 (10 parameters on rank 0, 14 on rank 1)",
    hidden_size: "parameter 'layers.0.w.weight' has shape (4, 8) on rank 0 but (4, 16) on rank 1",
    same_numel_other_shape: "parameter 'layers.1.w.weight' has shape (4, 8) on rank 0 but (8, 4) on rank 1",
    strategy: "strategy='optim_grads_params' (placements dp_shard[S,S,S]) on rank 0 but strategy='optim_grads' "
    "(placements dp_shard[R,S,S]) on rank 1",
    zero1_and_zero2: "strategy=1 (placements dp_shard[R,P,S]) on rank 0 but strategy='optim_grads' "
    "(placements dp_shard[R,S,S]) on rank 1",
    one_strategy_by_two_names: None,
    strategy_with_tp_axis_model: "strategy=3 (placements dp_shard[S,S,S]) on rank 0 but strategy='optim_grads' "
    "(placements dp_shard[R,S,S]) on rank 1",
    same_with_tp_axis_model: None,
    unit_modules: "module 'layers.1' is a unit (unit_modules) on rank 0 but not on rank 1",
    requires_grad: "parameter 'layers.0.v.bias' has requires_grad True on rank 0 but False on rank 1",
    dtype: "parameter 'layers.0.w.weight' has dtype float32 on rank 0 but bfloat16 on rank 1",
    options: "('prefetch', True), ('reshard_after_forward', True), ('sync_module_states', False)) on rank 0 but",
    tied: "parameter 'layers.1.w.weight' is a tensor of its own on rank 0 but the same tensor as "
    "'layers.0.w.weight' on rank 1",
    tp_params_without_tp_axis: "parameter '0.weight' is a tensor-parallel slice (tensor_model_parallel=True, "
    "partition_dim=0) of a TP group of 2 ranks, but the mesh axes ['dp_shard'] have no tensor-parallel axis",
    tp_model_without_tp_group_on_tp_mesh: "module '0' was built with tensor-parallel ranks [0] (its 'group'), "
    "but the mesh axis 'tp' has ranks [0, 1] on rank 0 (on ranks [0, 1])",
    experts_without_expert_mesh: "(expert parallelism over 2 ranks), but no expert_mesh was given",
    expert_mesh_of_the_wrong_size: "(expert parallelism over 2 ranks), but the expert mesh axis 'ep' has 1 rank (on",
    mesh_differs_between_ranks: "ranks disagree before sharding: the mesh covers ranks [0, 1] on rank 0 but [1] on rank 1",
    expert_mesh_not_covering_the_world: "the expert mesh covers ranks [0], but the mesh covers [0, 1]",
    mesh_not_a_mesh_on_one_rank: "mesh='dp' must be a torch.distributed.DeviceMesh or None (e.g. "
    "shardwise.build_dp_mesh() or shardwise.build_expert_mesh(ep)), got a str (on rank 1)",
    unit_modules_not_describable_on_one_rank: "rank 1 could not describe its model and arguments: TypeError:",
    same_everywhere: None,
    tp_slices_on_a_tp_mesh: None,
    gpt_marked_tp_at_size_one: None,
    expert_mesh_without_expert_params: "an expert_mesh was given, but plan_fn puts no parameter on it",
    fully_shard_onto_an_expert_mesh_nothing_goes_on: "an expert_mesh was given, but plan_fn puts no parameter on it",
    experts_on_their_expert_mesh: None,
    megatron_dp_cp_of_one_rank: "pg_collection.dp_cp has 1 rank(s) [0] on rank 0, but a world of 2 ranks with "
    "tp=1 x pp=1 needs 2 data-parallel ranks per group",
    megatron_v1_dp_cp_of_one_rank: "pg_collection.dp_cp has 1 rank(s) [0] on rank 0",
    megatron_dp_cp_differs_between_ranks: "pg_collection.dp_cp is [0, 1] on rank 0 but [1] on rank 1",
    megatron_instances_with_groups_for_one: "pg_collection.inter_dist_opt has 1 rank [0] on rank 0",
    megatron_swapped_inner_outer: "(are intra_dp_cp and inter_dist_opt swapped?)",
    megatron_instances_not_the_replica_count: "num_distributed_optimizer_instances=3 needs "
    "pg_collection.inter_dist_opt with 3 ranks (one per optimizer instance), got 2 [0, 1]",
    megatron_good_hybrid_groups: None,
}
_BY_NAME = {fn.__name__: fn for fn in CASES}


def _run_case(name: str):
    start = time.perf_counter()
    torch.manual_seed(0)  # every rank builds the same weights: the values are checked too
    try:
        _BY_NAME[name]()
        message = None
    except ValueError as err:
        message = str(err)
    return message, time.perf_counter() - start


@pytest.mark.parametrize("name", list(_BY_NAME))
def test_ranks_that_disagree_are_refused_on_every_rank(name):
    fragment = CASES[_BY_NAME[name]]
    results = run_distributed(_run_case, 2, name)  # a hang would time out here, a crash fail here
    for rank, (message, seconds) in enumerate(results):
        assert seconds < 10, (rank, seconds)
        if fragment is None:
            assert message is None, (rank, message)
        else:
            assert message is not None, f"rank {rank} did not raise"
            assert fragment in message and "\n" not in message, (rank, message)
    if fragment is not None and not name.startswith("megatron_v1"):
        assert results[0][0] == results[1][0]  # one verdict, the same words on every rank


# ------------------------------------------------------------------ pure parts
def test_first_difference_names_the_first_field():
    a = {"mesh": "m", "expert_mesh": "none", "placements": "p", "expert_placements": "e", "axes": ("tp", "ep"),
         "options": (), "params": (("w", (2, 3), "float32", True, "no", True, None),), "units": ()}
    assert first_difference(a, dict(a), 0, 1) is None
    b = dict(a, params=(("w", (3, 2), "float32", True, "no", True, None),), units=("x",))
    assert first_difference(a, b, 0, 3) == "parameter 'w' has shape (2, 3) on rank 0 but (3, 2) on rank 3"
    assert "is a unit" in first_difference(a, dict(a, units=("x",)), 0, 1)
    assert first_difference(a, dict(b, mesh="n"), 0, 1).startswith("the mesh: m on rank 0 but n on rank 1")
    assert first_difference(a, dict(a, expert_params=("w",)), 0, 1) == (
        "parameter 'w' is on the expert mesh (plan_fn) on rank 1 but not on rank 0")


def test_group_layout_of_four_ranks():
    def layout(**groups):
        return [{name: groups[name][r] for name in groups} for r in range(4)]

    pairs = {r: [r - r % 2, r - r % 2 + 1] for r in range(4)}
    strided = {r: [r % 2, r % 2 + 2] for r in range(4)}
    world = {r: [0, 1, 2, 3] for r in range(4)}
    assert group_layout_problem(layout(dp_cp=world), False) is None
    assert group_layout_problem(layout(dp_cp=world, intra_dp_cp=pairs, inter_dist_opt=strided), True) is None
    assert "needs 4 data-parallel ranks" in group_layout_problem(layout(dp_cp=pairs), False)
    assert group_layout_problem(layout(dp_cp=strided, tp=pairs), False) is None
    assert "share ranks [0, 1]" in group_layout_problem(layout(dp_cp=pairs, tp=pairs), False)
    assert "do not cut" in group_layout_problem(layout(dp_cp=world, intra_dp_cp=pairs, inter_dist_opt=pairs), True)
    assert "expt_dp has 4 rank(s)" in group_layout_problem(layout(dp_cp=world, ep=pairs, expt_dp=world), False)
