"""Megatron-FSDP's checkpoint attributes on every sharded parameter (4 gloo processes).

``megatron_fsdp_slice`` must be where this rank's local shard sits in the flattened
per-model-parallel-rank weight: checked against torch's own answer (the DTensor
redistributed to ``Replicate`` on its data-parallel axes, model-parallel axes kept).
``megatron_fsdp_dist_index`` must answer every attribute and method of Megatron-FSDP's
``FSDPDistributedIndex`` (the installed Megatron-Core's class, read from its source) with
the groups Megatron's adapter would give it: ``dp_cp`` (``intra_dp_cp`` and
``inter_dist_opt`` under HSDP/HFSDP), ``tp``, and ``expt_dp`` for expert parameters; its
full-shard hybrid rank is what Megatron's own method computes from those groups.
Dense ZeRO-0 and ZeRO-3, TP2, HSDP, HFSDP and expert parameters (EP2) on shardwise's GPT.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch.distributed as dist
import torch
from torch.distributed.tensor import DTensor, Replicate

from shardwise.megatron import DistributedDataParallelConfig, FullyShardedDataParallel, TransformerConfig
from shardwise.megatron import build_process_groups
from shardwise.models import GPT, GPTConfig

from tests.helpers.distributed import device, run_distributed

pytest.importorskip("megatron.core", reason="Megatron-FSDP's FSDPDistributedIndex is the reference")

MOE = dict(layer_pattern="AE", moe_num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.0)
MODEL_PARALLEL = ("tp", "ep")


def megatron_index_names() -> set[str]:
    """Every attribute ``FSDPDistributedIndex.__init__`` sets and every public method, from its source."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex

    tree = ast.parse(textwrap.dedent(inspect.getsource(FSDPDistributedIndex)))
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
             and isinstance(node.value, ast.Name) and node.value.id == "self" and isinstance(node.ctx, ast.Store)}
    names |= {node.name for node in tree.body[0].body if isinstance(node, ast.FunctionDef)}  # the methods
    return {n for n in names if not n.startswith("_")}


def _ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group)


def _check(case: str) -> int:
    from megatron.core.distributed.fsdp.src.megatron_fsdp.utils import FSDPDistributedIndex as Megatrons

    tp, ep, instances, strategy, outer = {
        "zero3_tp2": (2, 1, 1, "optim_grads_params", "no_shard"),
        "zero0": (1, 1, 1, "no_shard", "no_shard"),
        "hsdp": (1, 1, 2, "optim_grads_params", "no_shard"),
        "hfsdp": (1, 1, 2, "optim_grads_params", "optim"),
        "ep2": (1, 2, 1, "optim_grads_params", "no_shard"),
    }[case]
    pg = build_process_groups(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                              num_distributed_optimizer_instances=instances)
    torch.manual_seed(0)
    moe = MOE if ep > 1 else {}
    model = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16,
                          tp_group=pg.tp if tp > 1 else None, ep_group=pg.ep if ep > 1 else None, **moe))
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=tp,
                               expert_model_parallel_size=ep, num_moe_experts=4 if ep > 1 else None)
    ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                                        outer_dp_sharding_strategy=outer, num_distributed_optimizer_instances=instances)
    chunk = FullyShardedDataParallel(config, ddp, model, device=device(), pg_collection=pg)
    wanted = megatron_index_names()
    checked = 0
    for name, param in chunk.named_parameters():
        assert isinstance(param, DTensor), name
        index, where = param.megatron_fsdp_dist_index, param.megatron_fsdp_slice
        missing = {n for n in wanted if not hasattr(index, n)}
        assert not missing, (name, missing)
        # the slice: where torch puts this rank's shard in the per-model-parallel-rank weight
        names = param.device_mesh.mesh_dim_names
        keep = [p if n in MODEL_PARALLEL else Replicate() for n, p in zip(names, param.placements)]
        per_rank = param.redistribute(param.device_mesh, keep).to_local().reshape(-1)
        assert where.stop - where.start == param.to_local().numel(), name
        assert torch.equal(per_rank[where], param.to_local().reshape(-1)), name
        # the groups, as Megatron's adapter builds its index from pg_collection
        expert = ".experts." in f".{name}"
        hybrid = instances > 1 and not expert
        inner = pg.expt_dp if expert else pg.intra_dp_cp if hybrid else pg.dp_cp
        assert index.get_submesh([index.tp_dim], is_expert_parallel=expert).mesh.numel() == tp, name
        if tp > 1 and not expert:
            assert _ranks(index.get_submesh(index.tp_dim).get_group()) == _ranks(pg.tp), name
        if strategy == "no_shard":  # each rank holds the whole tensor: its inner axis is itself, replicas outer
            assert _ranks(index.fsdp_group) == [dist.get_rank()] and _ranks(index.outer_fsdp_group) == _ranks(inner)
            assert index.use_hybrid_fsdp and not index.hsdp_outer_dp_shard
        else:
            assert _ranks(index.get_fsdp_group(is_expert_parallel=expert)) == _ranks(inner), name
            assert index.use_hybrid_fsdp == hybrid and index.hsdp_outer_dp_shard == (hybrid and outer == "optim")
        if hybrid:
            assert _ranks(index.get_outer_fsdp_group()) == _ranks(pg.inter_dist_opt), name
            assert _ranks(index.get_dp_group()) == _ranks(pg.dp_cp), name
        if index.hsdp_outer_dp_shard:  # Megatron's own method on these groups
            assert index.get_logical_hybrid_fsdp_rank() == Megatrons.get_logical_hybrid_fsdp_rank(index), name
        checked += 1
    return checked


@pytest.mark.parametrize("case", ["zero3_tp2", "zero0", "hsdp", "hfsdp", "ep2"])
def test_every_parameter_carries_megatron_fsdps_checkpoint_attributes(case):
    assert all(n > 0 for n in run_distributed(_check, 4, case))
