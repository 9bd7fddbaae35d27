"""``MixedPrecisionPolicy(keep_compute_weights=True)``: the bf16 weight shard kept at rest, cast once per update.

Megatron-FSDP keeps a compute-dtype model-weight buffer beside the fp32 main weights; the Megatron face asks
the engine for the same. What must hold, on gloo, against the default (cast from the main weights right before
every gather, FSDP2's way):

- losses and every weight bit for bit the default's over several AdamW steps with gradient accumulation, at
  world 1 and 2 (a cast is a cast, whenever it runs);
- at one rank the gathered parameters are the kept shard itself: a steady step of several micro-batches
  takes no gathered storage back (no gather, so no cast, per micro-batch);
- at two ranks the kept shard is what the gather reads (the gathered buffer is still freed at rest);
- the Megatron face asks for it.
"""

from __future__ import annotations

import pytest
import torch

import shardwise
from shardwise.app.plan.live_bytes import LiveBytes
from shardwise.engine.model_ops import sharded_state
from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch

BF16 = torch.bfloat16
STEPS, MICRO = 3, 3


def _wrap(keep: bool):
    torch.manual_seed(0)
    model = TinyLM(TinyConfig()).to(device())
    policy = shardwise.MixedPrecisionPolicy(param_dtype=BF16, keep_compute_weights=keep)
    return shardwise.fully_shard(model, strategy="optim_grads_params", unit_modules=[Block], mixed_precision=policy)


def _micro_batches(model, opt, step: int) -> float:
    rank = torch.distributed.get_rank()
    for micro in range(MICRO):
        tokens, targets = (t.to(device()) for t in batch(100 * step + 10 * micro + rank, 4, model.c))
        if micro < MICRO - 1:
            with model.no_sync():
                loss = model(tokens, targets)
                loss.backward()
        else:
            loss = model(tokens, targets)
            loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _train(keep: bool) -> dict:
    model = _wrap(keep)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = [_micro_batches(model, opt, step) for step in range(STEPS)]
    groups = sharded_state(model).groups
    return {"losses": losses, "state": {k: v.full_tensor().cpu() for k, v in model.state_dict().items()},
            "kept": [g.model_shard is not None for g in groups if g.compute_dtype == BF16],
            "persistent": [g.persistent_unsharded for g in groups]}


@pytest.mark.parametrize("world", [1, 2])
def test_kept_compute_weights_train_bit_for_bit_as_the_cast_at_every_gather(world):
    kept = run_distributed(_train, world, True)
    default = run_distributed(_train, world, False)
    for ours, theirs in zip(kept, default):
        assert ours["losses"] == theirs["losses"]
        assert ours["losses"][-1] < ours["losses"][0], ours["losses"]
        for name, value in theirs["state"].items():
            assert torch.equal(ours["state"][name], value), name
        assert ours["kept"] and all(ours["kept"]) and not any(theirs["kept"])
        # one rank: the gathered parameters are the kept shard; two ranks: they are gathered from it
        assert all(ours["persistent"]) == (world == 1)
        assert not any(theirs["persistent"])


def _one_rank_steady_step() -> dict:
    model = _wrap(True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _micro_batches(model, opt, 0)
    groups = sharded_state(model).groups
    aliased = [u.untyped_storage()._cdata == g.model_shard.untyped_storage()._cdata
               for g in groups for u in g.unsharded_params]
    live = LiveBytes()  # sees every storage an op makes and every resize of the adopted gathered buffers
    with live:
        live.adopt(g.unsharded for g in groups)
        _micro_batches(model, opt, 1)
    return {"aliased": aliased, "resized": [e for e in live.log if e[1] == "resize_"]}


def test_one_rank_gathers_nothing_per_micro_batch():
    out = run_distributed(_one_rank_steady_step, 1)[0]
    assert out["aliased"] and all(out["aliased"])
    assert out["resized"] == [], f"a steady step took gathered storage back: {out['resized']}"


def test_the_megatron_face_keeps_the_compute_weights():
    from types import SimpleNamespace

    from shardwise.megatron.main_dtypes import mixed_precision_for

    cfg = SimpleNamespace(bf16=True, fp16=False, params_dtype=torch.float32)
    ddp = SimpleNamespace(megatron_fsdp_main_params_dtype=torch.float32, megatron_fsdp_main_grads_dtype=torch.float32,
                          megatron_fsdp_grad_comm_dtype=None)
    policy = mixed_precision_for(cfg, ddp, ddp, torch.nn.Linear(2, 2))
    assert policy.keep_compute_weights and policy.param_dtype == BF16
