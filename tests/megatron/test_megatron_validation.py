"""V2's ``_validate_config``: one test per rule, each asserting the ValueError names its field."""

from __future__ import annotations

import logging
import re

import pytest
import torch.distributed as dist
import torch.nn as nn

from shardwise.megatron import (
    DistributedDataParallelConfig,
    FullyShardedDataParallelV2,
    ProcessGroupCollection,
    TransformerConfig,
    build_process_groups,
)
from shardwise.megatron.options import logger
from shardwise.models import GPT, GPTConfig

from tests.helpers.distributed import device, run_distributed

GROUP = object()  # stands in for a process group where only its presence is checked
V2 = FullyShardedDataParallelV2


def _validate(config=None, ddp=None, module=None, pg="default", disable_bucketing=False):
    pg = ProcessGroupCollection(dp_cp=GROUP) if pg == "default" else pg
    V2._validate_config(
        config or TransformerConfig(),
        ddp or DistributedDataParallelConfig(megatron_fsdp_version=2, data_parallel_sharding_strategy="optim_grads_params"),
        module or nn.Linear(2, 2),
        pg,
        disable_bucketing,
    )


def _ddp(**kw):
    fields = dict(megatron_fsdp_version=2, data_parallel_sharding_strategy="optim_grads_params")
    fields.update(kw)
    return DistributedDataParallelConfig(**fields)


def _rejects(field, **kwargs):
    with pytest.raises(ValueError, match=re.escape(field)):
        _validate(**kwargs)


def test_a_supported_configuration_passes():
    _validate()
    _validate(ddp=_ddp(data_parallel_sharding_strategy="no_shard"))
    _validate(ddp=_ddp(fsdp_double_buffer=True, megatron_fsdp_max_pool_double_buffer=True))  # allocators: ignored
    _validate(
        ddp=_ddp(num_distributed_optimizer_instances=2, outer_dp_sharding_strategy="optim"),
        pg=ProcessGroupCollection(dp_cp=GROUP, intra_dp_cp=GROUP, inter_dist_opt=GROUP),
    )


class _Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _buffer_flags_are_said_to_be_ignored(flags):
    said, level = _Said(), logger.level
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    try:
        V2(TransformerConfig(), _ddp(**flags), nn.Linear(2, 2), device=device(), pg_collection=build_process_groups())
    finally:
        logger.removeHandler(said)
        logger.setLevel(level)
    return [m.split(" is accepted and ignored")[0] for m in said.messages if "accepted and ignored" in m]


def test_allocator_flags_are_accepted_and_said_to_be_ignored_once_on_every_rank():
    flags = dict(fsdp_double_buffer=True, megatron_fsdp_max_pool_double_buffer=True)
    both, neither = run_distributed(_buffer_flags_are_said_to_be_ignored, 2, flags)
    expected = [f"FullyShardedDataParallelV2: {field}=True" for field in flags]
    assert sorted(both) == sorted(neither) == sorted(expected)  # each flag once, on every rank
    assert run_distributed(_buffer_flags_are_said_to_be_ignored, 2, {}) == [[], []]  # unset: nothing said


def test_disable_bucketing():
    _rejects("disable_bucketing", disable_bucketing=True)


def test_missing_dp_cp_group():
    _rejects("dp_cp", pg=ProcessGroupCollection())
    _rejects("dp_cp", pg=None)


def test_missing_pg_collection_in_the_constructor():
    with pytest.raises(ValueError, match="pg_collection"):
        V2(TransformerConfig(), _ddp(), nn.Linear(2, 2))


def test_pipeline_parallel_size_not_composed_yet():
    _rejects("pipeline_model_parallel_size", config=TransformerConfig(pipeline_model_parallel_size=2))


def test_context_parallel_needs_its_cp_group():
    # CP itself is composed (tests/megatron/test_megatron_context_parallel.py); the collection must hold a cp group
    _rejects("context_parallel_size=2 needs pg_collection.cp with 2 ranks, got missing",
             config=TransformerConfig(context_parallel_size=2))


def test_tensor_parallel_needs_its_tp_group():
    # TP itself is composed (tests/megatron/test_megatron_tp_ep.py); the collection must hold a tp group of that size
    _rejects("pg_collection.tp", config=TransformerConfig(tensor_model_parallel_size=2))


def test_expert_parallel_without_ep_group():
    _rejects("pg_collection.ep", config=TransformerConfig(expert_model_parallel_size=2))


@pytest.mark.parametrize(
    "ddp,field",
    [
        (dict(data_parallel_sharding_strategy="zero3"), "data_parallel_sharding_strategy"),
        (dict(outer_dp_sharding_strategy="optim_grads_params"), "outer_dp_sharding_strategy"),
        (dict(outer_dp_sharding_strategy="optim"), "outer_dp_sharding_strategy"),  # needs instances > 1
        (dict(num_distributed_optimizer_instances=0), "num_distributed_optimizer_instances"),
        (dict(num_distributed_optimizer_instances=2, outer_dp_sharding_strategy="optim",
              data_parallel_sharding_strategy="optim_grads"), "outer_dp_sharding_strategy"),
    ],
)
def test_sharding_strategies(ddp, field):
    _rejects(field, ddp=_ddp(**ddp), pg=ProcessGroupCollection(dp_cp=GROUP, intra_dp_cp=GROUP, inter_dist_opt=GROUP))


@pytest.mark.parametrize("missing", ["intra_dp_cp", "inter_dist_opt"])
def test_hybrid_needs_both_hybrid_groups(missing):
    groups = {"dp_cp": GROUP, "intra_dp_cp": GROUP, "inter_dist_opt": GROUP}
    del groups[missing]
    _rejects(missing, ddp=_ddp(num_distributed_optimizer_instances=2), pg=ProcessGroupCollection(**groups))


# every option V2 refuses by name: tests/megatron/test_megatron_options.py, from the one table


def test_cuda_graph_impl():
    _rejects("cuda_graph_impl", config=TransformerConfig(cuda_graph_impl="local"))
    _rejects("cuda_graph_impl", config=TransformerConfig(cuda_graph_impl="full_iteration"))


def test_nccl_ub_is_accepted_with_or_without_symmetric_registration():
    # (what it does: tests/megatron/test_megatron_nccl_ub.py)
    _validate(ddp=_ddp(nccl_ub=True))
    _validate(ddp=_ddp(nccl_ub=True, disable_symmetric_registration=True, fsdp_manual_registration=True))
    _rejects("fsdp_manual_registration", ddp=_ddp(fsdp_manual_registration=True))  # without nccl_ub: no pool


@pytest.mark.parametrize("field,value", [("num_buckets", 4), ("suggested_communication_unit_size", 1 << 20)])
def test_communication_sizing_options_are_accepted(field, value):
    # Megatron-FSDP does not read them either (ignored, tests/megatron/test_megatron_options.py)
    _validate(ddp=_ddp(**{field: value}))


# ------------------------------------------- rules that need real process groups
# Each rule runs on a 2-rank gloo group (the pool of workers is shared, so a test costs little).
_MOE = dict(vocab_size=16, dim=16, n_layers=1, n_heads=2, layer_pattern="E", moe_num_experts=2)
_EP2 = dict(expert_model_parallel_size=2, num_moe_experts=2)


def _pg(*names, **extra):
    """A collection whose ``dp_cp`` and each named group are the 2-rank world."""
    world = dist.group.WORLD
    return ProcessGroupCollection(dp_cp=world, **{n: world for n in names}, **extra)


def _rejects_on_groups(match, groups, config=None, moe=False):
    with pytest.raises(ValueError, match=match):
        _validate(config=TransformerConfig(**(config or {})), module=GPT(GPTConfig(**_MOE)) if moe else None,
                  pg=_pg(*groups))


def _passes_on_groups(groups, config=None):
    _validate(config=TransformerConfig(**(config or {})), pg=_pg(*groups))


@pytest.mark.parametrize("name", ["pp", "cp"])
def test_pipeline_or_context_parallel_group_of_more_than_one_rank(name):
    run_distributed(_rejects_on_groups, 2, re.escape(f"pg_collection.{name}"), [name])


def test_tp_group_whose_size_is_not_the_configs():
    run_distributed(_rejects_on_groups, 2, re.escape("tensor_model_parallel_size=1 needs pg_collection.tp"), ["tp"])


def test_expt_tp_group_whose_size_is_not_the_configs():
    run_distributed(_rejects_on_groups, 2, re.escape("expert_tensor_parallel_size=1 needs pg_collection.expt_tp"),
                    ["expt_tp"], dict(expert_tensor_parallel_size=1))


def test_unset_expert_tp_follows_the_expt_tp_group():
    # expert TP only matters with experts: unset, it follows the expt_tp group (Megatron's default: TP's size)
    run_distributed(_passes_on_groups, 2, ["expt_tp"])


def test_tp_group_of_the_configs_size_passes():
    run_distributed(_passes_on_groups, 2, ["tp"], dict(tensor_model_parallel_size=2))


@pytest.mark.parametrize(
    "config,groups,match",
    [  # not composed yet: expert TP with EP (next to TP too: an unset expert TP follows TP), experts with TP but
       # another expert TP size (TP with EP and expert TP 1 is composed: tests/megatron/test_megatron_tp_ep.py)
        (dict(tensor_model_parallel_size=2, expert_model_parallel_size=2), ["tp", "ep", "expt_dp"],
         re.escape("expert_tensor_parallel_size=2") + ".*" + re.escape("set expert_tensor_parallel_size=1")),
        (dict(expert_model_parallel_size=2, expert_tensor_parallel_size=2), ["ep", "expt_tp", "expt_dp"],
         re.escape("expert_tensor_parallel_size=2")),
        (dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1), ["tp"],
         re.escape("expert_tensor_parallel_size=1")),
    ],
    ids=["tp_with_ep_and_expert_tp", "expert_tp_with_ep", "experts_with_tp_and_another_expert_tp"],
)
def test_combinations_not_composed_yet(config, groups, match):
    run_distributed(_rejects_on_groups, 2, match, groups, config, True)


def test_ep_group_whose_size_is_not_expert_model_parallel_size():
    run_distributed(_rejects_on_groups, 2, "expert_model_parallel_size=4.*pg_collection.ep", ["ep"],
                    dict(expert_model_parallel_size=4))


def test_ep_without_the_expert_data_parallel_group():
    run_distributed(_rejects_on_groups, 2, re.escape("pg_collection.expt_dp"), ["ep"], _EP2, True)


def _ep_on_a_model_without_moe_layers():
    with pytest.raises(ValueError, match="no MoE layers"):
        _validate(config=TransformerConfig(**_EP2), module=nn.Linear(2, 2),
                  pg=build_process_groups(expert_model_parallel_size=2))


def test_ep_on_a_model_without_moe_layers():
    run_distributed(_ep_on_a_model_without_moe_layers, 2)


def _valid_ep_setup():
    _validate(config=TransformerConfig(**_EP2), module=GPT(GPTConfig(**_MOE)),
              pg=build_process_groups(expert_model_parallel_size=2))


def test_a_valid_ep_setup_passes_validation():
    run_distributed(_valid_ep_setup, 2)


def _moe_model_not_built_with_the_ep_group():
    pg = build_process_groups(expert_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"expert-parallel ranks \[\d\] \(its 'ep_group'\).*\[0, 1\]"):
        V2(TransformerConfig(**_EP2), _ddp(), GPT(GPTConfig(**_MOE)), device=device(), pg_collection=pg)


def test_the_moe_model_must_be_built_with_the_ep_group():
    run_distributed(_moe_model_not_built_with_the_ep_group, 2)


def _moe_model_built_with_the_ep_group():
    pg = build_process_groups(expert_model_parallel_size=2)
    wrapped = V2(TransformerConfig(**_EP2), _ddp(), GPT(GPTConfig(**_MOE, ep_group=pg.ep)), device=device(), pg_collection=pg)
    assert wrapped.moe_mesh.mesh_dim_names == ("expert_dp", "ep") and wrapped.mesh.mesh_dim_names == ("dp_shard",)


def test_a_moe_model_built_with_the_ep_group_wraps_on_an_expert_mesh():
    run_distributed(_moe_model_built_with_the_ep_group, 2)


def _constructor_validates():
    with pytest.raises(ValueError, match="calculate_per_token_loss"):
        V2(TransformerConfig(calculate_per_token_loss=True), _ddp(), nn.Linear(2, 2), pg_collection=build_process_groups())


def test_validation_runs_in_the_constructor_too():
    run_distributed(_constructor_validates, 2)
