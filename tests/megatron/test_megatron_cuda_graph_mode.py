"""``megatron_fsdp_cuda_graph_mode=True`` (Megatron-LM's ``--cuda-graph-impl full_iteration``) on gloo, V1 and V2.

Megatron-LM captures forward and backward of every micro-batch and ``finalize_model_grads``
(the chunk's ``finish_grad_sync`` and ``scale_gradients``) in one CUDA graph, and runs
``zero_grad_buffer``, the optimizer step (``copy_main_weights_to_model_weights``) and
``start_param_sync`` eagerly around each replay. So, with Megatron-Core's own GPTModel,
DDP config and ``DistributedOptimizer`` and Megatron-LM's step in miniature:

- every engine buffer the captured region touches (gathered weights, gradient buffers, staging
  pool) and every ``.grad`` the optimizer reads keeps its address over 4 steps, and the ``.grad``
  tensors stay the very same objects, installed even right after ``zero_grad_buffer`` (zeroed
  in place): a replay runs no Python to install them again;
- no host synchronisation in the region Megatron-LM captures (``count_host_syncs``);
- the eager optimizer step leaves the compute weights marked changed (the next forward, the
  captured one, rebuilds them; ``fsdp_all_gather_in_start_param_sync=False``: no gather in
  ``start_param_sync``), and with it True ``start_param_sync`` rebuilds them now;
- losses and weights equal to graph mode off, bit for bit;
- what a captured iteration cannot hold is refused at wrap time by field and value.

Megatron-Core 0.16 (installed) has no ``megatron_fsdp_cuda_graph_mode`` field (0.19 does): it is
set on the real object after construction, as Megatron-LM 0.19's ``kwargs`` would.
Capture and replay need a GPU: ``scripts/megatron_lm_pretrain.py --cuda-graphs``.
"""

from __future__ import annotations

import contextlib
import re
import traceback

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardwise.engine.model_ops import sharded_state
from shardwise.engine.param_group import RefreshState
from shardwise.megatron import FullyShardedDataParallelV1, FullyShardedDataParallelV2, ProcessGroupCollection
from shardwise.megatron.options import GRAPH_SAFE_REFUSALS, V1, V2, UnsupportedMegatronOption
from tests.helpers.distributed import run_distributed
from tests.helpers.graph_safe import engine_addresses
from tests.helpers.host_syncs import HostSyncs
from tests.helpers.megatron_cpu import megatron_world
from tests.helpers.tiny_model import TinyConfig, TinyLM

pytest.importorskip("megatron.core", reason="megatron-core is a test requirement of the Megatron face")

VOCAB, SEQ, STEPS, MICRO = 64, 8, 4, 2
# How Megatron-LM's schedule accumulates the micro-batches of a step: under no_sync (with --overlap-grad-reduce,
# its no_sync_func) or, by default, with every backward syncing and adding to the installed .grad
NO_SYNC, SYNC_EACH = "no_sync", "sync_each"
FACES = {V1: FullyShardedDataParallelV1, V2: FullyShardedDataParallelV2}


# ------------------------------------------------------------------ Megatron-Core's objects
def _config(**overrides):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**{**dict(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
                                       bf16=True, params_dtype=torch.bfloat16, use_cpu_initialization=True,
                                       gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0),
                                **overrides})


def _ddp_config(version: int, strategy: str, graph: bool, gather_in_start_param_sync: bool = False):
    from megatron.core.distributed import DistributedDataParallelConfig

    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, use_megatron_fsdp=True,
                                        data_parallel_sharding_strategy=strategy, check_for_nan_in_grad=False)
    ddp.megatron_fsdp_version = version
    if graph:  # what Megatron-LM 0.19 passes with --use-megatron-fsdp --cuda-graph-impl full_iteration
        ddp.megatron_fsdp_cuda_graph_mode = True
        ddp.fsdp_all_gather_in_start_param_sync = gather_in_start_param_sync
    return ddp


def _chunk(config, ddp, graph_impl=None):
    """``pretrain_gpt.py``'s chunk (GPTModel under Float16Module) through Megatron's own class name."""
    from megatron.core.distributed import FullyShardedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection as MegatronGroups
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = Float16Module(config, GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                                           max_sequence_length=SEQ))
    if graph_impl is not None:  # Megatron-LM's --cuda-graph-impl, seen by the wrapper (the model is built without)
        config.cuda_graph_impl = graph_impl
    return FullyShardedDataParallel(config=config, ddp_config=ddp, module=model,
                                    pg_collection=MegatronGroups.use_mpu_process_groups())


def _optimizer(chunk):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # clip_grad=0: Megatron's clipping asserts 'torch.cuda.FloatTensor' grads (left for the GPU run)
    return get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1, clip_grad=0.0,
                                                  bf16=True, use_distributed_optimizer=True), [chunk])


# ------------------------------------------------------------------ Megatron-LM's step in miniature
class _DeviceSyncs(HostSyncs):
    """``count_host_syncs`` less Megatron-Core 0.16's RNG-tracker check, which compares the *host* RNG state
    (CPU tensors: no device wait on a GPU either) after each attention's ``fork()``."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.events)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.events) > before and any(f.filename.endswith("tensor_parallel/random.py")
                                             for f in traceback.extract_stack()):
            del self.events[before:]
        return out


def _captured_region(chunk, step: int, accumulation: str) -> torch.Tensor:
    """What FullCudaGraphWrapper captures: every micro-batch (``no_sync`` but the last, where Megatron-LM sets
    its ``no_sync_func``) and finalize_model_grads."""
    position_ids = torch.arange(SEQ).unsqueeze(0)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    losses = []
    for micro in range(MICRO):
        generator = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
        with chunk.no_sync() if accumulation == NO_SYNC and micro < MICRO - 1 else contextlib.nullcontext():
            loss = chunk(tokens, position_ids, mask, labels=tokens).float().mean()
            loss.backward()
        losses.append(loss.detach())
    chunk.finish_grad_sync()
    chunk.scale_gradients(torch.tensor(1.0 / MICRO))  # a device tensor, as 1 / num_tokens is
    return torch.stack(losses)


def _grads(chunk) -> list:
    return [p.grad for p in chunk.parameters() if p.requires_grad]


def _train(version: int, strategy: str, graph: bool, gather_in_start_param_sync: bool = False,
           accumulation: str = NO_SYNC) -> dict:
    with megatron_world():
        config = _config()
        chunk = _chunk(config, _ddp_config(version, strategy, graph, gather_in_start_param_sync))
        optimizer = _optimizer(chunk)
        groups = [g for g in sharded_state(chunk.sharded_model).groups if g.requires_grad]
        seen = dict(losses=[], addresses=[], grad_ptrs=[], grad_ids=[], syncs=[], zeroed=[], stale=[])
        for step in range(STEPS):
            chunk.zero_grad_buffer()  # train_step's, then the optimizer's (which calls it again)
            optimizer.zero_grad()
            grads = _grads(chunk)
            seen["zeroed"].append(None if any(g is None for g in grads) else
                                  all(not g.to_local().any() for g in grads))
            with _DeviceSyncs() as syncs:
                losses = _captured_region(chunk, step, accumulation)
            seen["syncs"].append(syncs.events)
            grads = _grads(chunk)
            seen["grad_ptrs"].append([g.to_local().data_ptr() for g in grads])
            seen["grad_ids"].append([id(g) for g in grads])
            ok, _, _ = optimizer.step()  # copy_main_weights_to_model_weights, then start_param_sync
            assert ok
            seen["stale"].append(all(g.refresh_state is RefreshState.STALE for g in groups))
            seen["losses"].append(losses.tolist())
            seen["addresses"].append(engine_addresses(chunk.sharded_model))
        seen["weights"] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                           for k, v in chunk.sharded_model.state_dict().items() if torch.is_tensor(v)}
        seen["graph_safe"] = sharded_state(chunk.sharded_model).graph_safe
        return seen


# Megatron-Core 0.16's defaults (preserve_fp32_weights, no grad_reduce_in_fp32) as 0.19's under Megatron-LM: fp32
# main weights and bf16 main grads, so .grad is a cast copy that each syncing micro-batch adds to
CASES = [(1, "optim", SYNC_EACH), (1, "optim_grads", NO_SYNC), (1, "optim_grads_params", SYNC_EACH),
         (2, "optim_grads_params", NO_SYNC), (2, "optim_grads_params", SYNC_EACH)]


@pytest.mark.parametrize("version,strategy,accumulation", CASES, ids=[f"v{v}-{s}-{a}" for v, s, a in CASES])
def test_graph_mode_keeps_addresses_syncs_nothing_and_trains_as_eager(version, strategy, accumulation):
    eager = run_distributed(_train, 2, version, strategy, False, False, accumulation)
    graph = run_distributed(_train, 2, version, strategy, True, False, accumulation)
    for off, on in zip(eager, graph):
        assert on["graph_safe"] and not off["graph_safe"]
        assert on["losses"] == off["losses"], "graph mode must train bit for bit as the eager mode"
        for key, value in off["weights"].items():
            assert torch.equal(on["weights"][key], value), key
        # from the second step on (what Megatron-LM captures after its warm-up steps): the first starts from
        # fresh weights, later ones rebuild them after the optimizer step, which may take more staging buffers
        first = on["addresses"][1]
        moved = sorted({k for a in on["addresses"][2:] for k in set(a) | set(first) if a.get(k) != first.get(k)})
        assert not moved, f"engine buffers moved or appeared: {moved}"
        assert all(p == on["grad_ptrs"][0] for p in on["grad_ptrs"][1:]), ".grad must view the same memory"
        assert all(i == on["grad_ids"][0] for i in on["grad_ids"][1:]), ".grad must stay the same tensors"
        # step 0 starts with no grads; from then on zero_grad_buffer zeroes them where they are
        assert on["zeroed"] == [None] + [True] * (STEPS - 1), on["zeroed"]
        assert off["zeroed"] == [None] * STEPS  # eager mode drops them (the contrast the replay needs)
        assert on["syncs"] == [[]] * STEPS, f"host synchronisations in the captured region: {on['syncs']}"
        # the eager optimizer step only marks the weights changed: the (captured) forward rebuilds them
        assert on["stale"] == [True] * STEPS
    if strategy != "optim_grads_params":  # ZeRO-1/2: eager mode rebuilds them in the optimizer step
        assert all(off["stale"] == [False] * STEPS for off in eager)


def test_fsdp_all_gather_in_start_param_sync_true_rebuilds_now():
    # graph mode with the gather left in start_param_sync (V1, ZeRO-1: replicated compute weights)
    for seen in run_distributed(_train, 2, 1, "optim", True, True):
        assert seen["stale"] == [False] * STEPS


# ------------------------------------------------------------------ refusals at wrap time
_TRIGGER = {"check_for_nan_in_grad": True, "num_moe_experts": 4, "expert_model_parallel_size": 2,
            "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
            "cpu_offloading": True, "fine_grained_activation_offloading": True}
REFUSALS = [(face, row) for row in GRAPH_SAFE_REFUSALS for face in FACES]


def _real_configs(graph: bool):
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    ddp.megatron_fsdp_cuda_graph_mode = graph
    return config, ddp


def _wrap(face, config, ddp):
    pg = ProcessGroupCollection(dp_cp=object()) if face == V2 else None
    return FACES[face](config=config, ddp_config=ddp, module=TinyLM(TinyConfig()), pg_collection=pg)


def test_every_graph_mode_row_has_a_trigger():
    assert {row.name for row in GRAPH_SAFE_REFUSALS} == set(_TRIGGER)


@pytest.mark.parametrize("face,row", REFUSALS, ids=[f"{f[-2:]}-{r.name}" for f, r in REFUSALS])
def test_graph_mode_refuses_what_a_capture_cannot_hold(face, row):
    value = _TRIGGER[row.name]
    config, ddp = _real_configs(graph=True)
    setattr(ddp if row.source == "DistributedDataParallelConfig" else config, row.name, value)
    with pytest.raises(UnsupportedMegatronOption, match=re.escape(f"{face} does not support {row.name}={value!r}")):
        _wrap(face, config, ddp)


def _refused_off_graph_mode(face, row) -> bool:
    """Outside graph mode the same value is not refused by the graph-mode table (the row is that table's)."""
    config, ddp = _real_configs(graph=False)
    setattr(ddp if row.source == "DistributedDataParallelConfig" else config, row.name, _TRIGGER[row.name])
    try:
        _wrap(face, config, ddp)
    except Exception as err:  # refused or failing for other reasons: only the graph-mode message matters
        return "megatron_fsdp_cuda_graph_mode" in str(err)
    return False


@pytest.mark.parametrize("face", FACES)
def test_graph_mode_rows_apply_only_in_graph_mode(face):
    assert not any(_refused_off_graph_mode(face, row) for row in GRAPH_SAFE_REFUSALS)


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("impl", ["local", "transformer_engine", "full_iteration"])
def test_cuda_graphs_without_graph_mode_are_refused(face, impl):
    config, ddp = _real_configs(graph=False)
    config.cuda_graph_impl = impl  # 0.19's value set on 0.16's object, after its own checks
    with pytest.raises(UnsupportedMegatronOption, match=re.escape(f"{face} does not support cuda_graph_impl={impl!r}")):
        _wrap(face, config, ddp)


def _wraps_per_layer_graphs(face, impl) -> bool:
    """Megatron-LM 0.19 sets megatron_fsdp_cuda_graph_mode for --cuda-graph-impl local / transformer_engine and
    keeps the NaN check (finish_grad_sync is not captured there): graph-safe, NaN check allowed. (The model is
    built without graphs: Megatron-Core's own graph manager wants a CUDA-graph-safe RNG tracker, a GPU matter.)"""
    with megatron_world():
        ddp = _ddp_config(int(face[-1]), "optim_grads_params", True, gather_in_start_param_sync=True)
        ddp.check_for_nan_in_grad = True
        chunk = _chunk(_config(), ddp, graph_impl=impl)
        return sharded_state(chunk.sharded_model).graph_safe


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_per_layer_graphs_in_graph_mode_wrap_graph_safe(face, impl):
    assert run_distributed(_wraps_per_layer_graphs, 1, face, impl) == [True]


def _wraps_full_iteration(face) -> bool:
    with megatron_world():
        config = _config()
        config.cuda_graph_impl = "full_iteration"
        chunk = _chunk(config, _ddp_config(int(face[-1]), "optim_grads_params", True))
        return sharded_state(chunk.sharded_model).graph_safe


@pytest.mark.parametrize("face", FACES)
def test_full_iteration_in_graph_mode_wraps_graph_safe(face):
    assert run_distributed(_wraps_full_iteration, 1, face) == [True]


def _wrap_under_megatron_lm_args(flags: dict, graph: bool, swiglu: bool) -> str:
    """Wrap with Megatron-LM's parsed flags where its training scripts leave them (the module global)."""
    import argparse
    import sys
    import types

    module = types.ModuleType("megatron.training.global_vars")
    module._GLOBAL_ARGS = argparse.Namespace(**flags)
    sys.modules["megatron.training.global_vars"] = module
    try:
        with megatron_world():
            _chunk(_config(gated_linear_unit=swiglu), _ddp_config(1, "optim", graph))
        return "wrapped"
    except UnsupportedMegatronOption as refused:
        return str(refused)
    finally:
        del sys.modules["megatron.training.global_vars"]


def test_megatron_lms_flags_are_refused_at_wrap_time_where_the_run_would_go_wrong():
    base = dict(global_batch_size=8, micro_batch_size=2, data_parallel_size=2, save=None, load=None,
                ckpt_format="fsdp_dtensor")
    # two micro-batches per step in graph mode: accepted (trains as eager, see the test above)
    assert run_distributed(_wrap_under_megatron_lm_args, 2, base, True, False)[0] == "wrapped"
    assert run_distributed(_wrap_under_megatron_lm_args, 2, base, False, False)[0] == "wrapped"
    # --swiglu with fsdp_dtensor checkpoints: the parameters carry Megatron-FSDP's checkpoint attributes
    # (tests/megatron/test_megatron_swiglu_checkpoint.py)
    saving = {**base, "save": "/ckpt"}
    assert run_distributed(_wrap_under_megatron_lm_args, 2, saving, False, True)[0] == "wrapped"
