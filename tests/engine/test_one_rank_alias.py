"""One rank per parameter axis, compute dtype = main dtype: the gathered parameters are the model shard itself.

At ZeRO-3 on one GPU (or any group whose parameter axes all have one rank) the model shard and the gathered
buffer hold the same rows in the same slots (``Levels.same_layout(0, kp)``). Where the main weights also are the
model weights (bf16 everywhere, fp32 everywhere; no FP8 gather, no offload) the engine keeps the unsharded
parameters for good as views of that one buffer: no gather copy, no free, no allocation per step, and the
optimizer's in-place update is what the next forward reads. What must hold, on gloo:

- the compute parameters' storage is the main weights' storage, the same every step, and a steady step
  takes no gathered storage back (``LiveBytes`` sees every storage made or resized);
- training is bit for bit a plain unwrapped model's at world 1 (the same kernels on the same values: the
  reduction over one rank is the values, the gradient scale is 1), with AdamW, bf16 and fp32;
- the alias survives ``to_empty`` of a meta-built model and ``load_state_dict(assign=True)``;
- fp32 main with bf16 compute, two sharding ranks, the FP8 gather and offload still gather and free.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import shardwise
from shardwise.app.plan.live_bytes import LiveBytes
from shardwise.engine.model_ops import compute_parameters, sharded_state
from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import Run, compare, train_both, train_tiny
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch

BF16 = torch.bfloat16
# name -> (the model's dtype, the policy): every recipe whose compute weights are the main weights
ALIASING = {
    "bf16": (BF16, shardwise.MixedPrecisionPolicy(param_dtype=BF16)),
    # the bench's shardwise-bf16main: an fp32-built model, bf16 compute, main weights and grads
    "bf16_main": (torch.float32, shardwise.MixedPrecisionPolicy(param_dtype=BF16, main_params_dtype=BF16,
                                                                main_grads_dtype=BF16)),
    "fp32": (torch.float32, shardwise.MixedPrecisionPolicy()),
}
STEPS = 4


def _build(dtype: torch.dtype) -> TinyLM:
    torch.manual_seed(0)
    return TinyLM(TinyConfig()).to(dtype)


def _wrap(model: nn.Module, policy, **options) -> nn.Module:
    return shardwise.fully_shard(model, strategy="optim_grads_params", unit_modules=[Block],
                                 mixed_precision=policy, **options)


def _aliased(model) -> list[bool]:
    """For each trainable compute parameter: whether it views its sharded parameter's main rows."""
    out = []
    for g in sharded_state(model).groups:
        for sharded, unsharded in zip(g.sharded_params, g.unsharded_params):
            local = sharded.to_local()
            out.append(unsharded.data_ptr() == local.data_ptr()
                       and unsharded.untyped_storage()._cdata == local.untyped_storage()._cdata)
    return out


def _pointers(model) -> list[int]:
    return [p.data_ptr() for p in compute_parameters(model)]


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _taken_back(model, opt, step: int) -> list:
    """One step under ``LiveBytes``, which sees every storage an op makes and every resize of a storage it
    knows: the gathered buffers are adopted first, so each time one takes its storage back shows."""
    live = LiveBytes()
    with live:
        live.adopt(g.unsharded for g in sharded_state(model).groups)
        _step(model, opt, step, model.c)
    return [entry for entry in live.log if entry[1] == "resize_"]


def _step(model, opt, step: int, config: TinyConfig) -> float:
    tokens, targets = (t.to(device()) for t in batch(step, 4, config))
    loss = model(tokens, targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


# ------------------------------------------------------------------ the alias, and nothing gathered per step
def _alias_and_no_gather(recipe: str) -> dict:
    dtype, policy = ALIASING[recipe]
    model = _wrap(_build(dtype), policy)
    config = model.c
    groups = sharded_state(model).groups
    out = {"persistent": [g.persistent_unsharded for g in groups], "aliased": [_aliased(model)],
           "pointers": [_pointers(model)], "unsharded_reported": [], "read_in_forward": []}
    # what forward really reads: the weight each block's fc1 holds while it runs
    mains = {id(b): b.fc1.weight.to_local().data_ptr() for b in model.blocks}
    seen = []
    handles = [b.register_forward_pre_hook(lambda m, args: seen.append(m.fc1.weight.data_ptr() == mains[id(m)]))
               for b in model.blocks]
    opt = _optimizer(model)
    for step in range(STEPS):
        if step == STEPS - 1:  # a steady step: every storage it takes back
            out["resized"] = _taken_back(model, opt, step)
        else:
            _step(model, opt, step, config)
        out["aliased"].append(_aliased(model))
        out["pointers"].append(_pointers(model))
        out["unsharded_reported"].append(model.resident_bytes()["unsharded"])
    for h in handles:
        h.remove()
    out["read_in_forward"] = seen
    out["main_pointers_unchanged"] = all(b.fc1.weight.to_local().data_ptr() == mains[id(b)] for b in model.blocks)
    return out


@pytest.mark.parametrize("recipe", list(ALIASING))
def test_one_rank_same_dtype_unsharded_parameters_are_the_model_shard(recipe):
    out = run_distributed(_alias_and_no_gather, 1, recipe)[0]
    assert all(out["persistent"]), out["persistent"]
    for aliased in out["aliased"]:  # at wrap time and after every step
        assert aliased and all(aliased), aliased
    assert all(p == out["pointers"][0] for p in out["pointers"]), "the compute weights moved between steps"
    assert out["main_pointers_unchanged"]
    # every block's forward (4 blocks' calls a step: the last block runs twice) read the main weights themselves
    assert len(out["read_in_forward"]) == STEPS * 4 and all(out["read_in_forward"])
    assert out["resized"] == [], f"a steady step took gathered storage back: {out['resized']}"
    assert out["unsharded_reported"] == [0] * STEPS  # counted once, as the model shard


def _gathering_baseline() -> list:
    """The detector itself: a world-1 run that does gather (fp32 main, bf16 compute) shows up as resizes."""
    model = _wrap(_build(torch.float32), shardwise.MixedPrecisionPolicy(param_dtype=BF16))
    opt = _optimizer(model)
    _step(model, opt, 0, model.c)
    return _taken_back(model, opt, 1)


def test_the_probe_sees_the_gathers_of_a_group_that_does_not_alias():
    resized = run_distributed(_gathering_baseline, 1)[0]
    # the root's two groups (trainable, frozen) once a step; each block at forward and at backward, the last
    # block at each of its two forwards and once for both backwards (it stays gathered between them): 2 + 7
    assert len(resized) == 9, resized


# ------------------------------------------------------------------ bit for bit a plain model
def _bits(recipe: str) -> dict:
    dtype, policy = ALIASING[recipe]
    config = TinyConfig()
    # a plain model in the compute dtype: its weights, gradients and AdamW state are the wrapped run's dtype
    plain_dtype = policy.param_dtype or dtype
    sharded, reference = train_both(
        lambda: _build(dtype), lambda m: _wrap(m, policy), _optimizer, lambda step: batch(step, 8, config),
        STEPS + 1, reference=lambda: _build(dtype).to(plain_dtype))
    return {"sharded": (sharded.losses, sharded.state), "reference": (reference.losses, reference.state),
            "aliased": all(_aliased(sharded.model))}


@pytest.mark.parametrize("recipe", list(ALIASING))
def test_training_is_bit_identical_to_a_plain_model(recipe):
    """World 1: the wrapped step runs the plain model's kernels on the same values (the gradient goes through
    one copy into the main-grad buffer of its own dtype and back out as a view, the mean over one rank is
    skipped), so losses and every weight after AdamW must be exactly equal. (The gathering path before the
    alias was bit-identical to the plain model too, so the alias changes no bit.)"""
    out = run_distributed(_bits, 1, recipe)[0]
    assert out["aliased"]
    (losses, state), (ref_losses, ref_state) = out["sharded"], out["reference"]
    assert losses == ref_losses
    assert losses[-1] < losses[0] - 0.5, losses  # it trained
    assert set(state) == set(ref_state)
    for name, value in ref_state.items():
        assert state[name].dtype == value.dtype, name
        assert torch.equal(state[name], value), f"{name} differs"


# ------------------------------------------------------------------ replaced storage keeps the alias
class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _replaced() -> dict:
    out = {}
    bf16 = shardwise.MixedPrecisionPolicy(param_dtype=BF16)
    # built on the meta device, given storage by to_empty after fully_shard, filled by the model's own init
    with torch.device("meta"):
        model = _Pair().to(BF16)
    shardwise.fully_shard(model.a, mixed_precision=bf16)
    shardwise.fully_shard(model, mixed_precision=bf16)
    model.to_empty(device=device())
    torch.manual_seed(0)
    with torch.no_grad():
        for m in (model.a, model.b):
            m.reset_parameters()
    x = torch.linspace(-1, 1, 12, device=device()).view(3, 4).to(BF16)
    torch.manual_seed(0)
    plain = _Pair().to(BF16)
    out["to_empty"] = (all(_aliased(model)), torch.equal(model(x), plain(x)))
    # load_state_dict(assign=True) puts new parameter objects in the modules: taken into the same buffer
    new = {k: torch.full_like(v.full_tensor(), 0.25) for k, v in model.state_dict().items()}
    pointers = _pointers(model)
    model.load_state_dict(new, assign=True)
    plain.load_state_dict(new)
    out["assign"] = (all(_aliased(model)), _pointers(model) == pointers, torch.equal(model(x), plain(x)))
    return out


def test_the_alias_survives_to_empty_and_assigning_loads():
    out = run_distributed(_replaced, 1)[0]
    assert out["to_empty"] == (True, True)
    assert out["assign"] == (True, True, True)


# ------------------------------------------------------------------ torch's own state-dict tools
def _torch_tools(folder: str) -> dict:
    """Plain ``dcp.save`` of a trained aliased model and ``dcp.load`` into another one (its own seed): the load
    writes into the main weights in place, so the next forward must read the loaded values through the alias;
    ``get_model_state_dict`` (full) and ``full_tensor`` must agree with the trained model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    dtype, policy = ALIASING["bf16"]
    trained = _wrap(_build(dtype), policy)
    opt = _optimizer(trained)
    for step in range(2):
        _step(trained, opt, step, trained.c)
    dcp.save(trained.state_dict(), checkpoint_id=folder)
    torch.manual_seed(1)
    other = _wrap(TinyLM(TinyConfig()).to(dtype), policy)
    tokens, targets = (t.to(device()) for t in batch(9, 4, other.c))
    before = torch.equal(other(tokens, targets), trained(tokens, targets))
    state = other.state_dict()
    dcp.load(state, checkpoint_id=folder)
    full = StateDictOptions(full_state_dict=True)
    expected = get_model_state_dict(trained, options=full)
    loaded = get_model_state_dict(other, options=full)
    return {"differed_before": not before, "aliased": all(_aliased(other)),
            "forward_equal": torch.equal(other(tokens, targets), trained(tokens, targets)),
            "state_equal": set(loaded) == set(expected) and all(torch.equal(loaded[k], expected[k]) for k in expected),
            "full_tensor_equal": all(torch.equal(v.full_tensor(), expected[k])
                                     for k, v in trained.state_dict().items())}


def test_plain_dcp_load_reaches_forward_through_the_alias(tmp_path):
    out = run_distributed(_torch_tools, 1, str(tmp_path / "ckpt"))[0]
    assert out == {"differed_before": True, "aliased": True, "forward_equal": True, "state_equal": True,
                   "full_tensor_equal": True}


# ------------------------------------------------------------------ what must not alias
def _not_aliased(case: str) -> dict:
    options = {}
    if case == "fp32_main_bf16_compute":
        model, policy = _build(torch.float32), shardwise.MixedPrecisionPolicy(param_dtype=BF16)
    elif case == "offload":
        model, policy = _build(BF16), shardwise.MixedPrecisionPolicy(param_dtype=BF16)
        options["offload_policy"] = shardwise.OffloadPolicy(fraction=1.0)
    else:  # sharded over two ranks
        model, policy = _build(BF16), shardwise.MixedPrecisionPolicy(param_dtype=BF16)
    model = _wrap(model, policy, **options)
    opt = _optimizer(model)
    at_rest = []
    for step in range(2):
        _step(model, opt, step, model.c)
        at_rest.append(sum(g.storage_bytes_unsharded for g in sharded_state(model).groups))
    return {"persistent": [g.persistent_unsharded for g in sharded_state(model).groups],
            "aliased": _aliased(model), "at_rest": at_rest}


@pytest.mark.parametrize("case,world", [("fp32_main_bf16_compute", 1), ("offload", 1), ("sharded", 2)])
def test_groups_that_must_gather_still_gather_and_free(case, world):
    for out in run_distributed(_not_aliased, world, case):
        assert not any(out["persistent"]), out["persistent"]
        assert not any(out["aliased"])
        assert out["at_rest"] == [0, 0], "the gathered storage must be freed at rest"


def _fp8_group() -> dict:
    from tests.engine.test_fp8 import BF16 as FP8_POLICY, Holder

    model = shardwise.fully_shard(Holder(True), strategy="optim_grads_params", mixed_precision=FP8_POLICY)
    groups = sharded_state(model).groups
    quantized = [g.quantized is not None for g in groups]
    model.unshard()
    model.reshard()
    return {"quantized": quantized, "persistent": [g.persistent_unsharded for g in groups],
            "at_rest": sum(g.storage_bytes_unsharded for g in groups)}


def test_the_fp8_gather_still_gathers_at_one_rank():
    out = run_distributed(_fp8_group, 1)[0]
    assert any(out["quantized"])
    assert [p for p, q in zip(out["persistent"], out["quantized"]) if q] == [False] * sum(out["quantized"])
    assert out["at_rest"] == 0


# ------------------------------------------------------------------ a one-rank axis inside a larger run
def _hsdp_one_rank_shard_axis() -> dict:
    """2 processes on a (dp_outer 2, dp_shard 1) mesh, HSDP: parameters 'sharded' over dp_shard, one rank, so
    each rank's model shard is the whole parameter and aliases; the replicas all-reduce the gradients."""
    sharded, reference = train_tiny(Run(outer="no_shard"))
    compare(sharded, reference, trained_by=1.0)  # the engine's fp32 parity standard (test_parity)
    groups = sharded_state(sharded.model).groups
    return {"persistent": [g.persistent_unsharded for g in groups], "aliased": _aliased(sharded.model),
            "axes": [[a.size for a in g.plan.param_axes] for g in groups], "world": dist.get_world_size()}


def test_a_one_rank_shard_axis_inside_a_two_process_run_aliases_and_trains_as_the_reference():
    for out in run_distributed(_hsdp_one_rank_shard_axis, 2):
        assert out["world"] == 2 and all(axes == [1] for axes in out["axes"]), out["axes"]
        assert all(out["persistent"]) and all(out["aliased"])


# ------------------------------------------------------------------ the memory estimate follows
def test_the_memory_estimate_counts_no_gathered_copy_where_the_engine_aliases():
    from shardwise.app.memory_estimate import BufferSizes

    n = 1_000_000
    for main in (BF16, torch.float32):
        aliased = BufferSizes(1, param_dtype=main, main_dtype=main, grad_dtype=main)
        assert aliased.gathered(n) == 0 and aliased.gather_staging(n) == 0
        assert aliased.weights(n) == n * torch.finfo(main).bits // 8  # the model shard, counted once
    mixed = BufferSizes(1)  # bf16 compute over fp32 main weights: cast and gathered at every unit
    assert mixed.gathered(n) == 2 * n and mixed.gather_staging(n) == 2 * n
    assert BufferSizes(2, param_dtype=BF16, main_dtype=BF16).gathered(n) == 2 * n
    assert BufferSizes(1, param_dtype=BF16, main_dtype=BF16, offload=True).gathered(n) == 2 * n
    hsdp = BufferSizes(2, outer=2, outer_strategy="no_shard", param_dtype=torch.float32)  # dp_shard of one rank
    assert hsdp.gathered(n) == 0
