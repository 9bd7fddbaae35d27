"""What ``fully_shard`` refuses at wrap time, with an error naming the argument and its value."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shardwise

from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM


class _TrainableFp8Param(nn.Module):
    """A trainable FP8 parameter (frozen ones of other dtypes are sharded as they are, as FSDP2 shards them)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.counts = nn.Parameter(torch.zeros(3).to(torch.float8_e4m3fn))


class _ScalarParam(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.temperature = nn.Parameter(torch.tensor(1.0))


def _bad_inputs():
    from torch.distributed.tensor import Replicate, Shard

    errors = {}

    def capture(key, fn):
        try:
            fn()
        except (ValueError, TypeError) as exc:
            errors[key] = f"{type(exc).__name__}: {exc}"
        else:
            errors[key] = None

    model = lambda: TinyLM(TinyConfig())  # noqa: E731
    capture("strategy", lambda: shardwise.fully_shard(model(), strategy="zero5"))
    capture(
        "outer",
        lambda: shardwise.fully_shard(
            model(), shardwise.build_dp_mesh(outer=1), strategy="optim_grads", outer_dp_sharding_strategy="optim"
        ),
    )
    capture("outer_without_mesh", lambda: shardwise.fully_shard(model(), outer_dp_sharding_strategy="no_shard"))
    capture(
        "axis",
        lambda: shardwise.fully_shard(
            model(), shardwise.build_dp_mesh(), placements={"dp_foo": shardwise.AxisPlacements(Shard(0), Shard(0), Shard(0))}
        ),
    )
    capture(
        "placement",
        lambda: shardwise.fully_shard(
            model(), shardwise.build_dp_mesh(), placements={"dp_shard": shardwise.AxisPlacements(Shard(0), Replicate(), Shard(0))}
        ),
    )
    capture("unit_type", lambda: shardwise.fully_shard(model(), unit_modules=[nn.GRU]))
    capture("unit_instance", lambda: shardwise.fully_shard(model(), unit_modules=[nn.Linear(2, 2)]))
    capture("dtype", lambda: shardwise.fully_shard(_TrainableFp8Param()))
    capture("scalar", lambda: shardwise.fully_shard(_ScalarParam()))
    capture("precision", lambda: shardwise.MixedPrecisionPolicy(param_dtype=torch.int8))
    wrapped = shardwise.fully_shard(model(), unit_modules=[Block])
    capture("twice", lambda: shardwise.fully_shard(wrapped))
    inner = model()
    shardwise.fully_shard(inner.blocks[0])
    shardwise.fully_shard(inner)  # FSDP2's bottom-up order; a call on the inner module after it is not
    capture("inner_after_root", lambda: shardwise.fully_shard(inner.blocks[1]))
    # values of the wrong type that used to be accepted with a surprising meaning
    capture("strategy_bool", lambda: shardwise.fully_shard(model(), strategy=True))
    capture("placements_bool", lambda: shardwise.fully_shard(model(), placements=True))
    capture("bucket_bool", lambda: shardwise.fully_shard(model(), bucket_size=True))
    capture("reshard_str", lambda: shardwise.fully_shard(model(), reshard_after_forward="no"))
    capture("prefetch_int", lambda: shardwise.fully_shard(model(), prefetch=1))
    capture("reduction", lambda: shardwise.fully_shard(model(), gradient_reduction="avg"))
    capture("init_fn", lambda: shardwise.fully_shard(model(), init_fn=5))
    capture("mesh_str", lambda: shardwise.fully_shard(model(), mesh="dp"))
    from shardwise.megatron import DistributedDataParallelConfig, TransformerConfig

    capture("megatron_bool", lambda: TransformerConfig(bf16="false"))
    capture("megatron_int", lambda: DistributedDataParallelConfig(bucket_size=True))
    from shardwise.megatron import FullyShardedDataParallel

    capture("megatron_module", lambda: FullyShardedDataParallel(
        TransformerConfig(), DistributedDataParallelConfig(use_megatron_fsdp=True), "x"))
    capture("megatron_tp_str", lambda: TransformerConfig(tensor_model_parallel_size="2"))
    return errors


EXPECTED_ERRORS = {
    "strategy": "strategy='zero5'",
    "outer": "outer_dp_sharding_strategy='optim'",
    "outer_without_mesh": "outer_dp_sharding_strategy='no_shard' needs a 2-D mesh",
    "axis": "'dp_foo'",
    "placement": "placements['dp_shard']",
    "unit_type": "GRU",
    "unit_instance": "unit_modules entry Linear",
    "dtype": "'counts' has dtype torch.float8_e4m3fn and requires grad",
    "scalar": "'temperature' is 0-dimensional",
    "precision": "MixedPrecisionPolicy.param_dtype=torch.int8",
    "twice": "already sharded",
    "inner_after_root": "is already sharded, by the fully_shard call on an ancestor",
    "strategy_bool": "strategy=True",
    "placements_bool": "strategy=True",
    "bucket_bool": "bucket_size=True",
    "reshard_str": "reshard_after_forward='no' must be a bool, None or an int",
    "prefetch_int": "prefetch=1 must be a bool",
    "reduction": "gradient_reduction='avg'",
    "init_fn": "init_fn=5",
    "mesh_str": "ValueError: mesh='dp' must be a torch.distributed.DeviceMesh or None",
    "megatron_bool": "TransformerConfig.bf16='false' must be bool",
    "megatron_int": "DistributedDataParallelConfig.bucket_size=True must be None or int",
    "megatron_module": "module='x' must be a torch.nn.Module",
    "megatron_tp_str": "TransformerConfig.tensor_model_parallel_size='2' must be int",
}


def test_bad_input_raises_early_naming_the_argument():
    (errors,) = run_distributed(_bad_inputs, 1)
    for key, fragment in EXPECTED_ERRORS.items():
        assert errors[key] is not None, f"{key}: no error raised"
        assert fragment in errors[key], f"{key}: {errors[key]!r} does not mention {fragment!r}"


def _wrap_with(collectives):
    shardwise.fully_shard(TinyLM(TinyConfig()), collectives=collectives)


def test_collectives_of_the_wrong_type_are_refused_at_wrap_time():
    with pytest.raises(AssertionError, match="collectives must be a shardwise.Collectives or None, got dict"):
        run_distributed(_wrap_with, 1, {})
