"""Checkpoint integrity: checksums, pruning, optimizer type, damaged files, shared folders, write errors;
and checkpoints written before the standard-path rewrite still load.

Each test failed before: corrupted bytes loaded silently, a kill while pruning could leave a folder with
COMPLETE but without a shard, AdamW state went into SGD, a per-node folder was accepted at save, and a
file-size limit surfaced as torch's ``unexpected pos`` without the checkpoint's name.
"""

from __future__ import annotations

import json
import resource
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardwise
import shardwise.checkpoint.manager as manager_module
from shardwise.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    CheckpointMismatchError,
    CheckpointSaveError,
    gather_full_optimizer_state,
)
from shardwise.app.ckpt import main as ckpt_main

from tests.checkpoint.test_checkpoint import _build, _equal_nested, _global_batch_step
from tests.helpers import DATA
from tests.helpers.distributed import run_distributed
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM

V1 = DATA / "checkpoint_v1"


def _error(fn, *args, **kwargs) -> tuple[str, str]:
    try:
        fn(*args, **kwargs)
    except (CheckpointError, CheckpointMismatchError, FileNotFoundError) as e:
        return type(e).__name__, str(e)
    return "none", ""


def _tensor_range(step_dir: Path, key: str) -> tuple[str, int, int]:
    """(file, offset, length) of the largest stored chunk of ``key`` (DCP's file names vary by torch version)."""
    md = dcp.FileSystemReader(str(step_dir)).read_metadata()
    chunks = [info for index, info in md.storage_data.items() if index.fqn == key and info.length > 1000]
    if not chunks:
        raise AssertionError(f"no chunk of {key} in {step_dir}")
    info = max(chunks, key=lambda i: i.length)
    return info.relative_path, info.offset, info.length


# ------------------------------------------------------------------ damaged files, found at load
def _damage_body(root: str):
    rank = dist.get_rank()
    model, opt = _build(seed=0)
    _global_batch_step(model, opt, 0)
    manager = CheckpointManager(root)
    path = manager.save(1, model, opt)
    meta = json.loads((path / "shardwise.json").read_text())
    results = {"files": sorted(meta["files"]), "complete": (path / "COMPLETE").read_text()}
    pristine = {name: (path / name).read_bytes() for name in [*meta["files"], "shardwise.json"]}

    def damage(how):
        dist.barrier()
        if rank == 0:
            how()
        dist.barrier()

    def restore():
        for name, data in pristine.items():
            (path / name).write_bytes(data)

    file, offset, length = _tensor_range(path, "optim/embed.weight/exp_avg_sq")
    results["flipped_file"] = file

    def flip():  # one byte in the middle of a tensor's bytes: same size, other values
        data = bytearray(pristine[file])
        data[offset + length // 2] ^= 0x40
        (path / file).write_bytes(bytes(data))

    cases = {
        "flipped": flip,
        "truncated_metadata": lambda: (path / ".metadata").write_bytes(pristine[".metadata"][:200]),
        "missing_shard": lambda: (path / "__0_0.distcp").unlink(),
        "json_garbage": lambda: (path / "shardwise.json").write_text('{"format": "shardwise-dcp/2", "st'),
        "json_edited": lambda: (path / "shardwise.json").write_bytes(pristine["shardwise.json"].replace(
            b'"world_size": 2', b'"world_size": 3')),
    }
    for name, how in cases.items():
        damage(how)
        results[name] = _error(manager.load_latest, *_build(seed=1))
        damage(restore)
    # Without verification the damaged .metadata still gets one message naming it.
    damage(cases["truncated_metadata"])
    results["truncated_metadata_unverified"] = _error(manager.load_latest, *_build(seed=1), verify=False)
    damage(restore)
    fresh, fresh_opt = _build(seed=1)
    restored = manager.load_latest(fresh, fresh_opt)  # intact again
    results["restored"] = restored.step
    results["same"] = _equal_nested(shardwise.full_state_dict(model),
                                    shardwise.full_state_dict(fresh))
    return results


def test_damaged_checkpoint_files_are_named_on_every_rank(tmp_path, capsys):
    results = run_distributed(_damage_body, 2, str(tmp_path))
    assert results[0] == results[1]  # every rank raises the same error
    r = results[0]
    step = tmp_path / "step_00000001"
    assert r["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert r["complete"].startswith("step 1\nshardwise.json sha256 ")
    kind, message = r["flipped"]
    assert kind == "CheckpointCorruptError" and f"{step / r['flipped_file']} holds other bytes" in message
    assert "previous checkpoint" in message
    kind, message = r["truncated_metadata"]
    assert kind == "CheckpointCorruptError" and f"{step / '.metadata'} is truncated: 200 bytes" in message
    kind, message = r["truncated_metadata_unverified"]
    assert kind == "CheckpointCorruptError"
    assert f"{step / '.metadata'} cannot be read, it is truncated or corrupted" in message
    kind, message = r["missing_shard"]
    assert kind == "CheckpointCorruptError" and f"{step / '__0_0.distcp'} is missing" in message
    kind, message = r["json_garbage"]
    assert kind == "CheckpointCorruptError" and str(step / "shardwise.json") in message
    assert "differs from the one written at save" in message
    kind, message = r["json_edited"]
    assert kind == "CheckpointCorruptError" and "differs from the one written at save" in message
    assert r["restored"] == 1 and r["same"] == []

    # shardwise ckpt verify: 0 when intact, 1 naming the file when not.
    capsys.readouterr()
    assert ckpt_main(["verify", str(tmp_path)]) == 0
    assert "ok" in capsys.readouterr().out
    data = bytearray((step / "__0_0.distcp").read_bytes())
    data[-100] ^= 1
    (step / "__0_0.distcp").write_bytes(bytes(data))
    assert ckpt_main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and str(step / "__0_0.distcp") in out
    assert ckpt_main(["export", str(tmp_path), str(tmp_path / "out")]) == 2  # export verifies first
    assert str(step / "__0_0.distcp") in capsys.readouterr().err


# ------------------------------------------------------------------ ranks that do not share the folder
def _not_shared_body(root: str):
    rank = dist.get_rank()
    model, opt = _build(seed=0)
    own = CheckpointManager(Path(root) / f"node{rank}")  # a node-local path: each rank its own folder
    save_error = _error(own.save, 1, model, opt)

    shared = CheckpointManager(Path(root) / "shared")
    shared.save(2, model, opt)
    if rank == 0:  # node 1's disk holds an older copy of the same step
        shutil.copytree(Path(root) / "shared", Path(root) / "copy")
    dist.barrier()
    _global_batch_step(model, opt, 0)
    shared.save(2, model, opt)  # step 2 again, other weights
    view = CheckpointManager(Path(root) / ("shared" if rank == 0 else "copy"))
    load_error = _error(view.load_latest, *_build(seed=1))
    missing = CheckpointManager(Path(root) / ("shared" if rank == 0 else "empty"))
    missing_error = _error(missing.load_latest, *_build(seed=1))
    return save_error, sorted(p.name for p in (Path(root) / "node0").iterdir()), load_error, missing_error


def test_a_folder_that_is_not_shared_is_refused_at_save_and_load(tmp_path):
    results = run_distributed(_not_shared_body, 2, str(tmp_path))
    assert results[0] == results[1]
    (kind, message), left, (load_kind, load_message), (missing_kind, missing_message) = results[0]
    assert kind == "CheckpointSaveError"
    assert f"checkpoint folder {tmp_path / 'node0'} is not one folder shared by every rank" in message
    assert "rank 1" in message and "step_00000001.tmp" in message
    assert left == []  # nothing committed
    assert load_kind == "CheckpointCorruptError" and "differs across ranks" in load_message
    assert "step_00000002" in load_message and "shared by every rank" in load_message
    assert missing_kind == "CheckpointCorruptError" and "differs across ranks" in missing_message
    assert f"{tmp_path / 'empty' / 'step_00000002'} does not exist" in missing_message


# ------------------------------------------------------------------ a write that fails
def _write_fails_body(root: str):
    model, opt = _build(seed=0)
    _global_batch_step(model, opt, 0)
    manager = CheckpointManager(root)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if dist.get_rank() == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (16_000, hard))  # Python ignores SIGXFSZ: writes fail
    try:
        error = _error(manager.save, 1, model, opt)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    path = manager.save(2, model, opt)  # the limit gone, saving works again
    return error, path.name, [s for s, _ in manager.checkpoints()]


def test_a_write_failure_is_one_error_naming_the_folder(tmp_path):
    results = run_distributed(_write_fails_body, 2, str(tmp_path))
    assert results[0] == results[1]
    (kind, message), name, steps = results[0]
    assert kind == "CheckpointSaveError"
    assert message.startswith(f"could not save checkpoint step 1: writing {tmp_path / 'step_00000001.tmp'} failed")
    assert "rank 1" in message and "file size limit" in message and "\n" not in message
    assert name == "step_00000002" and steps == [2]


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("keep_last,message", [
    ("3", "keep_last='3' must be a whole number of at least 1"),
    (0, "keep_last=0 must be a whole number of at least 1"),
    (True, "keep_last=True must be a whole number"),
    (2.5, "keep_last=2.5 must be a whole number"),
    (None, None),  # keep every checkpoint
    (1, None),
])
def test_manager_arguments_are_named(tmp_path, keep_last, message):
    if message is None:
        assert CheckpointManager(tmp_path, keep_last=keep_last).keep_last == keep_last
        return
    with pytest.raises(ValueError) as e:
        CheckpointManager(tmp_path, keep_last=keep_last)
    assert message in str(e.value) and "\n" not in str(e.value)


# ------------------------------------------------------------------ optimizer type
def _optimizer_body(root: str):
    model, opt = _build(seed=0)
    CheckpointManager(Path(root) / "fresh").save(0, model, opt)  # before any step: the optimizer has no state
    untouched = not opt.state  # (torch's get_optimizer_state_dict would have created it with a zero-lr step)
    fresh, fresh_opt = _build(seed=1)
    CheckpointManager(Path(root) / "fresh").load_latest(fresh, fresh_opt)
    untouched = untouched and not fresh_opt.state
    _global_batch_step(model, opt, 0)
    CheckpointManager(Path(root) / "adamw").save(1, model, opt)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _global_batch_step(model, sgd, 1)
    CheckpointManager(Path(root) / "sgd").save(2, model, sgd)
    into_sgd = _error(CheckpointManager(Path(root) / "adamw").load_latest, model,
                      torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    into_adamw = _error(CheckpointManager(Path(root) / "sgd").load_latest, *_build(seed=1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other, other_opt = _build(seed=1)
        CheckpointManager(Path(root) / "sgd").load_latest(other, other_opt, strict=False)
    return into_sgd, into_adamw, not other_opt.state, [str(w.message) for w in caught], untouched


def test_optimizer_type_mismatch_is_refused_by_name(tmp_path):
    into_sgd, into_adamw, left_alone, messages, untouched = run_distributed(_optimizer_body, 2, str(tmp_path))[0]
    assert untouched
    assert into_sgd[0] == "CheckpointMismatchError"
    assert "its optimizer state is AdamW's and this optimizer is SGD" in into_sgd[1]
    assert into_adamw[0] == "CheckpointMismatchError"
    assert "its optimizer state is SGD's and this optimizer is AdamW" in into_adamw[1]
    assert left_alone and any("the optimizer is left as it is" in m for m in messages)


# ------------------------------------------------------------------ pruning
def _fake_checkpoint(path: Path, step: int) -> None:
    path.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "shardwise.json"):
        (path / name).write_bytes(b"x" * 100)
    (path / "COMPLETE").write_text(f"step {step}\n")


def test_a_kill_while_pruning_never_leaves_a_complete_looking_folder_without_files(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        _fake_checkpoint(tmp_path / f"step_{step:08d}", step)
    real_rmtree = shutil.rmtree

    def killed_half_way(path, *args, **kwargs):  # deletes one shard, then the process is gone
        next(Path(path).glob("*.distcp")).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(manager_module.shutil, "rmtree", killed_half_way)
    manager = CheckpointManager(tmp_path, keep_last=2)
    with pytest.raises(KeyboardInterrupt):
        manager._prune(3)
    for path in tmp_path.iterdir():
        if manager_module.is_complete(path):
            assert len(list(path.glob("*.distcp"))) == 2, f"{path} looks complete but lost a shard"
    assert [s for s, _ in manager.checkpoints()] == [2, 3]
    monkeypatch.setattr(manager_module.shutil, "rmtree", real_rmtree)
    manager._prune(3)  # the next save's pruning removes the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000002", "step_00000003"]


# ------------------------------------------------------------------ checkpoints from before
def _load_v1(root: str, strategy: str):
    expected = torch.load(Path(root) / "expected.pt")
    torch.manual_seed(3)
    model = shardwise.fully_shard(TinyLM(TinyConfig(**expected["config"])), strategy=strategy, unit_modules=[Block])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RNG not restored on another world size
        restored = CheckpointManager(root).load_latest(model, opt)
    params = shardwise.full_state_dict(model, include_tied=False)
    optim = gather_full_optimizer_state(model, opt)
    if dist.get_rank():
        return None
    return (restored.step, restored.extra, _equal_nested(expected["model"], params),
            _equal_nested(expected["optim"], optim))


@pytest.mark.parametrize("world,strategy", [(1, "no_shard"), (2, "optim")])
def test_a_checkpoint_written_before_the_standard_path_loads(tmp_path, world, strategy):
    """``tests/helpers/data/checkpoint_v1``: written on 2 ranks (ZeRO-3) by shardwise at 5180ee1, when shards were
    whole-row ranges of a flat buffer (not ``torch.chunk``'s) and shardwise.json had no checksums."""
    root = tmp_path / "v1"
    shutil.copytree(V1, root)
    step, extra, model_diff, optim_diff = run_distributed(_load_v1, world, str(root), strategy)[0]
    assert step == 2 and model_diff == [] and optim_diff == []
    assert extra == {"data": {"position": 8}, "rank": 0}
    assert ckpt_main(["verify", str(root)]) == 0


def test_checkpoints_shardwise_cannot_read_are_refused_with_what_to_do(tmp_path, capsys):
    plain = tmp_path / "plain"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=str(plain), no_dist=True)
    assert ckpt_main(["info", str(plain)]) == 2
    err = capsys.readouterr().err
    assert "not written by shardwise.checkpoint" in err and "get_model_state_dict" in err

    garbled = tmp_path / "garbled" / "step_00000002"  # no checksum of shardwise.json in a v1 COMPLETE
    shutil.copytree(V1 / "step_00000002", garbled)
    (garbled / "shardwise.json").write_text('{"format": "shardwise-dcp/1", "step": 2,,')
    assert ckpt_main(["info", str(garbled)]) == 2
    err = capsys.readouterr().err
    assert f"{garbled / 'shardwise.json'} is not valid JSON" in err and "\n" not in err.strip()

    newer = tmp_path / "newer" / "step_00000002"
    shutil.copytree(V1 / "step_00000002", newer)
    meta = json.loads((newer / "shardwise.json").read_text())
    (newer / "shardwise.json").write_text(json.dumps({**meta, "format": "shardwise-dcp/9"}))
    assert ckpt_main(["export", str(newer), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "format 'shardwise-dcp/9'" in err and "shardwise ckpt export" in err
