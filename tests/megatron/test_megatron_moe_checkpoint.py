"""Megatron-Core MoE models' ``fsdp_dtensor`` checkpoints through shardwise's chunks (4 gloo processes).

Megatron-LM's ``checkpointing.py`` saves ``{"model": unwrap_model(chunk).state_dict_for_save_checkpoint(),
"optimizer": optimizer.sharded_state_dict(..., fsdp_dtensor)}`` after renaming each EP rank's
``local_experts.<i>`` to its global index (``handle_experts_in_state_dict``; the optimizer names its
state the same way), then hands it to DCP. That holds only if each local expert is one tensor sharded
over the expert-data-parallel ranks, as Megatron-FSDP presents it. Here, with Megatron-Core's real
``GPTModel`` (``SequentialMLP`` experts, a shared expert) and its ``DistributedOptimizer``:

- the expert parameters and their optimizer state are those tensors (their DTensors' mesh is the
  ``expt_dp`` group, their global shape one expert's), dense ones unchanged;
- Megatron-LM's state (its ``handle_experts_in_state_dict``, ``preprocess_state_dict_for_uneven_dtensor``)
  saves through plain DCP at EP2 and loads bit for bit at EP2, EP1 and EP4 (a different number of
  local experts per rank: the global expert keys are the same), parameters and optimizer state.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import run_distributed
from tests.helpers.megatron_cpu import megatron_train_steps, megatron_world

pytest.importorskip("megatron.core", reason="megatron-core is a test requirement of the Megatron face")

VOCAB, SEQ, EXPERTS = 64, 8, 4
FSDP_DTENSOR = {"distrib_optim_sharding_type": "fsdp_dtensor"}  # what checkpointing.py passes the optimizer


def _config(ep: int, **overrides):
    from megatron.core.transformer import TransformerConfig

    fields = dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, bf16=True,
                  params_dtype=torch.bfloat16, use_cpu_initialization=True, gradient_accumulation_fusion=False,
                  hidden_dropout=0.0, attention_dropout=0.0, num_moe_experts=EXPERTS, moe_router_topk=2,
                  moe_ffn_hidden_size=24, moe_shared_expert_intermediate_size=24, moe_token_dispatcher_type="allgather",
                  moe_aux_loss_coeff=0.0, add_bias_linear=False, expert_model_parallel_size=ep)
    fields.update(overrides)
    return TransformerConfig(**fields)


def _model(config, seed: int) -> nn.Module:
    """``pretrain_gpt.py``'s MoE chunk before the data-parallel wrapper: a GPTModel under Float16Module."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    return Float16Module(config, GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ))


def _router_without_transformer_engine() -> None:
    """Megatron-Core 0.16's router reads ``moe_utils.te_general_gemm``, which it leaves undefined without
    Transformer Engine (0.19 sets it to None, its meaning: use torch's matmul); give 0.16 the same None."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@contextlib.contextmanager
def _world(ep: int):
    """Megatron's parallel state with ``ep`` expert-parallel ranks on this gloo group, torn down after."""
    _router_without_transformer_engine()
    with megatron_world(ep=ep):
        yield


def _chunk_and_optimizer(ep: int, seed: int, strategy: str):
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection

    config = _config(ep)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, use_megatron_fsdp=True,
                                        data_parallel_sharding_strategy=strategy)
    chunk = FullyShardedDataParallel(config=config, ddp_config=ddp, module=_model(config, seed),
                                     pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    # clip_grad=0: Megatron's clipping asserts 'torch.cuda.FloatTensor' grads (left for the GPU runs)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=0.0,
                                                       bf16=True, use_distributed_optimizer=True), [chunk])
    return chunk, optimizer


def _train(chunk, optimizer, steps: int) -> None:
    megatron_train_steps(chunk, optimizer, steps, VOCAB, SEQ)


def _megatron_lm_state(chunk, optimizer, loading: bool) -> dict:
    """``checkpointing.py``'s ``fsdp_dtensor`` state: model and optimizer, experts under their global index."""
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict
    from megatron.core.utils import unwrap_model

    model = handle_experts_in_state_dict(unwrap_model(chunk).state_dict_for_save_checkpoint(), EXPERTS)
    return {"model": model, "optimizer": optimizer.sharded_state_dict({}, is_loading=loading, metadata=FSDP_DTENSOR)}


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value.clone() if torch.is_tensor(value) else value


def _full_state(state: dict) -> dict:
    """Every tensor of a model/optimizer state in full, keyed by global expert: each rank's own keys."""
    return {"model": {k: _full(v) for k, v in state["model"].items() if not k.endswith("_extra_state")},
            "optimizer": {k: {s: _full(v) for s, v in sub.items()} for k, sub in state["optimizer"]["state"].items()}}


def _expert_indices(keys) -> set[int]:
    return {int(k.split("local_experts.")[1].split(".")[0]) for k in keys if "local_experts." in k}


def _presentation(ep: int) -> dict:
    """What the parameters look like to Megatron-LM's checkpoint code on this rank."""
    from megatron.core import parallel_state

    with _world(ep):
        chunk, optimizer = _chunk_and_optimizer(ep, seed=1, strategy="optim_grads_params")
        expt_dp = dist.get_process_group_ranks(parallel_state.get_expert_data_parallel_group())
        dp = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
        meshes, shapes = {}, {}
        for name, param in chunk.named_parameters():
            meshes[name] = param.device_mesh.mesh.flatten().tolist()
            shapes[name] = tuple(param.full_tensor().shape)
            assert tuple(param.shape) == shapes[name], name
        _train(chunk, optimizer, steps=1)
        state = _megatron_lm_state(chunk, optimizer, loading=False)
        return {"expt_dp": expt_dp, "dp": dp, "meshes": meshes, "shapes": shapes, "model": sorted(state["model"]),
                "optimizer": sorted(state["optimizer"]["state"])}


@pytest.mark.slow
def test_local_experts_reach_megatron_lm_as_megatron_fsdp_presents_them():
    ranks = run_distributed(_presentation, 4, 2)
    for rank, seen in enumerate(ranks):
        assert seen["expt_dp"] == [rank % 2, rank % 2 + 2] and seen["dp"] == [0, 1, 2, 3]
        experts = {n for n in seen["meshes"] if ".experts." in n}
        assert len(experts) == 2 * 2 * 2  # layers x local experts x (fc1, fc2)
        for name, mesh in seen["meshes"].items():
            assert mesh == (seen["expt_dp"] if name in experts else seen["dp"]), name
            if name.endswith("local_experts.0.linear_fc1.weight") or name.endswith("shared_experts.linear_fc1.weight"):
                assert seen["shapes"][name] == (24, 16), name  # one expert (moe_ffn_hidden_size 24 x hidden 16)
        # EP rank r holds global experts 2r, 2r + 1 (EP groups are consecutive ranks at TP 1)
        ep_rank = rank % 2
        for keys in (seen["model"], seen["optimizer"]):
            assert _expert_indices(keys) == {2 * ep_rank, 2 * ep_rank + 1}, (rank, keys)


# ------------------------------------------------------------------ save at EP2, load at EP2, EP1, EP4
def _save(folder: str, ep: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    with _world(ep):
        chunk, optimizer = _chunk_and_optimizer(ep, seed=1, strategy="optim_grads_params")
        _train(chunk, optimizer, steps=2)
        state = _megatron_lm_state(chunk, optimizer, loading=False)
        full = _full_state(state)
        preprocess_state_dict_for_uneven_dtensor(state)  # as checkpointing.py does before DCP
        dcp.save(state, checkpoint_id=folder)
    return full


def _load(folder: str, ep: int, strategy: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict
    from megatron.core.utils import unwrap_model

    with _world(ep):
        chunk, optimizer = _chunk_and_optimizer(ep, seed=7, strategy=strategy)
        raw_model = unwrap_model(chunk).state_dict_for_save_checkpoint()
        raw_optimizer = optimizer.sharded_state_dict({}, is_loading=True, metadata=FSDP_DTENSOR)
        state = {"model": handle_experts_in_state_dict(raw_model, EXPERTS), "optimizer": dict(raw_optimizer)}
        preprocess_state_dict_for_uneven_dtensor(state)
        dcp.load(state, checkpoint_id=folder)  # in place, into the DTensors
        optimizer.load_state_dict(raw_optimizer)  # then checkpointing.py's two loads, with the local keys
        chunk.load_state_dict(raw_model, strict=True)
        return _full_state(_megatron_lm_state(chunk, optimizer, loading=False))


def _assert_bit_equal(loaded: dict, saved: dict, rank: int) -> None:
    for part in ("model", "optimizer"):
        missing = set(loaded[part]) - set(saved[part])
        assert not missing, (rank, part, sorted(missing)[:4])
    for key, value in loaded["model"].items():
        assert torch.equal(value, saved["model"][key]), (rank, key)
    for key, sub in loaded["optimizer"].items():
        for name, value in sub.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(saved["optimizer"][key][name])), (rank, key, name)


@pytest.mark.slow
def test_ep2_checkpoint_loads_bit_equal_at_ep2_ep1_and_ep4(tmp_path):
    saved_by_rank = run_distributed(_save, 4, str(tmp_path), 2)
    saved = {"model": {}, "optimizer": {}}
    for state in saved_by_rank:  # each EP rank saved its own experts' keys
        for part in saved:
            saved[part].update(state[part])
    assert _expert_indices(saved["model"]) == set(range(EXPERTS))
    assert any(v.abs().sum() > 0 for key, sub in saved["optimizer"].items() if "local_experts" in key
               for name, v in sub.items() if name == "exp_avg")
    for ep, strategy in ((2, "optim_grads_params"), (1, "optim"), (4, "optim_grads_params")):
        for rank, loaded in enumerate(run_distributed(_load, 4, str(tmp_path), ep, strategy)):
            assert len(_expert_indices(loaded["model"])) == EXPERTS // ep, (ep, rank)
            _assert_bit_equal(loaded, saved, rank)
