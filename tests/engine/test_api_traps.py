"""Names a torch FSDP2 user brings along mean what they mean in torch, or are refused saying what to write:
``OffloadPolicy()``, ``MixedPrecisionPolicy(reduce_dtype=...)``, one full state dict function with one default,
and a library name for the end of a script. (``fully_shard``'s own FSDP2 face: ``test_fsdp2_face.py``.)"""

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


def _offloaded_losses(offload_policy) -> tuple[list[float], list[bool]]:
    torch.manual_seed(0)
    model = shardwise.fully_shard(TinyLM(TinyConfig()).to(device()), unit_modules=[Block],
                                  offload_policy=offload_policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(2):
        tokens, targets = (t.to(device()) for t in batch(dist.get_rank() + 10 * step, 4, TinyConfig()))
        loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [g.offloaded for g in model.sharded_state.groups]


def test_torchs_offload_policies_mean_what_they_mean_in_torch():
    """``CPUOffloadPolicy()`` offloads every unit, as ``OffloadPolicy(fraction=1.0)``; torch's ``OffloadPolicy()``
    offloads nothing, as ``None``: the same losses, bit for bit, and the same offloaded groups."""
    torch_cpu = run_distributed(_offloaded_losses, 1, CPUOffloadPolicy())[0]
    ours = run_distributed(_offloaded_losses, 1, shardwise.OffloadPolicy(fraction=1.0))[0]
    torch_none = run_distributed(_offloaded_losses, 1, TorchOffloadPolicy())[0]
    plain = run_distributed(_offloaded_losses, 1, None)[0]
    assert torch_cpu == ours and any(torch_cpu[1])
    assert torch_none == plain and not any(plain[1])


# ------------------------------------------------------------------ MixedPrecisionPolicy
def test_mixed_precision_takes_torchs_field_names_and_builds_them():
    policy = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    fp32 = torch.float32
    assert policy.comm_dtype(fp32) == torch.bfloat16 and policy.grad_comm_dtype == torch.bfloat16
    assert policy.main_grad_dtype(fp32) == fp32  # reduced in bf16, accumulated (and stepped) in fp32
    assert shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16).comm_dtype(fp32) == fp32
    assert shardwise.MixedPrecisionPolicy(reduce_dtype=fp32, grad_comm_dtype=fp32).comm_dtype(torch.bfloat16) == fp32
    # a parameter keeps its own dtype (FSDP2), unless fp32 main weights are asked for
    assert policy.main_dtype(torch.bfloat16) == torch.bfloat16
    assert shardwise.MixedPrecisionPolicy(main_params_dtype=fp32).main_dtype(torch.bfloat16) == fp32
    with pytest.raises(ValueError, match="two names for the gradient reduction's dtype that disagree"):
        shardwise.MixedPrecisionPolicy(reduce_dtype=torch.bfloat16, grad_comm_dtype=torch.float32)
    with pytest.raises(ValueError, match="MixedPrecisionPolicy.grad_comm_dtype=torch.int8"):
        shardwise.MixedPrecisionPolicy(reduce_dtype=torch.int8)
    cast = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True,
                                          output_dtype=torch.float32)
    args, kwargs = cast.cast_inputs((torch.ones(2), torch.ones(2, dtype=torch.long)), {"x": torch.ones(1)})
    assert [a.dtype for a in args] == [torch.bfloat16, torch.long] and kwargs["x"].dtype == torch.bfloat16
    assert cast.cast_output({"y": torch.ones(1, dtype=torch.bfloat16)})["y"].dtype == torch.float32
    with pytest.raises(TypeError, match="cast_forward_inputs=None must be a bool"):
        shardwise.MixedPrecisionPolicy(cast_forward_inputs=None)


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
