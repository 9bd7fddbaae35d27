"""Main weights and optimizer state on the host: the same training, bit for bit, as on the device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import shardwise

from tests.helpers.distributed import BACKEND, device, run_distributed
from tests.helpers.parity import STRATEGY_MESHES
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch

STEPS = 4
CONFIG = TinyConfig()


def _sharded(offloaded: bool | shardwise.OffloadPolicy, **options):
    """The tiny model, seeded, sharded with everything offloaded (or by the given policy) or nothing."""
    torch.manual_seed(0)
    policy = shardwise.OffloadPolicy(fraction=1.0) if offloaded is True else offloaded or None
    return shardwise.fully_shard(TinyLM(CONFIG).to(device()), unit_modules=[Block], offload_policy=policy, **options)


def _local_loss(model, step: int) -> torch.Tensor:
    """The loss of this rank's share of step ``step``'s global batch."""
    world, rank = dist.get_world_size(), dist.get_rank()
    tokens, targets = (t.to(device()) for t in batch(step, world, CONFIG))
    return model(tokens[rank : rank + 1], targets[rank : rank + 1])


def _train(strategy, outer, offload, clip: bool, accumulate: int = 1):
    """Losses, full weights and one optimizer moment after a few AdamW steps."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = shardwise.build_dp_mesh(outer=2) if outer else None
    model = _sharded(offload, mesh=mesh, strategy=strategy, outer_dp_sharding_strategy=outer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        tokens, targets = (t.to(device()) for t in batch(step, world * accumulate, CONFIG))
        for i in range(accumulate):
            mine = slice((rank * accumulate + i), (rank * accumulate + i) + 1)
            sync = model.no_sync() if i < accumulate - 1 else torch.enable_grad()
            with sync:
                loss = model(tokens[mine], targets[mine]) / accumulate
                loss.backward()
        if clip:
            shardwise.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weights = {n: p.detach().full_tensor().cpu() for n, p in model.named_parameters()}
    moments = {n: opt.state[p]["exp_avg"].full_tensor().cpu() for n, p in model.named_parameters() if p in opt.state}
    on_host = sorted({p.to_local().device.type for p in model.parameters()})
    return losses, weights, moments, on_host


def _compare(strategy, outer, offload, clip=True, accumulate=1):
    plain = _train(strategy, outer, None, clip, accumulate)
    off = _train(strategy, outer, offload, clip, accumulate)
    return plain, off


def _same(a, b) -> bool:
    """Bit-identical on gloo, where both runs step on the CPU; over NCCL the device run's optimizer
    runs CUDA kernels and the offloaded one CPU kernels, which round differently."""
    if BACKEND == "gloo":
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-5, atol=1e-6)


def _assert_identical(results):
    for (losses, weights, moments, _), (o_losses, o_weights, o_moments, _) in results:
        assert _same(losses, o_losses), (losses, o_losses)
        for name in weights:
            assert _same(weights[name], o_weights[name]), name
        assert moments.keys() == o_moments.keys() and moments
        for name in moments:
            assert _same(moments[name], o_moments[name]), name


@pytest.mark.parametrize("world,strategy,outer", [(1, "optim_grads_params", None)] + STRATEGY_MESHES)
def test_offloaded_training_is_bit_identical(world, strategy, outer):
    results = run_distributed(_compare, world, strategy, outer, shardwise.OffloadPolicy(fraction=1.0))
    _assert_identical(results)
    assert results[0][1][3] == ["cpu"]


def test_offloading_part_of_the_model_and_accumulating_is_bit_identical():
    results = run_distributed(_compare, 2, "optim_grads_params", None, shardwise.OffloadPolicy(fraction=0.5), True, 2)
    _assert_identical(results)


def _which_groups(policy):
    model = _sharded(policy)
    return sorted(g.name for g in model.sharded_state.groups if g.offloaded)


def test_the_policy_chooses_units_by_fraction_or_by_name():
    half = run_distributed(_which_groups, 1, shardwise.OffloadPolicy(fraction=0.5))[0]
    named = run_distributed(_which_groups, 1, shardwise.OffloadPolicy(units=["blocks.1"]))[0]
    none = run_distributed(_which_groups, 1, shardwise.OffloadPolicy(fraction=0.0))[0]
    everything = run_distributed(_which_groups, 1, shardwise.OffloadPolicy(fraction=1.0))[0]
    assert half and half[0].startswith("blocks.0") and set(half) < set(everything), (half, everything)
    assert not any(n.startswith("<root>") for n in half), "units go first, in unit_modules order"
    assert named and all(n.startswith("blocks.1") for n in named), named
    assert none == []


def test_bad_policies_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="fraction=1.5"):
        shardwise.OffloadPolicy(fraction=1.5)
    with pytest.raises(TypeError, match="units"):
        shardwise.OffloadPolicy(units="blocks.0")
    with pytest.raises(AssertionError, match="ValueError: OffloadPolicy.units: 'nope' is not a unit"):
        run_distributed(_which_groups, 1, shardwise.OffloadPolicy(units=["nope"]))  # raised on the rank


def _resume_across(save_offloaded: bool, folder: str):
    """Train 2 steps, checkpoint, train 2 more; then resume the checkpoint with the other choice."""
    from shardwise.checkpoint import CheckpointManager

    def build(offloaded: bool):
        model = _sharded(offloaded, strategy="optim_grads_params")
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def steps(model, opt, first, count):
        out = []
        for step in range(first, first + count):
            loss = _local_loss(model, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        return out

    model, opt = build(save_offloaded)
    steps(model, opt, 0, 2)
    CheckpointManager(folder).save(2, model, opt)
    straight = steps(model, opt, 2, 2)
    model, opt = build(not save_offloaded)
    CheckpointManager(folder).load_latest(model, opt)
    resumed = steps(model, opt, 2, 2)
    return straight, resumed


@pytest.mark.parametrize("save_offloaded", [False, True], ids=["device_to_host", "host_to_device"])
def test_checkpoints_move_between_offloaded_and_device_runs(save_offloaded, tmp_path):
    for straight, resumed in run_distributed(_resume_across, 2, save_offloaded, str(tmp_path)):
        assert _same(straight, resumed)


def _backward_optimizer(offloaded: bool):
    model = _sharded(offloaded)
    opt = shardwise.BackwardOptimizer(model, torch.optim.AdamW, lr=1e-2)
    losses = []
    for step in range(3):
        loss = _local_loss(model, step)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def _backward_optimizer_both():
    return _backward_optimizer(False), _backward_optimizer(True)


def test_a_backward_optimizer_steps_offloaded_groups_on_the_host_identically():
    for (losses, weights), (o_losses, o_weights) in run_distributed(_backward_optimizer_both, 2):
        assert _same(losses, o_losses)
        assert all(_same(weights[n], o_weights[n]) for n in weights)


def _kept_grads(offloaded: bool):
    """Two backwards with no zero_grad between: the second adds onto the grads the first installed."""
    model = _sharded(offloaded)
    for step in range(2):
        _local_loss(model, step).backward()
    return {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters() if p.grad is not None}


def _kept_grads_both():
    return _kept_grads(False), _kept_grads(True)


def test_grads_kept_across_backwards_accumulate_as_on_the_device():
    for plain, off in run_distributed(_kept_grads_both, 2):
        assert plain.keys() == off.keys() and plain
        assert all(_same(plain[n], off[n]) for n in plain)
