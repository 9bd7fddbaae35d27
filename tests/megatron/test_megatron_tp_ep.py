"""The Megatron adapter composed with tensor and expert parallelism (4 gloo processes).

Process groups come from ``build_process_groups`` (Megatron's rank order) and
the model is built with the same collection's ``tp`` / ``ep`` groups. Every
rank also trains the single-process TP=1 / EP=1 model on the whole global
batch and compares losses (fp32, rtol 1e-5) and the gathered global state
(tensor-wise relative error <= 1e-5; ``tests.helpers.parity``).
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

import shardwise
from shardwise.megatron import (
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    FullyShardedDataParallelV1,
    FullyShardedDataParallelV2,
    TransformerConfig,
    build_process_groups,
)
from shardwise.models import GPT, GPTConfig

from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import assert_close_states, compare, megatron_hooks, state_of, train_both

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 4, 8, 12, 64
MOE = dict(layer_pattern="AE", moe_num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.0)


def gpt_config(**overrides) -> GPTConfig:
    fields = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)
    fields.update(overrides)
    return GPTConfig(**fields)


def batch(step: int) -> torch.Tensor:
    """Learnable sequences: arithmetic progressions mod VOCAB (``SEQ + 1`` tokens each)."""
    g = torch.Generator().manual_seed(700 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def ddp_config(version, strategy="optim_grads_params", outer="no_shard", instances=1, **kw):
    return DistributedDataParallelConfig(
        use_megatron_fsdp=True, megatron_fsdp_version=version, data_parallel_sharding_strategy=strategy,
        outer_dp_sharding_strategy=outer, num_distributed_optimizer_instances=instances, **kw,
    )


def batch_xy(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    data = batch(step)
    return data[:, :-1], data[:, 1:]


def seeded_gpt(config: GPTConfig):
    def build():
        torch.manual_seed(0)
        return GPT(config)

    return build


def adamw(model):
    # lr 1e-3, not the engine tests' 1e-2: a TP layer sums its partial products in another order than the
    # TP=1 reference, and at 1e-2 Adam grew that fp32 rounding to 1.01e-5 on one host (AMD EPYC); at 1e-3 it
    # stays under 2.1e-6 while every weight still moves by percents, far beyond rtol for any layout bug.
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, eps=1e-6)


def train_and_compare(config: GPTConfig, wrap, reference_config: GPTConfig, pg, micro_batches=2):
    """Megatron's loop (tests.helpers.parity.megatron_hooks) on ``wrap(GPT(config))``, against the
    TP=1 / EP=1 ``GPT(reference_config)`` trained on the whole global batch in this process."""
    dp = pg.dp_cp
    sharded, reference = train_both(
        seeded_gpt(config), wrap, adamw, batch_xy, STEPS, data_rank=dist.get_rank(dp), data_ranks=dist.get_world_size(dp),
        micro_batches=micro_batches, hooks=megatron_hooks(), loss_group=dp,
        full_state=lambda wrapped: shardwise.full_state_dict(wrapped.sharded_model), reference=seeded_gpt(reference_config),
    )
    compare(sharded, reference, trained_by=0.0)  # and it trained
    return sharded, reference


# ------------------------------------------------------------ tensor parallel
def _tp_dp(version, strategy, instances, outer, pattern):
    pg = build_process_groups(tensor_model_parallel_size=2, num_distributed_optimizer_instances=instances)
    overrides = MOE if pattern == "AE" else {}
    shapes = {}

    def wrap(model):
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=2)
        wrapped = FullyShardedDataParallel(
            config, ddp_config(version, strategy, outer, instances), model, device=device(), pg_collection=pg
        )
        assert isinstance(wrapped, FullyShardedDataParallelV1 if version == 1 else FullyShardedDataParallelV2)
        plan = wrapped.sharded_state.plan
        assert plan.mesh.mesh_dim_names == (("dp_outer", "dp_shard", "tp") if instances > 1 else ("dp_shard", "tp"))
        assert plan.mesh.get_group("tp") is pg.tp and plan.dp_size == 2
        # TP slices are DTensors of the global tensors: Shard(partition_dim) on the tp axis
        wq, wo = model.layers[0].attention.wq.weight, model.layers[0].attention.wo.weight

        def on_tp(t):
            return t.placements[t.device_mesh.mesh_dim_names.index("tp")]

        assert isinstance(wq, DTensor) and on_tp(wq) == Shard(0) and on_tp(wo) == Shard(1)
        assert wq.shape == (32, 32) and wo.shape == (32, 32)
        # Megatron's adapter's keys (module.<model key>), the global shapes
        shapes.update({k.removeprefix("module."): tuple(v.shape) for k, v in wrapped.state_dict().items()})
        return wrapped

    _, reference = train_and_compare(gpt_config(tp_group=pg.tp, **overrides), wrap, gpt_config(**overrides), pg)
    assert shapes == {k: tuple(v.shape) for k, v in reference.state.items()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "version,strategy,instances,outer,pattern",
    [
        (1, "optim_grads_params", 1, "no_shard", "A"),  # ZeRO-3, V1
        (2, "optim_grads_params", 1, "no_shard", "A"),  # ZeRO-3, V2
        (1, "optim", 1, "no_shard", "A"),  # ZeRO-1: start_param_sync gathers the updated shards
        (1, "optim_grads_params", 2, "no_shard", "A"),  # HSDP x TP
        (1, "optim_grads_params", 1, "no_shard", "AE"),  # TP with MoE layers (EP = 1)
    ],
)
def test_tp2_dp2_matches_tp1_single_process(version, strategy, instances, outer, pattern):
    run_distributed(_tp_dp, 4, version, strategy, instances, outer, pattern)


def _tp_state_dict(version):
    dev = device()
    pg = build_process_groups(tensor_model_parallel_size=2)
    torch.manual_seed(0)
    model = GPT(gpt_config(tp_group=pg.tp))
    config = TransformerConfig(tensor_model_parallel_size=2)
    wrapped = FullyShardedDataParallel(config, ddp_config(version), model, device=dev, pg_collection=pg)
    torch.manual_seed(0)
    single = GPT(gpt_config())
    # the state dict describes the global tensors: the TP=1 model's keys (under Megatron-FSDP's level) and shapes
    state = wrapped.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == {f"module.{k}": tuple(v.shape)
                                                              for k, v in single.state_dict().items()}
    saved = {k: v.clone() for k, v in state.items()}
    original = shardwise.full_state_dict(wrapped.sharded_model)
    for name, value in single.state_dict().items():
        assert torch.equal(original[name], value), name  # TP init equals the TP=1 init
    # full tensors of another TP=1 model: each rank cuts its TP slice, then its DP rows
    torch.manual_seed(5)
    other = GPT(gpt_config())
    wrapped.load_state_dict(other.state_dict())
    loaded = shardwise.full_state_dict(wrapped.sharded_model)
    assert all(torch.equal(loaded[k], v) for k, v in other.state_dict().items())
    data = batch(0).to(dev)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(data[:, :-1], data[:, 1:]), other.to(dev)(data[:, :-1], data[:, 1:]))
    # and back from the sharded tensors state_dict() returned
    wrapped.load_state_dict(saved)
    restored = shardwise.full_state_dict(wrapped.sharded_model)
    assert all(torch.equal(restored[k], original[k]) for k in original)


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_tp_state_dict_is_global_and_loads_full_tensors(version):
    run_distributed(_tp_state_dict, 4, version)


# ------------------------------------------------------------ expert parallel
def _ep_dp(version, strategy, instances=1, expert_strategy=None):
    pg = build_process_groups(expert_model_parallel_size=2, num_distributed_optimizer_instances=instances)

    def wrap(model):
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, expert_model_parallel_size=2,
                                   num_moe_experts=4)
        ddp = ddp_config(version, strategy, "no_shard", instances, expert_data_parallel_sharding_strategy=expert_strategy)
        wrapped = FullyShardedDataParallel(config, ddp, model, device=device(), pg_collection=pg)
        expert_mesh = wrapped.megatron_fsdp_dist_index.expert_mesh if version == 1 else wrapped.moe_mesh
        assert expert_mesh.mesh_dim_names == ("expert_dp", "ep")
        assert expert_mesh.get_group("ep") is pg.ep and expert_mesh.get_group("expert_dp") is pg.expt_dp
        w1 = model.layers[1].mlp.experts.w1
        assert isinstance(w1, DTensor) and w1.shape[0] == 4  # all 4 experts
        # the same groups, listed in DTensor's Shard order: experts first, then their data-parallel rows
        assert w1.device_mesh.mesh_dim_names == ("ep", "expert_dp") and w1.device_mesh.get_group("ep") is pg.ep
        return wrapped

    train_and_compare(gpt_config(ep_group=pg.ep, **MOE), wrap, gpt_config(**MOE), pg)


@pytest.mark.slow
@pytest.mark.parametrize("version,strategy", [(1, "optim"), (2, "optim_grads"), (1, "optim_grads_params")])
def test_ep2_dp2_matches_ep1_single_process(version, strategy):  # each strategy once, both faces (CI time)
    run_distributed(_ep_dp, 4, version, strategy)


@pytest.mark.slow
def test_ep_with_its_own_expert_strategy_and_hsdp():
    # dense: HSDP (dp_outer 2 x dp_shard 2); experts: ZeRO-1 over expt_dp (2 ranks)
    run_distributed(_ep_dp, 4, 1, "optim_grads_params", 2, "optim")


def _ep_per_token_loss():
    """calculate_per_token_loss: gradients are summed over (expert) data-parallel ranks, then scaled."""
    dev = device()
    pg = build_process_groups(expert_model_parallel_size=2)
    torch.manual_seed(0)
    model = GPT(gpt_config(ep_group=pg.ep, **MOE))
    torch.manual_seed(0)
    single = GPT(gpt_config(**MOE)).to(dev)
    config = TransformerConfig(expert_model_parallel_size=2, calculate_per_token_loss=True)
    wrapped = FullyShardedDataParallel(config, ddp_config(1, "optim_grads"), model, device=dev, pg_collection=pg)
    rank = dist.get_rank()
    data = batch(0).to(dev)
    mine = data[2 * rank : 2 * rank + 2 - rank % 2]  # uneven token counts: 2, 1, 2, 1 rows
    loss = nn.functional.cross_entropy(wrapped(mine[:, :-1]).flatten(0, 1), mine[:, 1:].flatten(), reduction="sum")
    loss.backward()
    tokens = torch.tensor(float(mine[:, 1:].numel()), device=dev)
    dist.all_reduce(tokens)
    wrapped.finish_grad_sync()
    wrapped.scale_gradients(1.0 / tokens.item())
    torch.optim.SGD(wrapped.parameters(), lr=1.0).step()
    rows = torch.cat([data[2 * r : 2 * r + 2 - r % 2] for r in range(4)])
    ref = nn.functional.cross_entropy(single(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())
    ref.backward()
    with torch.no_grad():
        for p in single.parameters():
            p -= p.grad
    assert_close_states(shardwise.full_state_dict(wrapped.sharded_model), state_of(single))


@pytest.mark.slow
def test_ep_per_token_loss_sums_dense_and_expert_grads():
    run_distributed(_ep_per_token_loss, 4)


def _ep_broadcast_params():
    pg = build_process_groups(expert_model_parallel_size=2)
    torch.manual_seed(0)
    model = GPT(gpt_config(ep_group=pg.ep, **MOE))
    wrapped = FullyShardedDataParallel(
        TransformerConfig(expert_model_parallel_size=2), ddp_config(1, "no_shard"), model,
        device=device(), pg_collection=pg,
    )
    before = shardwise.full_state_dict(wrapped.sharded_model)
    if dist.get_rank() >= 2:  # the second replica (dense and expert-DP index 1) drifts
        with torch.no_grad():
            for p in wrapped.parameters():
                p.to_local().add_(1.0)
    wrapped.broadcast_params()  # each EP rank keeps its own experts
    after = shardwise.full_state_dict(wrapped.sharded_model)
    for name, value in before.items():
        assert torch.equal(after[name], value), name


@pytest.mark.slow
def test_v1_broadcast_params_with_experts():
    run_distributed(_ep_broadcast_params, 4)


# ------------------------------------------------------------ tensor and expert parallel together
def _tp_ep_dp(cases):
    """TP 2 (attention, dense MLPs, embedding, head) with EP 2 of whole experts (expert TP 1): the groups
    are Megatron-Core's own (``parallel_state`` on gloo), each EP group a TP group, as it lays out MoE models.
    Every ``(version, strategy)`` of ``cases`` trains under one ``initialize_model_parallel`` (its dozens of
    gloo groups are the slow part of a case on CPU)."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection as MegatronGroups

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                             expert_tensor_parallel_size=1)
    try:
        pg = MegatronGroups.use_mpu_process_groups()
        assert dist.get_process_group_ranks(pg.ep) == dist.get_process_group_ranks(pg.tp)
        assert dist.get_world_size(pg.expt_tp) == 1 and dist.get_world_size(pg.expt_dp) == 2
        for version, strategy in cases:
            try:
                _tp_ep_dp_case(pg, version, strategy)
            except Exception as error:
                raise AssertionError(f"V{version} {strategy}: {error}") from error
    finally:
        parallel_state.destroy_model_parallel()


def _tp_ep_dp_case(pg, version, strategy):
    def wrap(model):
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_moe_experts=4,
                                   tensor_model_parallel_size=2, expert_model_parallel_size=2,
                                   expert_tensor_parallel_size=1)
        wrapped = FullyShardedDataParallel(config, ddp_config(version, strategy), model, device=device(),
                                           pg_collection=pg)
        plan = wrapped.sharded_state.plan
        assert plan.mesh.mesh_dim_names == ("dp_shard", "tp") and plan.mesh.get_group("tp") is pg.tp
        expert_mesh = wrapped.megatron_fsdp_dist_index.expert_mesh if version == 1 else wrapped.moe_mesh
        assert expert_mesh.get_group("ep") is pg.ep and expert_mesh.get_group("expert_dp") is pg.expt_dp
        wq, w1 = model.layers[0].attention.wq.weight, model.layers[1].mlp.experts.w1
        assert wq.placements[wq.device_mesh.mesh_dim_names.index("tp")] == Shard(0) and wq.shape == (32, 32)
        assert w1.device_mesh.mesh_dim_names == ("ep", "expert_dp") and w1.shape[0] == 4
        return wrapped

    train_and_compare(gpt_config(tp_group=pg.tp, ep_group=pg.ep, **MOE), wrap, gpt_config(**MOE), pg)


@pytest.mark.slow
def test_tp2_ep2_with_megatrons_groups_matches_one_process():
    """V1 ZeRO-3 and V2 ZeRO-1, in one worker task (one parallel_state initialization)."""
    run_distributed(_tp_ep_dp, 4, [(1, "optim_grads_params"), (2, "optim")])


# ------------------------------------------------------------ rejections
def _inconsistent_groups(version):
    dev = device()
    tp2 = build_process_groups(tensor_model_parallel_size=2)  # tp [0,1],[2,3]; dp_cp [0,2],[1,3]
    ep2 = build_process_groups(expert_model_parallel_size=2)  # ep [0,1],[2,3]; expt_dp [0,2],[1,3]
    config = TransformerConfig(tensor_model_parallel_size=2)
    errors = {}

    def attempt(key, cfg, model, pg, exc=ValueError):
        with pytest.raises(exc) as info:
            FullyShardedDataParallel(cfg, ddp_config(version), model, device=dev, pg_collection=pg)
        errors[key] = str(info.value)

    # the model was built without TP: its layers hold whole tensors
    attempt("no_tp_group", config, GPT(gpt_config()), tp2)
    # the model's TP group is not the mesh's (the data-parallel group instead)
    attempt("wrong_tp_group", config, GPT(gpt_config(tp_group=tp2.dp_cp)), tp2)
    # the collection's tp and dp_cp groups are swapped: the mesh would give shards to the wrong ranks
    swapped = type(tp2)(dp=tp2.tp, dp_cp=tp2.tp, tp=tp2.dp_cp, intra_dp_cp=tp2.tp, ep=tp2.ep, expt_dp=tp2.expt_dp)
    attempt("swapped_tp_dp", config, GPT(gpt_config(tp_group=tp2.dp_cp)), swapped)
    # the config asks for TP, the collection has none
    attempt("config_vs_groups", config, GPT(gpt_config()), build_process_groups())
    # experts: the model's EP group is not the collection's
    ep_config = TransformerConfig(expert_model_parallel_size=2)
    attempt("wrong_ep_group", ep_config, GPT(gpt_config(ep_group=ep2.expt_dp, **MOE)), ep2)
    # the collection's ep and expt_dp groups are swapped
    swapped_ep = type(ep2)(dp=ep2.dp, dp_cp=ep2.dp_cp, tp=ep2.tp, ep=ep2.expt_dp, expt_dp=ep2.ep, expt_tp=ep2.expt_tp)
    attempt("swapped_ep", ep_config, GPT(gpt_config(ep_group=ep2.expt_dp, **MOE)), swapped_ep)
    # EP on a model without experts
    attempt("no_experts", ep_config, GPT(gpt_config()), ep2)
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("version", [1, 2])
def test_inconsistent_groups_and_meshes_are_rejected(version):
    errors = run_distributed(_inconsistent_groups, 4, version)
    rank0, rank3 = errors[0], errors[3]
    assert "tensor-parallel" in rank0["no_tp_group"] and "[0]" in rank0["no_tp_group"]
    assert "[0, 1]" in rank0["no_tp_group"] and "'embed'" in rank0["no_tp_group"]
    assert "[0, 2]" in rank0["wrong_tp_group"] and "[0, 1]" in rank0["wrong_tp_group"]
    assert "do not match" in rank0["swapped_tp_dp"] and "data-parallel group" in rank0["swapped_tp_dp"]
    assert "tensor_model_parallel_size=2" in rank0["config_vs_groups"] and "pg_collection.tp" in rank0["config_vs_groups"]
    assert "expert-parallel" in rank3["wrong_ep_group"] and "[1, 3]" in rank3["wrong_ep_group"]
    assert "[2, 3]" in rank3["wrong_ep_group"]
    assert "do not match" in rank0["swapped_ep"] and "expert data-parallel group" in rank0["swapped_ep"]
    assert "no MoE layers" in rank0["no_experts"]
