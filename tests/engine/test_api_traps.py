"""Names a torch FSDP2 user brings along mean what they mean in torch, or are refused saying what to write:
``OffloadPolicy()``, ``MixedPrecisionPolicy(reduce_dtype=...)``, ``fully_shard`` on each layer then on the root,
one full state dict function with one default, and a library name for the end of a script."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy as TorchOffloadPolicy

import shardwise
from tests.helpers import REPO
from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


# ------------------------------------------------------------------ OffloadPolicy
def test_a_bare_offload_policy_is_refused_saying_both_meanings():
    """torch's ``OffloadPolicy()`` offloads nothing; shardwise's used to offload everything: now neither guess."""
    with pytest.raises(TypeError, match=r"needs fraction= or units=: fraction=1\.0 offloads everything \(torch's "
                                        r"CPUOffloadPolicy\(\)\).*no offload \(torch's OffloadPolicy\(\)\) pass "
                                        r"offload_policy=None"):
        shardwise.OffloadPolicy()
    with pytest.raises(TypeError, match="not both"):
        shardwise.OffloadPolicy(fraction=0.5, units=["blocks.0"])
    assert shardwise.OffloadPolicy(fraction=1.0).fraction == 1.0
    assert shardwise.OffloadPolicy(units=["blocks.0"]).units == ["blocks.0"]


def _fully_shard_refusal(**kwargs) -> str:
    torch.manual_seed(0)
    try:
        shardwise.fully_shard(TinyLM(TinyConfig()).to(device()), unit_modules=[Block], **kwargs)
    except (TypeError, ValueError) as e:
        return str(e)
    return "accepted"


def test_torch_offload_policies_passed_to_fully_shard_say_the_shardwise_spelling():
    cpu, none = run_distributed(_fully_shard_refusal, 1, offload_policy=CPUOffloadPolicy())[0], \
        run_distributed(_fully_shard_refusal, 1, offload_policy=TorchOffloadPolicy())[0]
    assert "torch's CPUOffloadPolicy() is shardwise.OffloadPolicy(fraction=1.0)" in cpu, cpu
    assert "torch's OffloadPolicy() (no offload) is offload_policy=None" in none, none


# ------------------------------------------------------------------ MixedPrecisionPolicy
def test_mixed_precision_takes_torchs_reduce_dtype_and_refuses_what_is_not_built():
    policy = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert policy.comm_dtype == torch.bfloat16 and policy.grad_comm_dtype == torch.bfloat16
    assert policy.main_grads_dtype == torch.float32  # reduced in bf16, accumulated (and stepped) in fp32
    assert shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16).comm_dtype == torch.float32
    assert shardwise.MixedPrecisionPolicy(reduce_dtype=torch.float32, grad_comm_dtype=torch.float32).comm_dtype \
        == torch.float32
    with pytest.raises(ValueError, match="two names for the gradient reduction's dtype that disagree"):
        shardwise.MixedPrecisionPolicy(reduce_dtype=torch.bfloat16, grad_comm_dtype=torch.float32)
    with pytest.raises(ValueError, match="MixedPrecisionPolicy.grad_comm_dtype=torch.int8"):
        shardwise.MixedPrecisionPolicy(reduce_dtype=torch.int8)
    with pytest.raises(NotImplementedError, match=r"output_dtype=torch.float32\) is not built"):
        shardwise.MixedPrecisionPolicy(output_dtype=torch.float32)
    with pytest.raises(NotImplementedError, match=r"cast_forward_inputs=True\) is not built"):
        shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    assert shardwise.MixedPrecisionPolicy(cast_forward_inputs=False).param_dtype is None  # what shardwise does


def _grads_with(policy_kwargs: dict) -> dict:
    torch.manual_seed(0)
    model = shardwise.fully_shard(TinyLM(TinyConfig()).to(device()), unit_modules=[Block], strategy="optim_grads",
                                  mixed_precision=shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                                 **policy_kwargs))
    tokens, targets = (t.to(device()) for t in batch(dist.get_rank(), 4, TinyConfig()))
    model(tokens, targets).backward()
    return {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters() if p.grad is not None}


def test_reduce_dtype_reduces_the_gradients_in_that_dtype():
    """``reduce_dtype=bf16`` gives the gradients of ``grad_comm_dtype=bf16``, bit for bit, and not fp32's."""
    torch_name = run_distributed(_grads_with, 2, {"reduce_dtype": torch.bfloat16})[0]
    ours = run_distributed(_grads_with, 2, {"grad_comm_dtype": torch.bfloat16})[0]
    fp32 = run_distributed(_grads_with, 2, {})[0]
    assert torch_name.keys() == ours.keys() == fp32.keys()
    assert all(torch.equal(torch_name[k], ours[k]) for k in ours)
    assert any(not torch.equal(torch_name[k], fp32[k]) for k in ours)  # the reduction really was bf16


# ------------------------------------------------------------------ fully_shard per layer, then the root
def _per_layer_then_root() -> str:
    torch.manual_seed(0)
    model = TinyLM(TinyConfig()).to(device())
    for block in model.blocks:
        shardwise.fully_shard(block)
    try:
        shardwise.fully_shard(model)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_fully_shard_on_each_layer_then_the_root_says_what_to_write_instead():
    message = run_distributed(_per_layer_then_root, 1)[0]
    assert message.startswith("submodule 'blocks.0' (Block) is already sharded by shardwise.fully_shard"), message
    assert "call fully_shard(model, unit_modules=[Block]) once, on the model before any layer was sharded" in message


# ------------------------------------------------------------------ one full state dict
def _full_states() -> dict:
    torch.manual_seed(0)
    model = shardwise.fully_shard(TinyLM(TinyConfig()).to(device()), unit_modules=[Block])
    return {"default": shardwise.full_state_dict(model), "rank0": shardwise.full_state_dict(model, rank0_only=True),
            "once": shardwise.full_state_dict(model, include_tied=False),
            "bf16": shardwise.full_state_dict(model, dtype=torch.bfloat16),
            "expected": set(TinyLM(TinyConfig()).state_dict())}


def test_one_full_state_dict_with_torchs_default():
    """``shardwise.full_state_dict`` is the one public full model state (the checkpoint package has no second one
    with the opposite default): every rank gets it unless ``rank0_only``, as torch's ``FullStateDictConfig``."""
    import shardwise.checkpoint

    assert not [name for name in shardwise.checkpoint.__all__ if "full_state_dict" in name]
    first, second = run_distributed(_full_states, 2)
    assert set(first["default"]) == set(second["default"]) == first["expected"]
    assert all(torch.equal(first["default"][k], second["default"][k]) for k in first["default"])
    assert set(first["rank0"]) == first["expected"] and second["rank0"] == {}
    assert set(first["once"]) == first["expected"] - {"head.weight"}  # tied to embed.weight, its first name
    assert first["bf16"]["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(first["bf16"]["embed.weight"], first["default"]["embed.weight"].bfloat16())


# ------------------------------------------------------------------ the end of a script
def test_the_end_of_a_script_has_a_library_name():
    assert "destroy_process_groups" in shardwise.__all__ and callable(shardwise.destroy_process_groups)
    readme = (REPO / "README.md").read_text()
    assert "shardwise.destroy_process_groups()" in readme
    assert "shardwise.app.launch" not in readme and "shutdown_process_groups" not in readme
