"""One run per folder: refuse to mix runs, say what --resume finds, find an unusable checkpoint folder at
start, and describe a resumed run (on another number of ranks) as one whole run."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from shardwise.app.launch import launch_local
from shardwise.app.train import main, prepare_run_folder, resolve_config

from tests.helpers import REPO

TINY = ["--preset", "tiny", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1",
        "--ffn-hidden", "64", "--seq-len", "32", "--micro-batch-size", "2", "--warmup-steps", "1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(Path(json.__file__).read_bytes() * 4)  # small and fast to load
    return str(path)


def _earlier_run(folder: Path) -> dict[str, bytes]:
    (folder / "checkpoints" / "step_00000002").mkdir(parents=True)
    (folder / "checkpoints" / "step_00000002" / "COMPLETE").write_text("step 2\n")
    (folder / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (folder / "summary.json").write_text("{}\n")
    (folder / "notes.txt").write_text("mine\n")
    return _snapshot(folder)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else b"" for p in folder.rglob("*")}


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


# ------------------------------------------------------------------ refusing to mix runs
@pytest.mark.parametrize("how", ["out-dir", "name"])
def test_a_folder_holding_a_run_is_refused_without_resume_or_overwrite(how, tmp_path, monkeypatch, capsys, data):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "runs" / "x" if how == "name" else tmp_path / "x"
    before = _earlier_run(folder)
    flag = ["--name", "x"] if how == "name" else ["--out-dir", str(folder)]
    assert main(TINY + ["--data", data, "--save-every", "1"] + flag) == 2
    line = _error_line(capsys)
    shown = f"--name x: runs{os.sep}x" if how == "name" else f"--out-dir {folder}:"
    assert line.startswith(f"shardwise train: error: {shown} already holds a run (metrics.jsonl with 2 steps, "
                           f"summary.json, 1 checkpoint folder(s) in checkpoints/)"), line
    assert "add --resume to continue it or --overwrite to replace it" in line
    assert _snapshot(folder) == before  # nothing touched


def test_overwrite_deletes_the_earlier_run_and_nothing_else(tmp_path, capsys, data):
    folder = tmp_path / "x"
    _earlier_run(folder)
    (folder / "loss.png").write_bytes(b"png")
    cfg, _ = resolve_config(TINY + ["--data", data, "--out-dir", str(folder), "--overwrite", "--save-every", "1"])
    prepare_run_folder(cfg)
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoints", "notes.txt"]
    assert list((folder / "checkpoints").iterdir()) == []
    assert _error_line(capsys).startswith(f"shardwise train: --overwrite: deleted the earlier run in {folder}")


def test_resume_without_a_checkpoint_says_so_or_fails_when_required(tmp_path, capsys, data):
    folder = tmp_path / "x"
    assert main(TINY + ["--data", data, "--out-dir", str(folder), "--resume=required"]) == 2
    assert _error_line(capsys) == (f"shardwise train: error: --resume=required: no complete checkpoint in "
                                   f"{folder / 'checkpoints'}")
    assert not folder.exists()  # refused: no empty folders left behind
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    assert main(TINY + ["--data", data, "--out-dir", str(folder), "--resume=required"]) == 2
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"] and "--resume=required" in _error_line(capsys)
    (folder / "checkpoints" / "step_00000004.tmp").mkdir(parents=True)  # a save that never finished
    cfg, _ = resolve_config(TINY + ["--data", data, "--out-dir", str(folder), "--resume"])
    prepare_run_folder(cfg)
    assert _error_line(capsys) == (f"shardwise train: --resume: no complete checkpoint in {folder / 'checkpoints'}; "
                                   f"starting at step 1")


# ------------------------------------------------------------------ an unusable checkpoint folder
def test_a_checkpoint_folder_that_cannot_be_made_is_found_at_start(tmp_path, capsys, monkeypatch, data):
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "checkpoints").write_text("a file where the checkpoint folder should be\n")
    assert main(TINY + ["--data", data, "--out-dir", str(blocked), "--save-every", "2"]) == 2
    assert _error_line(capsys) == (f"shardwise train: error: --out-dir {blocked}: checkpoint folder "
                                   f"{blocked / 'checkpoints'}: a file is in the way (not a folder)")

    under_file = tmp_path / "afile" / "run"
    (tmp_path / "afile").write_text("")
    assert main(TINY + ["--data", data, "--out-dir", str(under_file)]) == 2
    line = _error_line(capsys)
    assert line.startswith(f"shardwise train: error: --out-dir {under_file}: cannot write there: Not a directory")

    read_only = tmp_path / "ro"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):  # what a read-only file system answers (tests run as root here)
        if self.name == "checkpoints":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert main(TINY + ["--data", data, "--out-dir", str(read_only), "--resume"]) == 2
    assert _error_line(capsys) == (f"shardwise train: error: --out-dir {read_only}: checkpoint folder "
                                   f"{read_only / 'checkpoints'}: cannot write there: Read-only file system")


def test_a_checkpoint_folder_that_fails_mid_run_is_one_line(tmp_path, capsys, monkeypatch, data):
    """Read-only (or full) after the first save: the run stops with one line, no traceback, step 2 kept."""
    from shardwise.app.launch import free_port

    for var, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(var, value)  # under a launcher: this process is the one worker
    out = tmp_path / "run"
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name == "step_00000004.tmp":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert main(TINY + ["--data", data, "--out-dir", str(out), "--steps", "4", "--save-every", "2"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("tiny")]
    tmp = out / "checkpoints" / "step_00000004.tmp"
    assert err[-1] == (f"shardwise train: error: step 4, checkpoint save: cannot create {tmp}: [Errno 30] "
                       f"Read-only file system: '{tmp}'"), err
    assert not any("Traceback" in line for line in err), err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]


# ------------------------------------------------------------------ a resumed run is one run
def _train_then_list_threads(cfg, model_cfg, started_at):
    """``train`` in a worker, then fail if a process group's threads outlived it."""
    from shardwise.app.train import train

    train(cfg, model_cfg, started_at)
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    left = [n for n in names if "gloo" in n or "tcpstore" in n or "nccl" in n.lower()]
    if left:
        raise RuntimeError(f"threads of destroyed process groups still run after train(): {left}")


@pytest.mark.slow
def test_resume_on_one_rank_continues_the_whole_run(tmp_path, data):
    out = tmp_path / "run"
    cfg, model_cfg = resolve_config(TINY + ["--data", data, "--out-dir", str(out), "--steps", "2",
                                            "--save-every", "2", "--nproc", "2", "--timeout", "60"])
    prepare_run_folder(cfg)
    # Two ranks: train and exit with no process-group thread left running (they used to live into
    # interpreter shutdown, where about 1 run in 15 died with SIGABRT).
    assert launch_local(_train_then_list_threads, 2, (cfg, model_cfg, time.time()), "test") == 0
    (out / "checkpoints" / "step_00000001.tmp").mkdir()  # leftovers of a save that died: warned about

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "shardwise", "train", *TINY, "--data", data, "--out-dir", str(out),
           "--steps", "4", "--nproc", "1", "--resume"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("tiny x")]  # progress bar
    assert f"shardwise train: resumed from {out / 'checkpoints' / 'step_00000002'} (step 2)" in lines
    assert ("shardwise train: global batch changes from 4 to 2 sequences per step (2 ranks x micro-batch 2 x "
            "grad-accum 1 -> 1 ranks x micro-batch 2 x grad-accum 1); --keep-global-batch keeps it") in lines
    schedule = [line for line in lines if line.startswith("shardwise train: lr: continues from")]
    assert len(schedule) == 1 and "--steps 2 -> 4" in schedule[0], lines
    # Warnings are one line each, without the source line Python would echo under them.
    warned = [line for line in lines if "incomplete checkpoint folder" in line]
    assert warned and all(line.startswith("shardwise train: warning: ignoring 1 incomplete") for line in warned)
    assert not re.search(r"\.py:\d+: \w*Warning", proc.stderr), proc.stderr

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert [r["launch"] for r in records] == [1, 1, 2, 2]
    per_step = 2 * 32  # micro-batch 2 x seq 32 per rank
    assert [r["tokens"] for r in records] == [2 * per_step, 4 * per_step, 5 * per_step, 6 * per_step]
    lrs = [r["lr"] for r in records]
    assert lrs[0] == pytest.approx(2e-3) and 0.5 * lrs[1] <= lrs[2] <= lrs[1] * (1 + 1e-9), lrs  # no jump

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["launches"] == 2 and summary["resumed_at"] == [3]
    assert summary["first_loss"] == records[0]["loss"] and summary["tokens"] == 6 * per_step
    steady = [records[1], records[3]]  # each launch's first step is left out
    expected = (2 * per_step + per_step) / sum(r["step_time_s"] for r in steady)
    assert summary["tokens_per_s"] == pytest.approx(expected, rel=1e-6)
    assert (out / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert "4 steps (resumed at step 3)" in proc.stdout


_KILLED_AFTER_SAVE = """
import os, sys
from shardwise.checkpoint.manager import CheckpointManager
from shardwise.app.train import main

real_save = CheckpointManager.save

def save_then_die(self, step, *args, **kwargs):
    path = real_save(self, step, *args, **kwargs)
    if step == 2:
        os._exit(9)  # killed right after the checkpoint became visible
    return path

CheckpointManager.save = save_then_die
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_kill_right_after_a_save_keeps_that_steps_metrics(tmp_path, data):
    from shardwise.app.launch import free_port

    out = tmp_path / "run"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _KILLED_AFTER_SAVE, *TINY, "--data", data, "--steps", "4",
                           "--save-every", "2", "--out-dir", str(out), "--device", "cpu"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr[-2000:]
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").exists()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2], steps  # the step the checkpoint covers is in the metrics
