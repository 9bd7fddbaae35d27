"""Hugging Face Accelerate's FSDP2 path with shardwise's ``fully_shard`` in place of torch's.

``accelerate.utils.fsdp_utils.fsdp2_prepare_model`` imports ``fully_shard`` from ``torch.distributed.fsdp``
when it runs, so the test rebinds that one attribute for the duration of ``Accelerator.prepare`` and nothing
else. On a tiny transformers ``LlamaForCausalLM`` (built from a config, no download) Accelerate makes the
decoder layers units (its transformer wrap policy), then ``embed_tokens``, ``[norm, lm_head]`` and the root,
and trains with its own ``accumulate`` (``set_requires_gradient_sync``), ``backward`` and
``clip_grad_norm_``. The same worker runs torch's FSDP2 first.
"""

from __future__ import annotations

import accelerate  # noqa: F401  (the test extra installs it; fail loudly when it is missing)
import pytest

from tests.helpers.distributed import run_distributed

MICRO_STEPS = 10
ACCUM = 2
BATCH, SEQ, VOCAB = 2, 32, 128


def _model(tied: bool, seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         tie_word_embeddings=tied, attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _accelerator(mixed: str, efficient_loading: bool):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType

    import os

    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))  # else Accelerate sets the threads
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
        cpu_ram_efficient_loading=efficient_loading, state_dict_type="SHARDED_STATE_DICT",
    )
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision=mixed, gradient_accumulation_steps=ACCUM)
    # Accelerate turns FSDP on only for accelerator devices (its state's GPU branch); on gloo it says
    # MULTI_CPU. What that branch does, done here: the distributed type and the plugin with its precision.
    assert acc.state.distributed_type == DistributedType.MULTI_CPU, acc.state.distributed_type
    acc.state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    if mixed != "no":  # as the state does
        plugin.set_mixed_precision(mixed)
    acc.state.fsdp_plugin = plugin
    return acc


def _prepare(impl: str, mixed: str, efficient_loading: bool, tied: bool):
    """Build, prepare (rebinding torch's ``fully_shard`` for shardwise), return accelerator, model, optimizer.
    With ``efficient_loading`` (Accelerate's ``cpu_ram_efficient_loading``) only rank 0's weights are the
    model's (the other ranks' differ, as the empty tensors of a rank-0-only ``from_pretrained`` would):
    Accelerate moves the model to meta, shards it there, and loads rank 0's full state dict into the sharded
    model with ``load_state_dict(assign=True)``."""
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp as torch_fsdp

    import shardwise

    acc = _accelerator(mixed, efficient_loading)
    model = _model(tied, seed=1 + dist.get_rank() if efficient_loading else 0)
    torch_fully_shard = torch_fsdp.fully_shard
    if impl == "shardwise":
        torch_fsdp.fully_shard = shardwise.fully_shard
    try:
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    finally:
        torch_fsdp.fully_shard = torch_fully_shard
    return acc, model, opt


def _data():
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (MICRO_STEPS, dist.get_world_size(), BATCH, SEQ), generator=gen)
    return data[:, dist.get_rank()]


def _steps(acc, model, opt, batches) -> tuple[list, list]:
    import torch

    losses, norms = [], []
    for tokens in batches:
        with acc.accumulate(model):
            loss = model(input_ids=tokens, labels=tokens).loss
            acc.backward(loss)
            if acc.sync_gradients:
                norm = acc.clip_grad_norm_(model.parameters(), 1.0)
                norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
            opt.step()
            opt.zero_grad()
        losses.append(float(acc.reduce(loss.detach(), reduction="mean")))
    return losses, norms


def _full_params(model) -> dict:
    return {n: p.detach().full_tensor().float() for n, p in model.named_parameters()}


def _train(impl: str, mixed: str, efficient_loading: bool, tied: bool) -> dict:
    from torch.distributed.fsdp import FSDPModule

    acc, model, opt = _prepare(impl, mixed, efficient_loading, tied)
    units = sum(isinstance(m, FSDPModule) for m in model.modules())
    assert acc.is_fsdp2, (acc.distributed_type, type(model))
    losses, norms = _steps(acc, model, opt, _data())
    return {"losses": losses, "norms": norms, "params": _full_params(model), "units": units,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def _resume(impl: str, folder: str) -> dict:
    """Train, ``save_state`` halfway, train on; then a fresh model (other weights) ``load_state``s and
    trains the second half again: the same losses, grad norms and weights."""
    import torch.distributed as dist

    data = _data()
    half = 3 * ACCUM  # saved after an optimizer step, not mid-accumulation
    acc, model, opt = _prepare(impl, "no", False, False)
    _steps(acc, model, opt, data[:half])
    acc.save_state(folder)
    straight = _steps(acc, model, opt, data[half:])
    straight_params = _full_params(model)
    dist.barrier()
    acc, model, opt = _prepare(impl, "no", False, False)
    fresh = _full_params(model)
    acc.load_state(folder)
    resumed = _steps(acc, model, opt, data[half:])
    return {"straight": straight, "resumed": resumed, "straight_params": straight_params,
            "resumed_params": _full_params(model), "fresh": fresh}


def _both(mixed: str, efficient_loading: bool, tied: bool):
    ref = run_distributed(_train, 2, "fsdp2", mixed, efficient_loading, tied)[0]
    got = run_distributed(_train, 2, "shardwise", mixed, efficient_loading, tied)[0]
    return ref, got


def _assert_same(ref: dict, got: dict) -> None:
    """Bit for bit: the same reductions in the same dtypes on the same values (measured; fp32 rtol 1e-5
    and bf16 within FSDP2's own bf16 spread would be the looser bars)."""
    import torch

    assert got["units"] == ref["units"] == 6 and got["dtypes"] == ref["dtypes"]  # 2 layers, embed, norm, head, root
    assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    assert len(ref["norms"]) == MICRO_STEPS // ACCUM
    assert got["params"].keys() == ref["params"].keys()
    for name in ref["params"]:
        torch.testing.assert_close(got["params"][name], ref["params"][name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("mixed", ["no", "bf16"])
def test_accelerate_fsdp2_plugin_matches_fsdp2(mixed):
    """A materialized model, fp32 and bf16 (Accelerate's ``MixedPrecisionPolicy``)."""
    _assert_same(*_both(mixed, efficient_loading=False, tied=False))


@pytest.mark.parametrize("mixed, tied", [("no", True), ("bf16", False)])
def test_accelerate_cpu_ram_efficient_loading_matches_fsdp2(mixed, tied):
    """Sharded on meta, rank 0's weights loaded by ``load_state_dict(assign=True)``; tied embeddings make
    ``[norm, embed_tokens, lm_head]`` one unit."""
    _assert_same(*_both(mixed, efficient_loading=True, tied=tied))


def test_accelerate_save_state_load_state_resumes_exactly(tmp_path):
    """``save_state`` after an optimizer step, ``load_state`` into a fresh model: the resumed steps equal
    the uninterrupted ones."""
    import torch

    r = run_distributed(_resume, 2, "shardwise", str(tmp_path))[0]
    assert r["resumed"] == r["straight"]
    for name, p in r["straight_params"].items():
        torch.testing.assert_close(r["resumed_params"][name], p, rtol=0, atol=0, msg=name)
        assert not torch.equal(r["fresh"][name], p), name  # the load did it
