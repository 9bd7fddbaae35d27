"""Megatron-LM's ``fsdp_dtensor`` checkpoints of shardwise's chunks: Megatron's adapter's keys, resharded loads.

Megatron-LM's ``checkpointing.py`` saves a Megatron-FSDP run as
``{"model": unwrap_model(chunk).state_dict_for_save_checkpoint(), "optimizer":
optimizer.sharded_state_dict(..., fsdp_dtensor)}`` through DCP, and on load builds
the same dict, ``dcp.load``s into it in place, then calls
``optimizer.load_state_dict`` and ``chunk.load_state_dict`` with it. A checkpoint of
Megatron's adapter loads into shardwise's chunk (and back) only if every key agrees.

- always (megatron-core's real classes on CPU/gloo): the keys shardwise's chunk gives
  that code path, for V1 and V2, ZeRO-0..3 and HSDP, equal the keys Megatron's
  adapter gives it. Megatron's adapter cannot be built on a CPU (its meshes are
  ``"cuda"`` by name), so the expected keys come from Megatron's own code run on
  the adapter's nesting, built from Megatron's classes as its ``__init__`` nests them
  (``adapter.module`` = a ``MegatronFSDP``, whose ``.module`` is the model, and the
  adapter's ``state_dict_for_save_checkpoint`` assignments) without sharding: its
  ``state_dict`` methods, ``unwrap_model``, ``DistributedOptimizer._param_name``.
  And a save at one data-parallel size loads at another bit for bit (parameters
  and Megatron's optimizer state), through ``dcp.save`` / ``dcp.load`` with those keys.
- with ``SHARDWISE_MEGATRON_LM`` (a Megatron-LM tree; its requirements ``six`` and ``triton`` importable):
  Megatron-LM's own ``save_checkpoint`` and ``load_checkpoint`` (``scripts/megatron_lm_checkpoint.py``),
  saved on 2 gloo processes, loaded on 2 and on 1, bit for bit.
"""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests.helpers import REPO
from tests.helpers.distributed import run_distributed
from tests.helpers.megatron_cpu import megatron_on_the_cpu, megatron_train_steps, megatron_world

pytest.importorskip("megatron.core", reason="megatron-core is a test requirement of the Megatron face")

VOCAB, SEQ = 64, 8
FSDP_DTENSOR = {"distrib_optim_sharding_type": "fsdp_dtensor"}  # what checkpointing.py passes the optimizer


# ------------------------------------------------------------------ Megatron-Core's objects
def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**overrides, num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, bf16=True,
                             params_dtype=torch.bfloat16, use_cpu_initialization=True,
                             gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0)


def _model(config, seed: int) -> nn.Module:
    """``pretrain_gpt.py``'s chunk before the data-parallel wrapper: a GPTModel under Float16Module."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return Float16Module(config, GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                                          max_sequence_length=SEQ))


def _ddp_config(strategy: str, instances: int, version: int):
    from megatron.core.distributed import DistributedDataParallelConfig

    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, use_megatron_fsdp=True,
                                        data_parallel_sharding_strategy=strategy,
                                        num_distributed_optimizer_instances=instances)
    ddp.megatron_fsdp_version = version  # the adapter's next API picks V1 / V2 by it
    return ddp


def _megatrons_nesting(config, model: nn.Module) -> nn.Module:
    """Megatron's adapter as its ``__init__`` nests it, from Megatron's classes, without sharding."""
    from megatron.core.distributed.data_parallel_base import _BaseDataParallel
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.distributed.fsdp.src.megatron_fsdp import MegatronFSDP

    inner = MegatronFSDP.__new__(MegatronFSDP)
    nn.Module.__init__(inner)
    inner.module = model
    adapter = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    _BaseDataParallel.__init__(adapter, config=config, module=inner)
    inner.state_dict_for_save_checkpoint = inner.state_dict  # the adapter's own two assignments
    adapter.state_dict_for_save_checkpoint = adapter.state_dict
    return adapter


def _expected_keys(config) -> tuple[set, set]:
    """(model keys, optimizer-state keys) Megatron's code gives Megatron's adapter's nesting."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.utils import unwrap_model

    adapter = _megatrons_nesting(config, _model(config, seed=0))
    model_keys = set(unwrap_model(adapter).state_dict_for_save_checkpoint())
    namer = SimpleNamespace(model_chunks=[adapter])
    return model_keys, {DistributedOptimizer._param_name(namer, p) for p in adapter.parameters()}


def _shardwise_chunk(config, ddp, model):
    """The chunk Megatron-LM builds after ``use_in_megatron()``: through Megatron's own class name."""
    from megatron.core.distributed import FullyShardedDataParallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    return FullyShardedDataParallel(config=config, ddp_config=ddp, module=model,
                                    pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _optimizer(chunk):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # clip_grad=0: Megatron's clipping asserts 'torch.cuda.FloatTensor' grads (left for the GPU runs)
    return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=0.0,
                                                  bf16=True, use_distributed_optimizer=True), [chunk])


def _train(chunk, optimizer, steps: int) -> None:
    megatron_train_steps(chunk, optimizer, steps, VOCAB, SEQ)


def _megatron_lm_state(chunk, optimizer, loading: bool) -> dict:
    """The ``fsdp_dtensor`` state ``checkpointing.py`` builds (``generate_state_dict``'s model and optimizer)."""
    from megatron.core.utils import unwrap_model

    return {"model": unwrap_model(chunk).state_dict_for_save_checkpoint(),
            "optimizer": optimizer.sharded_state_dict({}, is_loading=loading, metadata=FSDP_DTENSOR)}


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value.clone() if torch.is_tensor(value) else value


def _full_state(state: dict) -> dict:
    """Every tensor of a model/optimizer state as a full tensor (a collective on every rank)."""
    return {"model": {k: _full(v) for k, v in state["model"].items()},
            "optimizer": {k: {s: _full(v) for s, v in sub.items()} for k, sub in state["optimizer"]["state"].items()}}


# ------------------------------------------------------------------ the keys
CASES = [(v, s, 1) for v in (1, 2) for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")]
HSDP = [(v, "optim_grads_params", 2) for v in (1, 2)]


def _keys(cases) -> list:
    from megatron.core.utils import unwrap_model

    seen = []
    for version, strategy, instances in cases:
        with megatron_on_the_cpu():  # Megatron's own unwrap_model, before use_in_megatron replaces its names
            from megatron.core import parallel_state

            parallel_state.initialize_model_parallel(1, 1, num_distributed_optimizer_instances=instances)
            model_keys, optimizer_keys = _expected_keys(_config())
            reference = _model(_config(), seed=0).state_dict()
            parallel_state.destroy_model_parallel()
        with megatron_world(instances=instances):
            config = _config()
            chunk = _shardwise_chunk(config, _ddp_config(strategy, instances, version), _model(config, seed=0))
            case = (version, strategy, instances)
            # the nesting Megatron-LM walks: unwrap_model stops at the level, as at Megatron's MegatronFSDP
            assert unwrap_model(chunk) is chunk.module and chunk.module.module is chunk.sharded_model, case
            optimizer = _optimizer(chunk)
            _train(chunk, optimizer, steps=1)
            state = _megatron_lm_state(chunk, optimizer, loading=False)
            assert set(state["model"]) == model_keys, (case, set(state["model"]) ^ model_keys)
            named = set(state["optimizer"]["state"])
            assert named == optimizer_keys, (case, named ^ optimizer_keys)
            assert {n for n, _ in chunk.named_parameters()} == optimizer_keys, case  # no experts: names as they are
            assert set(chunk.state_dict()) == model_keys, case  # Megatron's adapter's state_dict() too
            # the values are this model's, sharded: a fresh wrap (before any step) holds the seed's weights
            fresh = _shardwise_chunk(config, _ddp_config(strategy, instances, version), _model(config, seed=0))
            saved = {k: _full(v) for k, v in unwrap_model(fresh).state_dict_for_save_checkpoint().items()}
            assert all(torch.equal(saved[f"module.{k}"], v) for k, v in reference.items() if "_extra_state" not in k)
            seen.append(case)
    return seen


def test_state_dict_keys_are_megatron_adapters_for_every_strategy():
    assert run_distributed(_keys, 2, CASES) == [CASES] * 2


@pytest.mark.slow
def test_state_dict_keys_are_megatron_adapters_under_hsdp():
    assert run_distributed(_keys, 4, HSDP) == [HSDP] * 4


# ------------------------------------------------------------------ save at one DP size, load at another
def _save(folder: str, version: int, strategy: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    with megatron_world():
        config = _config()
        chunk = _shardwise_chunk(config, _ddp_config(strategy, 1, version), _model(config, seed=1))
        optimizer = _optimizer(chunk)
        _train(chunk, optimizer, steps=2)
        state = _megatron_lm_state(chunk, optimizer, loading=False)
        full = _full_state(state)
        preprocess_state_dict_for_uneven_dtensor(state)  # as checkpointing.py does before DCP
        dcp.save(state, checkpoint_id=folder)
    return full


def _load(folder: str, version: int, strategy: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    with megatron_world():
        config = _config()
        chunk = _shardwise_chunk(config, _ddp_config(strategy, 1, version), _model(config, seed=7))
        optimizer = _optimizer(chunk)
        state = _megatron_lm_state(chunk, optimizer, loading=True)
        raw = {"model": dict(state["model"]), "optimizer": dict(state["optimizer"])}
        preprocess_state_dict_for_uneven_dtensor(state)
        dcp.load(state, checkpoint_id=folder)  # in place, into the DTensors
        optimizer.load_state_dict(raw["optimizer"])  # then checkpointing.py's two loads
        chunk.load_state_dict(raw["model"], strict=True)
        return _full_state(_megatron_lm_state(chunk, optimizer, loading=False))


def _assert_bit_equal(loaded: dict, saved: dict) -> None:
    assert loaded["model"].keys() == saved["model"].keys()
    assert loaded["optimizer"].keys() == saved["optimizer"].keys()
    for key, value in saved["model"].items():
        if torch.is_tensor(value):
            assert torch.equal(loaded["model"][key], value), key
    for key, sub in saved["optimizer"].items():
        for name, value in sub.items():
            assert torch.equal(torch.as_tensor(loaded["optimizer"][key][name]), torch.as_tensor(value)), (key, name)


@pytest.mark.parametrize("version,strategy,save_world,load_world", [
    (1, "optim_grads_params", 2, 4),
    (2, "optim", 4, 1),
    (1, "optim_grads", 1, 2),
])
def test_fsdp_dtensor_checkpoint_loads_at_another_data_parallel_size(version, strategy, save_world, load_world,
                                                                     tmp_path):
    saved = run_distributed(_save, save_world, str(tmp_path), version, strategy)[0]
    assert any(v.abs().sum() > 0 for sub in saved["optimizer"].values() for k, v in sub.items() if k == "exp_avg")
    for loaded in run_distributed(_load, load_world, str(tmp_path), version, strategy):
        _assert_bit_equal(loaded, saved)


# ------------------------------------------------------------------ Megatron-LM's own save/load
TREES = [p for p in os.environ.get("SHARDWISE_MEGATRON_LM", "").split(os.pathsep) if p]


@pytest.mark.slow
@pytest.mark.skipif(not TREES, reason="SHARDWISE_MEGATRON_LM (a Megatron-LM tree, e.g. core_r0.16.0) not set; the keys "
                                      "and DCP round trips above cover megatron-core's side")
@pytest.mark.parametrize("tree", TREES or ["unset"])
@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_megatron_lm_save_and_load_checkpoint_with_shardwise(tree, strategy, tmp_path):
    """Megatron-LM builds V1 (its releases have no ``megatron_fsdp_version``); saved on 2 ranks, loaded on 2 and 1."""
    script = REPO / "scripts" / "megatron_lm_checkpoint.py"
    for phase, world in (("save", 2), ("load", 2), ("load", 1)):
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", str(script),
             "--megatron-lm", tree, "--phase", phase, "--folder", str(tmp_path), "--strategy", strategy],
            capture_output=True, text=True, timeout=800,
        )
        assert run.returncode == 0, \
            f"{phase} on {world}: exit {run.returncode}\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
        assert f"CHECKPOINT {phase} ok" in run.stdout, run.stdout[-4000:]
