"""Tensor-parallel detection rules, rank layouts, RNG state and TP sync, mesh builders."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Partial, Replicate, Shard

from shardwise.engine import rng
from shardwise.megatron import FullyShardedDataParallelV1, annotate_tensor_parallelism, detect_parallelism_type, rank_layout
from shardwise.megatron import build_process_groups
from shardwise.engine.placements import AxisPlacements
from shardwise.engine.rng import get_rng_state_dict, load_rng_state_dict
from shardwise.megatron.meshes import (
    _build_expert_mesh_and_placements,
    _build_hybrid_dp_mesh,
    _check_mesh_ranks_and_group_ranks_are_consistent,
    _DATA_PARALLEL_PLACEMENTS,
    _get_dp_tp_mesh,
    _get_hsdp_tp_mesh,
)
from shardwise.megatron.base import _check_strategies, _placements
from shardwise.megatron.config import DistributedDataParallelConfig, TransformerConfig
from shardwise.megatron.meshes import _build_dense_mesh, _get_edp_ep_mesh
from shardwise.megatron.parallelism import mark_tensor_parallel
from shardwise.models import ColumnParallelLinear, GPT, GPTConfig, Linear, RMSNorm, RowParallelLinear

from tests.helpers.distributed import run_distributed


# --------------------------------------------------------- detection rules
def _holder(class_name: str, params=("weight",), **attrs) -> nn.Module:
    """A module of class ``class_name`` holding ``params`` and carrying ``attrs``."""
    module = type(class_name, (nn.Module,), {})()
    for name in params:
        setattr(module, name, nn.Parameter(torch.zeros(2)))
    for key, value in attrs.items():
        setattr(module, key, value)
    return module


def _marked(tensor_model_parallel, partition_dim=None) -> nn.Module:
    """A plain module whose parameter carries the TP marks (as shardwise's and Megatron's layers set them)."""
    module = _holder("Plain", ("weight", "bias"))
    for p in module.parameters():
        p.tensor_model_parallel = tensor_model_parallel
        if partition_dim is not None:
            p.partition_dim = partition_dim
    return module


DETECTION_RULES = [
    # (rule, module, parameter name, expected)
    ("fused LN-linear: norm weight", _holder("TELayerNormColumnParallelLinear"), "layer_norm_weight", "replicated"),
    ("fused LN-linear: norm bias", _holder("TELayerNormColumnParallelLinear"), "layer_norm_bias", "replicated"),
    ("fused LN-linear: weight", _holder("TELayerNormColumnParallelLinear"), "weight", "column"),
    ("fused LN-linear: bias", _holder("TELayerNormColumnParallelLinear"), "bias", "column"),
    ("registry column", _holder("ColumnParallelLinear"), "weight", "column"),
    ("registry column bias", _holder("TEColumnParallelLinear"), "bias", "column"),
    ("registry vocab embedding", _holder("VocabParallelEmbedding"), "weight", "column"),
    ("registry attention sink", _holder("TEDotProductAttention"), "softmax_offset", "column"),
    ("registry row", _holder("RowParallelLinear"), "weight", "row"),
    ("registry row bias is replicated", _holder("TERowParallelLinear"), "bias", "replicated"),
    ("registry grouped row", _holder("TERowParallelGroupedLinear"), "weight0", "row"),
    ("registry norm", _holder("TENorm"), "weight", "replicated"),
    ("registry router", _holder("TopKRouter"), "weight", "replicated"),
    ("registry identity", _holder("IdentityOp"), "weight", "replicated"),
    ("module attr: not TP", _holder("Custom", tensor_model_parallel=False), "weight", "replicated"),
    ("module attr: dim 0", _holder("Custom", tensor_model_parallel=True, partition_dim=0), "weight", "column"),
    ("module attr: dim 1", _holder("Custom", tensor_model_parallel=True, partition_dim=1), "weight", "row"),
    ("module attr: dim 1 bias", _holder("Custom", tensor_model_parallel=True, partition_dim=1), "bias", "replicated"),
    ("module attr: unknown dim", _holder("Custom", tensor_model_parallel=True, partition_dim=2), "weight", None),
    ("param attr: not TP", _marked(False), "bias", "replicated"),
    ("param attr: dim 0", _marked(True, 0), "weight", "column"),
    ("param attr: dim 1", _marked(True, 1), "weight", "row"),
    ("param attr: dim 1 bias", _marked(True, 1), "bias", "replicated"),
    ("norm by name", _holder("MyFancyNorm"), "weight", "replicated"),
    ("normalization by name", _holder("BatchNormalization"), "weight", "replicated"),
    ("TELinear column", _holder("TELinear", parallel_mode="column"), "weight", "column"),
    ("TELinear row", _holder("TELinear", parallel_mode="row"), "weight", "row"),
    ("TELinear row bias", _holder("TELinear", parallel_mode="row"), "bias", "replicated"),
    ("TELinear duplicated", _holder("TELinear", parallel_mode=None), "weight", "replicated"),
    ("unknown module", _holder("Linear"), "weight", None),
    ("unknown plain parameter", _holder("Experts"), "w1", None),
]


@pytest.mark.parametrize("rule,module,param_name,expected", DETECTION_RULES, ids=[r[0] for r in DETECTION_RULES])
def test_detect_parallelism_type(rule, module, param_name, expected):
    assert detect_parallelism_type(param_name, module) == expected
    # the V1 method is the same rules, with the class's registry
    assert FullyShardedDataParallelV1._detect_parallelism_type(
        SimpleNamespace(_MODULE_TYPE_REGISTRY=FullyShardedDataParallelV1._MODULE_TYPE_REGISTRY), param_name, module
    ) == expected


def test_annotate_sets_the_mode_only_where_known():
    model = nn.Sequential(ColumnParallelLinear(4, 4, bias=True), RowParallelLinear(4, 4, bias=True), RMSNorm(4), Linear(4, 4))
    found = annotate_tensor_parallelism(model)
    assert found == {"0.weight": "column", "0.bias": "column", "1.weight": "row", "1.bias": "replicated",
                     "2.weight": "replicated"}
    assert model[1].weight._tensor_parallel_mode == "row"
    assert not hasattr(model[3].weight, "_tensor_parallel_mode")  # unknown: no attribute


def test_mark_tensor_parallel_writes_the_engines_marks_where_missing():
    # layers known only by class name (Transformer Engine's) carry no marks of their own
    column = _holder("TEColumnParallelLinear", ("weight", "bias"))
    row = _holder("TERowParallelLinear", ("weight", "bias"))
    marked = ColumnParallelLinear(4, 4)  # marks set by the layer itself are kept
    marked.weight.partition_dim = 0
    model = nn.ModuleDict(dict(column=column, row=row, marked=marked, other=_holder("Experts", ("w1",))))
    unknown = mark_tensor_parallel(model, annotate_tensor_parallelism(model))
    assert unknown == ["other.w1"]
    assert column.weight.tensor_model_parallel and column.weight.partition_dim == 0
    assert column.bias.tensor_model_parallel and column.bias.partition_dim == 0
    assert row.weight.tensor_model_parallel and row.weight.partition_dim == 1
    assert row.bias.tensor_model_parallel is False and not hasattr(row.bias, "partition_dim")
    assert marked.weight.tensor_model_parallel and marked.weight.partition_dim == 0
    assert not hasattr(model["other"].w1, "tensor_model_parallel")


def test_gpt_is_fully_classified_except_experts_router_and_mamba():
    model = GPT(GPTConfig(vocab_size=32, dim=16, n_layers=3, n_heads=2, layer_pattern="AEM", mamba_head_dim=8))
    found = annotate_tensor_parallelism(model)
    unknown = sorted(n for n, _ in model.named_parameters() if n not in found)
    assert all(".mlp.experts." in n or n.endswith(".mlp.router") or n.startswith("layers.2.") for n in unknown), unknown
    assert found["layers.2.norm.weight"] == "replicated"


def test_fine_grained_recurse_module_types():
    from shardwise.models import Experts

    fine = FullyShardedDataParallelV1._fine_grained_recurse_module_types
    zero3 = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    assert fine(TransformerConfig(), zero3) == ()
    assert fine(TransformerConfig(overlap_moe_expert_parallel_comm=True), DistributedDataParallelConfig()) == ()
    assert fine(TransformerConfig(overlap_moe_expert_parallel_comm=True), zero3)[0] is Experts


# ------------------------------------------------------------ rank layout
def test_rank_layout_follows_megatron_order():
    layout = rank_layout(8, tensor_model_parallel_size=2, num_distributed_optimizer_instances=2)
    assert layout["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["dp_cp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout["intra_dp_cp"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert layout["inter_dist_opt"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    layout = rank_layout(8, context_parallel_size=2, pipeline_model_parallel_size=2)
    assert layout["cp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["dp_cp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    layout = rank_layout(8, expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    assert layout["expt_tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout["expt_dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize(
    "sizes,field",
    [
        (dict(tensor_model_parallel_size=3), "tensor_model_parallel_size"),
        (dict(expert_model_parallel_size=3), "expert_model_parallel_size"),
        (dict(num_distributed_optimizer_instances=3), "num_distributed_optimizer_instances"),
        (dict(context_parallel_size=0), "context_parallel_size"),
    ],
)
def test_rank_layout_rejects_sizes_that_do_not_divide(sizes, field):
    with pytest.raises(ValueError, match=field):
        rank_layout(8, **sizes)


R, S, P = Replicate(), Shard(0), Partial("avg")


def test_placement_table_is_zero_0_to_3():
    """Each strategy's (parameter, gradient, optimizer) placement on its axis: docs/engine.md's table."""
    assert _DATA_PARALLEL_PLACEMENTS == {
        "no_shard": AxisPlacements(parameter=R, gradient=P, optimizer=R),  # ZeRO-0 (DDP)
        "optim": AxisPlacements(parameter=R, gradient=P, optimizer=S),  # ZeRO-1
        "optim_grads": AxisPlacements(parameter=R, gradient=S, optimizer=S),  # ZeRO-2
        "optim_grads_params": AxisPlacements(parameter=S, gradient=S, optimizer=S),  # ZeRO-3
    }
    for row in _DATA_PARALLEL_PLACEMENTS.values():  # Shard is dim 0, Partial averages
        assert all(p.dim == 0 for p in row if isinstance(p, Shard))
        assert all(p.reduce_op == "avg" for p in row if isinstance(p, Partial))


@pytest.mark.parametrize(
    "strategy,outer,instances,expected",
    [
        ("optim", "no_shard", 1, {"dp_shard": (R, P, S)}),  # not hybrid: the inner axis only
        ("optim_grads_params", "no_shard", 2, {"dp_outer": (R, P, R), "dp_shard": (S, S, S)}),  # HSDP
        ("optim_grads_params", "optim", 2, {"dp_outer": (R, P, S), "dp_shard": (S, S, S)}),  # HFSDP
        ("optim_grads", "no_shard", 2, {"dp_outer": (R, P, R), "dp_shard": (R, S, S)}),
    ],
    ids=["flat", "hsdp", "hfsdp", "hsdp_over_zero2"],
)
def test_hybrid_placements_per_axis(strategy, outer, instances, expected):
    ddp = DistributedDataParallelConfig(
        data_parallel_sharding_strategy=strategy, outer_dp_sharding_strategy=outer,
        num_distributed_optimizer_instances=instances,
    )
    _check_strategies(ddp, "test")
    placements = _placements(ddp, hybrid=instances > 1)
    assert list(placements) == list(expected)  # outer axis first, as on the mesh
    assert placements == {axis: AxisPlacements(*p) for axis, p in expected.items()}


# ------------------------------------------------------------------ RNG
def _draw():
    return random.random(), float(np.random.rand()), torch.rand(3), rng.get_rng_tracker().get_states()


def test_rng_state_round_trip():
    tracker = rng.get_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    state = get_rng_state_dict()
    assert set(state) == {"random_rng_state", "np_rng_state", "torch_rng_state", "cuda_rng_state", "rng_tracker_states"}
    with tracker.fork("model-parallel-rng"):
        first_forked = torch.rand(2)
    first = _draw()
    load_rng_state_dict(state)
    with tracker.fork("model-parallel-rng"):
        assert torch.equal(torch.rand(2), first_forked)
    again = _draw()
    assert first[:2] == again[:2] and torch.equal(first[2], again[2])
    tracker.reset()


def test_tracker_fork_leaves_the_default_stream_alone():
    tracker = rng.RNGStatesTracker("cpu")
    tracker.add("a", 7)
    with pytest.raises(ValueError):
        tracker.add("b", 7)  # seeds must differ
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    with tracker.fork("a"):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(7)))


def test_a_user_tracker_can_be_plugged_in():
    class Fake:
        def get_states(self):
            return {"x": torch.tensor([1])}

        def set_states(self, states):
            self.loaded = states

    fake = Fake()
    rng.set_rng_tracker(fake)
    try:
        state = rng.get_rng_state_dict()
        assert torch.equal(state["rng_tracker_states"]["x"], torch.tensor([1]))
        rng.load_rng_state_dict(state)
        assert fake.loaded is state["rng_tracker_states"]
    finally:
        rng.set_rng_tracker(None)
    with pytest.raises(TypeError):
        rng.set_rng_tracker(object())


def _tp_sync():
    rank = dist.get_rank()
    tracker = rng.get_rng_tracker()
    tracker.reset()
    tracker.add("model-parallel-rng", 100 + rank)
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    mine = _draw()
    # TP size 1: nothing moves
    single = build_process_groups().tp
    FullyShardedDataParallelV1.sync_rng_states_across_tp_group(SimpleNamespace(tp_group=single))
    after = _draw()
    # rank 0 of a 2-rank TP group hands every generator and tracker stream to rank 1
    random.seed(rank)
    np.random.seed(rank)
    torch.manual_seed(rank)
    tracker.set_states(mine[3])
    tp = build_process_groups(tensor_model_parallel_size=2).tp
    FullyShardedDataParallelV1.sync_rng_states_across_tp_group(SimpleNamespace(tp_group=tp))
    synced = _draw()
    tracker.reset()
    return mine[:3], after[:3], synced[:3], {k: v.tolist() for k, v in synced[3].items()}


def test_sync_rng_states_across_tp_group():
    (mine0, after0, synced0, tr0), (mine1, after1, synced1, tr1) = run_distributed(_tp_sync, 2)
    assert after1[0] != after0[0]  # TP size 1 left each rank its own stream
    assert synced1[0] == synced0[0] and synced1[1] == synced0[1] and torch.equal(synced1[2], synced0[2])
    assert tr1 == tr0  # tracker streams too


# ---------------------------------------------------------------- meshes
def _mesh_builders():
    rank = dist.get_rank()
    assert _check_mesh_ranks_and_group_ranks_are_consistent(torch.tensor([[0, 1], [2, 3]]), [0, 1] if rank < 2 else [2, 3])
    with pytest.raises(ValueError, match=r"mesh ranks .* do not match process group ranks"):
        _check_mesh_ranks_and_group_ranks_are_consistent([[0, 1], [2, 3]], [0, 2, 1, 3][rank % 2 * 2 : rank % 2 * 2 + 2])

    hybrid = build_process_groups(num_distributed_optimizer_instances=2)  # intra [0,1],[2,3]; inter [0,2],[1,3]
    mesh = _build_hybrid_dp_mesh(hybrid.inter_dist_opt, hybrid.intra_dp_cp, "cpu")
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]] and mesh.mesh_dim_names == ("dp_outer", "dp_shard")
    assert mesh.get_local_rank("dp_shard") == rank % 2 and mesh.get_local_rank("dp_outer") == rank // 2

    tp2 = build_process_groups(tensor_model_parallel_size=2)  # tp [0,1],[2,3]; dp [0,2],[1,3]
    assert tp2.sizes() == dict(dp=2, dp_cp=2, intra_dp_cp=2, inter_dist_opt=1, tp=2, pp=1, cp=1, ep=1, expt_tp=2,
                               expt_dp=2, intra_expt_dp=2)
    assert dist.get_process_group_ranks(tp2.tp) == [rank - rank % 2, rank - rank % 2 + 1]
    table = _get_dp_tp_mesh(tp2.dp_cp, tp2.tp)
    assert table.tolist() == [[0, 1], [2, 3]]
    table = _get_hsdp_tp_mesh(hybrid.inter_dist_opt, hybrid.intra_dp_cp, build_process_groups().tp)
    assert table.tolist() == [[[0], [1]], [[2], [3]]]
    ep2 = build_process_groups(expert_model_parallel_size=2)  # ep [0,1],[2,3]; expt_dp [0,2],[1,3]
    assert _get_dp_tp_mesh(ep2.expt_dp, ep2.expt_tp, ep_size=2).tolist() == ([[0], [2]] if rank % 2 == 0 else [[1], [3]])

    # inconsistent groups: the "data-parallel" group is the TP group and vice versa
    with pytest.raises(ValueError, match="data-parallel group"):
        _get_dp_tp_mesh(tp2.tp, tp2.dp_cp)
    with pytest.raises(ValueError, match="outer data-parallel group"):
        _get_hsdp_tp_mesh(hybrid.intra_dp_cp, hybrid.inter_dist_opt, build_process_groups().tp)
    # rows must be the intra_dp_cp groups and columns the inter_dist_opt groups
    with pytest.raises(ValueError, match="repeats ranks"):
        _build_hybrid_dp_mesh(tp2.tp, tp2.tp, "cpu")
    diagonal = [dist.new_group(r) for r in ([0, 3], [1, 2])]  # every rank creates both
    outer = diagonal[0] if rank in (0, 3) else diagonal[1]
    with pytest.raises(ValueError, match=r"hybrid mesh (column|row) \[\d, \d\] does not match the "
                       r"(inter_dist_opt|intra_dp_cp) group \[\d, \d\]"):
        _build_hybrid_dp_mesh(outer, hybrid.intra_dp_cp, "cpu")
    with pytest.raises(ValueError, match="inter_dist_opt"):
        _build_hybrid_dp_mesh(None, hybrid.intra_dp_cp, "cpu")

    # expert mesh: neither when EP is off; when on, (expt_dp, ep) with the expert strategy on expert_dp
    assert _build_expert_mesh_and_placements(TransformerConfig(), DistributedDataParallelConfig(), hybrid, "cpu") == (None, None)
    mesh, placements = _build_expert_mesh_and_placements(
        TransformerConfig(expert_model_parallel_size=2),
        DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params",
                                      expert_data_parallel_sharding_strategy="optim"),
        ep2, "cpu",
    )
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]] and mesh.mesh_dim_names == ("expert_dp", "ep")
    assert mesh.get_group("expert_dp") is ep2.expt_dp and mesh.get_group("ep") is ep2.ep
    assert mesh.get_local_rank("ep") == rank % 2 and mesh.get_local_rank("expert_dp") == rank // 2
    assert placements == {"expert_dp": _DATA_PARALLEL_PLACEMENTS["optim"]}
    assert _get_edp_ep_mesh(ep2.expt_dp, ep2.ep).tolist() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="expt_dp"):
        _build_expert_mesh_and_placements(TransformerConfig(expert_model_parallel_size=2), DistributedDataParallelConfig(),
                                          type(ep2)(dp_cp=ep2.dp_cp, ep=ep2.ep), "cpu")
    with pytest.raises(ValueError, match="expert-parallel group.*do not match"):  # ep and expt_dp swapped
        _get_edp_ep_mesh(ep2.expt_dp, ep2.expt_dp)

    # dense meshes with a tp axis: (dp_shard, tp) and (dp_outer, dp_shard, tp), named as the engine expects
    mesh = _build_dense_mesh(tp2, False, "cpu")
    assert mesh.mesh.tolist() == [[0, 1], [2, 3]] and mesh.mesh_dim_names == ("dp_shard", "tp")
    assert mesh.get_group("tp") is tp2.tp and mesh.get_group("dp_shard") is tp2.dp_cp
    hybrid_tp = build_process_groups(tensor_model_parallel_size=2, num_distributed_optimizer_instances=2)
    mesh = _build_dense_mesh(hybrid_tp, True, "cpu")
    assert mesh.mesh.tolist() == [[[0, 1]], [[2, 3]]] and mesh.mesh_dim_names == ("dp_outer", "dp_shard", "tp")
    assert mesh.get_local_rank("dp_outer") == rank // 2 and mesh.get_local_rank("tp") == rank % 2
    assert _build_dense_mesh(hybrid, True, "cpu").mesh_dim_names == ("dp_outer", "dp_shard")  # no tp axis at TP=1


@pytest.mark.slow
def test_mesh_builders_check_groups_and_reject_inconsistent_ones():
    run_distributed(_mesh_builders, 4)


def _v1_rejects_inconsistent_hybrid_groups():
    good = build_process_groups(num_distributed_optimizer_instances=2)
    bad = type(good)(dp_cp=good.dp_cp, intra_dp_cp=good.inter_dist_opt, inter_dist_opt=good.intra_dp_cp)
    ddp = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params", num_distributed_optimizer_instances=2)
    with pytest.raises(ValueError, match="do not match"):
        FullyShardedDataParallelV1(TransformerConfig(), ddp, nn.Sequential(nn.Linear(4, 4)), device=torch.device("cpu"), pg_collection=bad)


@pytest.mark.slow
def test_v1_rejects_inconsistent_hybrid_groups():
    run_distributed(_v1_rejects_inconsistent_hybrid_groups, 4)
