"""Distributed checkpoints: exact resume, resharding, atomic saves under failure, strict loading."""

from __future__ import annotations

import os
import random
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

import shardwise
from shardwise.app.launch import free_port
from shardwise.checkpoint import (
    CheckpointManager,
    CheckpointMismatchError,
    gather_full_optimizer_state,
)
from shardwise.app.data import TokenLoader

from tests.helpers.distributed import device, process_context, run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch


def _build(strategy="optim_grads_params", outer=None, seed=0, config=None, bf16=False):
    torch.manual_seed(seed)
    config = config or TinyConfig()
    mesh = shardwise.build_dp_mesh(outer=2) if outer else None
    policy = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
    model = shardwise.fully_shard(TinyLM(config).to(device()), mesh, strategy=strategy,
                                  outer_dp_sharding_strategy=outer, unit_modules=[Block], mixed_precision=policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _global_batch_step(model, opt, step, config=TinyConfig(), global_batch=8) -> float:
    """One step on this rank's slice of a fixed global batch; the mean loss over ranks."""
    rank, world = dist.get_rank(), dist.get_world_size()
    per = global_batch // world
    tokens, targets = (t[rank * per:(rank + 1) * per].to(device()) for t in batch(step, global_batch, config))
    loss = model(tokens, targets)
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


def _equal_nested(a: dict, b: dict) -> list[str]:
    """Names whose values differ (tensors bit for bit)."""
    bad = sorted(set(a) ^ set(b))
    for key in set(a) & set(b):
        x, y = a[key], b[key]
        if isinstance(x, dict):
            bad += [f"{key}.{k}" for k in _equal_nested(x, y)]
        elif isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x, y):
                bad.append(key)
        elif x != y:
            bad.append(key)
    return bad


# ------------------------------------------------------------------ 1. exact resume
_TOKENS_SEED = 5


def _random_step(model, opt, loader, config) -> float:
    """A step whose result depends on the data position and on torch, Python and NumPy RNG."""
    inputs, targets = next(loader)
    dropped = torch.rand(targets.shape, device=targets.device) < 0.2  # per-rank, torch RNG
    targets = targets.masked_fill(dropped, -100)
    jitter = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.rand())
    loss = model(inputs, targets) * jitter
    loss.backward()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item()


def _seed_everything(seed: int) -> None:
    rank = dist.get_rank()
    torch.manual_seed(seed + rank)
    random.seed(seed + rank)
    np.random.seed(seed + rank)


def _resume_body(path: str, strategy: str, bf16: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    config = TinyConfig()
    tokens = np.random.default_rng(_TOKENS_SEED).integers(0, config.vocab, 5000)

    def loader():
        return TokenLoader(tokens, config.seq, 4, rank, world, seed=3, device=device())

    # Ten steps in one go.
    model, opt = _build(strategy, seed=0, bf16=bf16)
    _seed_everything(100)
    data = loader()
    straight = [_random_step(model, opt, data, config) for _ in range(10)]
    straight_params = shardwise.full_state_dict(model)

    # Five steps, save, forget everything, load, five more.
    model, opt = _build(strategy, seed=0, bf16=bf16)
    _seed_everything(100)
    data = loader()
    manager = CheckpointManager(path, keep_last=2)
    first = [_random_step(model, opt, data, config) for _ in range(5)]
    manager.save(5, model, opt, extra={"data": data.state_dict(), "note": "five"})
    del model, opt, data
    _seed_everything(999)  # whatever the RNG holds now must not matter
    model, opt = _build(strategy, seed=1234, bf16=bf16)
    data = loader()
    restored = manager.load_latest(model, opt)
    assert restored is not None and restored.step == 5 and restored.rng_restored
    assert restored.extra["note"] == "five"
    data.load_state_dict(restored.extra["data"])
    second = [_random_step(model, opt, data, config) for _ in range(5)]
    resumed_params = shardwise.full_state_dict(model)
    return straight, first + second, _equal_nested(straight_params, resumed_params)


@pytest.mark.parametrize("strategy,bf16", [("optim_grads_params", False), ("optim", False),
                                           ("optim_grads_params", True)])
def test_resume_is_exact_including_data_position_and_rng(tmp_path, strategy, bf16):
    results = run_distributed(_resume_body, 2, str(tmp_path), strategy, bf16)
    for straight, resumed, differing in results:
        assert straight == resumed  # bit for bit (bf16 compute too: weights come from fp32 main weights)
        assert differing == []
    assert results[0][0][-1] < results[0][0][0]  # it trained


# ------------------------------------------------------------------ 2. reshard matrix
def _reshard_source(path: str, strategy: str, outer):
    model, opt = _build(strategy, outer, seed=0)
    for step in range(3):
        _global_batch_step(model, opt, step)
    CheckpointManager(path).save(3, model, opt)
    params = shardwise.full_state_dict(model)
    optim = gather_full_optimizer_state(model, opt)
    losses = [_global_batch_step(model, opt, step) for step in range(3, 6)]
    return params, optim, losses


def _reshard_target(path: str, strategy: str, outer):
    model, opt = _build(strategy, outer, seed=42)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RNG states are per rank: not restored on another world size
        restored = CheckpointManager(path).load_latest(model, opt)
    assert restored.step == 3 and not restored.rng_restored
    params = shardwise.full_state_dict(model)
    optim = gather_full_optimizer_state(model, opt)
    losses = [_global_batch_step(model, opt, step) for step in range(3, 6)]
    return params, optim, losses


@pytest.mark.parametrize(
    "source,targets",
    [
        ((4, "optim_grads_params", None), [(2, "optim", None), (1, "no_shard", None)]),
        ((4, "optim_grads_params", "no_shard"), [(2, "optim_grads", None)]),
        ((2, "no_shard", None), [(4, "optim_grads_params", "optim"), (1, "optim_grads_params", None)]),
    ],
    ids=["zero3x4-to-zero1x2-and-ddp1", "hsdp2x2-to-zero2x2", "ddp2-to-hfsdp2x2-and-zero3x1"],
)
def test_reshard_matrix(tmp_path, source, targets):
    world, strategy, outer = source
    params, optim, losses = run_distributed(_reshard_source, world, str(tmp_path), strategy, outer)[0]
    assert {k for state in optim.values() for k in state} == {"exp_avg", "exp_avg_sq", "step"}
    for t_world, t_strategy, t_outer in targets:
        got_params, got_optim, got_losses = run_distributed(_reshard_target, t_world, str(tmp_path), t_strategy,
                                                            t_outer)[0]
        assert _equal_nested(params, got_params) == []
        assert _equal_nested(optim, got_optim) == []
        # Training goes on as if nothing happened (other world size: other summation order).
        torch.testing.assert_close(torch.tensor(got_losses), torch.tensor(losses), rtol=1e-5, atol=0)


# ------------------------------------------------------------------ 3. failure injection
def _dying_worker(rank: int, world: int, port: int, path: str, out: str) -> None:
    """Save step 1, then die (rank 1, hard exit) half-way through writing step 2."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))
    model, opt = _build(seed=0)
    manager = CheckpointManager(path)
    _global_batch_step(model, opt, 0)
    manager.save(1, model, opt, extra={"step": 1})
    full = shardwise.full_state_dict(model)
    if rank == 0:
        torch.save(full, Path(out) / "saved_at_step_1.pt")
    _global_batch_step(model, opt, 1)
    if rank == 1:
        import torch.distributed.checkpoint as dcp

        original = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            future = original(self, plan, planner)
            future.wait()
            for f in Path(path).glob("step_00000002.tmp/__1_*.distcp"):
                os.truncate(f, f.stat().st_size // 2)  # a torn file, as a crash mid-write leaves
            os._exit(17)

        dcp.FileSystemWriter.write_data = write_then_die
    manager.save(2, model, opt, extra={"step": 2})
    raise AssertionError("unreachable: the save of step 2 cannot complete")


def _load_after_failure(path: str):
    model, opt = _build(seed=7)
    manager = CheckpointManager(path, keep_last=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = manager.load_latest(model, opt)
    messages = [str(w.message) for w in caught]
    full = shardwise.full_state_dict(model)
    # The next save succeeds and clears the dead partial folder.
    _global_batch_step(model, opt, 1)
    manager.save(3, model, opt)
    return restored.step, restored.extra, messages, full


def test_rank_killed_mid_save_leaves_previous_checkpoint_loadable(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    ctx = process_context()
    port = free_port()
    procs = [ctx.Process(target=_dying_worker, args=(r, 2, port, str(ckpt), str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert procs[1].exitcode == 17
    assert procs[0].exitcode != 0  # its collective failed when rank 1 vanished
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["step_00000001", "step_00000002.tmp"]
    assert not (ckpt / "step_00000002.tmp" / "COMPLETE").exists()

    results = run_distributed(_load_after_failure, 2, str(ckpt))
    step, extra, messages, full = results[0]
    assert step == 1 and extra == {"step": 1}
    assert any("incomplete" in m and "step_00000002.tmp" in m for m in messages), messages
    expected = torch.load(out / "saved_at_step_1.pt")
    assert _equal_nested(expected, full) == []
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_00000003"]  # keep_last=1, partial cleared


def _commit_fails_body(path: str):
    """Rank 0 dies (raises) after the shards are written but before the rename: all ranks see it."""
    model, opt = _build(seed=0)
    manager = CheckpointManager(path, keep_last=3)
    _global_batch_step(model, opt, 0)
    manager.save(1, model, opt)
    before = shardwise.full_state_dict(model)
    _global_batch_step(model, opt, 1)

    def crash(*args, **kwargs):
        raise OSError("disk full (injected)")

    if dist.get_rank() == 0:
        manager._commit = crash
    try:
        manager.save(2, model, opt)
    except RuntimeError as e:
        error = str(e)
    else:
        raise AssertionError("the save should have failed on every rank")
    if dist.get_rank() == 0:
        del manager._commit
    model, opt = _build(seed=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = manager.load_latest(model, opt)
    after = shardwise.full_state_dict(model)
    return error, restored.step, [str(w.message) for w in caught], _equal_nested(before, after)


def test_failed_commit_is_reported_on_every_rank_and_ignored_on_load(tmp_path):
    results = run_distributed(_commit_fails_body, 2, str(tmp_path))
    for error, step, messages, differing in results:
        assert "disk full (injected)" in error and "step_00000002" in error
        assert step == 1 and differing == []
    assert any("step_00000002.tmp" in m for m in results[0][2])


# ------------------------------------------------------------------ 4. strict loading, keep-last
def _mismatch_body(path: str):
    model, opt = _build(seed=0)
    manager = CheckpointManager(path, keep_last=2)
    for step in range(1, 5):
        manager.save(step, model, opt)
    kept = [s for s, _ in manager.checkpoints()]
    manager.save(4, model, opt)  # saving a step again replaces it
    saved = shardwise.full_state_dict(model)

    errors = {}
    for name, config in {
        "more_layers": TinyConfig(layers=4),
        "fewer_layers": TinyConfig(layers=2),
        "wider_mlp": TinyConfig(hidden=40),
    }.items():
        other, other_opt = _build(seed=1, config=config)
        try:
            manager.load_latest(other, other_opt)
        except CheckpointMismatchError as e:
            errors[name] = str(e)
    # strict=False loads what fits and says what it skipped.
    other, _ = _build(seed=1, config=TinyConfig(hidden=40))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = manager.load_latest(other, strict=False)
    loaded = shardwise.full_state_dict(other)
    same = [k for k in loaded if k in saved and loaded[k].shape == saved[k].shape and torch.equal(loaded[k], saved[k])]
    # A model checkpoint without optimizer state cannot resume an optimizer (strict).
    CheckpointManager(path + "/model_only").save(1, model)
    try:
        CheckpointManager(path + "/model_only").load_latest(*_build(seed=2))
        no_optim = None
    except CheckpointMismatchError as e:
        no_optim = str(e)
    return kept, errors, restored.skipped, same, [str(w.message) for w in caught], no_optim


def test_loading_into_a_model_that_does_not_fit_lists_the_keys(tmp_path):
    kept, errors, skipped, same, messages, no_optim = run_distributed(_mismatch_body, 2, str(tmp_path))[0]
    assert kept == [3, 4]
    assert "missing from the checkpoint" in errors["more_layers"]
    assert "blocks.3.qkv.weight" in errors["more_layers"] and "blocks.3.fc1.bias" in errors["more_layers"]
    assert "in the checkpoint but not the model" in errors["fewer_layers"]
    assert "blocks.2.odd.weight" in errors["fewer_layers"]
    assert "shape mismatch for blocks.0.fc1.weight: checkpoint (48, 32), model (40, 32)" in errors["wider_mlp"]
    assert "strict=False" in errors["wider_mlp"]
    assert skipped == sorted(f"blocks.{i}.{n}" for i in range(3) for n in ("fc1.bias", "fc1.weight", "fc2.weight"))
    assert "embed.weight" in same and "blocks.2.qkv.weight" in same and "blocks.0.fc2.bias" in same
    assert any("blocks.0.fc1.weight" in m for m in messages)
    assert no_optim is not None and "no optimizer state" in no_optim
