"""Clipping folded into a fused optimizer's step: the same training as scaling the gradients in place."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise

from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import Run, assert_close_states, assert_parity
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch

MAX_NORM = 0.05  # below every step's norm here, so every step clips
STEPS = 3


@pytest.mark.parametrize("world,outer", [(1, None), (4, "optim")])  # 2 ranks: against in-place clipping below
def test_folded_clipping_trains_as_torch_clips(world, outer):
    run_distributed(assert_parity, world, Run(clip=MAX_NORM, clip_into_optimizer=True, optimizer="adamw_fused",
                                              outer=outer))


def _train(fold: bool, offload: float) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    policy = shardwise.OffloadPolicy(fraction=offload) if offload else None
    model = shardwise.fully_shard(TinyLM(TinyConfig()).to(device()), unit_modules=[Block], offload_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    norms, leftover = [], []
    for step in range(STEPS):
        tokens, targets = (t.to(device()) for t in batch(step, world, TinyConfig()))
        model(tokens[rank : rank + 1], targets[rank : rank + 1]).backward()
        norms.append(float(shardwise.clip_grad_norm_(model.parameters(), MAX_NORM, optimizer=opt if fold else None)))
        opt.step()
        leftover.append(hasattr(opt, "grad_scale"))
        grads = {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters() if p.grad is not None}
        opt.zero_grad()
    weights = {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}
    return {"norms": norms, "leftover": leftover, "grads": grads, "weights": weights}


def _both(offload: float) -> tuple[dict, dict]:
    return _train(False, offload), _train(True, offload)


@pytest.mark.parametrize("offload", [0.0, 0.5])
def test_the_step_applies_the_factor_and_leaves_the_clipped_gradients(offload):
    for in_place, folded in run_distributed(_both, 2, offload):
        assert all(n > MAX_NORM for n in in_place["norms"]), in_place["norms"]  # every step clipped
        # the first step's norm is of the same gradients; later ones differ by the steps' rounding only
        assert folded["norms"][0] == in_place["norms"][0]
        torch.testing.assert_close(folded["norms"], in_place["norms"], rtol=1e-6, atol=0)
        assert folded["leftover"] == [False] * STEPS
        # the fused step wrote the clipped values back; Adam's update turns their rounding into ~1e-7
        assert_close_states(folded["grads"], in_place["grads"], rtol=1e-6)
        assert_close_states(folded["weights"], in_place["weights"], rtol=1e-6)


def _skip_then_step(fold: bool, scaler: bool) -> dict:
    """Without ``scaler``, step 0 is skipped after clipping (as on a non-finite norm); with it, every step
    goes through a GradScaler (unscale_, clip, scaler.step: the scaler then owns ``grad_scale``)."""
    torch.manual_seed(0)
    model = shardwise.fully_shard(TinyLM(TinyConfig()).to(device()), unit_modules=[Block])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp = torch.amp.GradScaler("cpu", init_scale=4.0) if scaler else None
    for step in range(STEPS):
        tokens, targets = (t.to(device()) for t in batch(step, 1, TinyConfig()))
        loss = model(tokens, targets)
        (amp.scale(loss) if amp else loss).backward()
        if amp:
            amp.unscale_(opt)
        shardwise.clip_grad_norm_(model.parameters(), MAX_NORM, optimizer=opt if fold else None)
        if amp or step > 0:
            if amp:
                amp.step(opt)
                amp.update()
            else:
                opt.step()
        opt.zero_grad()
    return {"weights": {n: p.detach().full_tensor() for n, p in model.named_parameters()},
            "left": sorted(k for k in vars(opt) if "grad_scale" in k or "folded" in k or k == "found_inf")}


def _skipped(scaler: bool) -> tuple[dict, dict]:
    return _skip_then_step(False, scaler), _skip_then_step(True, scaler)


@pytest.mark.parametrize("scaler", [False, True])
def test_a_skipped_step_leaves_no_stale_factor_and_a_grad_scaler_keeps_its_own(scaler):
    (in_place, folded), = run_distributed(_skipped, 1, scaler)
    assert folded["left"] == []  # nothing left on the optimizer after the last step
    assert_close_states(folded["weights"], in_place["weights"], rtol=1e-6)
