"""``shardwise train --save-every N --resume``: a run resumed from a checkpoint repeats the straight run.

The straight run trains through the command's worker body on the gloo pool (tests.helpers.train_runs: no
launcher to start); the resumed one goes through the command line, which reports what it resumed from.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.distributed import run_distributed
from tests.helpers.train_runs import train_records


ARGS = ["--preset", "tiny", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads",
        "1", "--ffn-hidden", "64", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "4", "--dropout", "0.1",
        "--save-every", "2"]


def _train_command(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    proc = subprocess.run([sys.executable, "-m", "shardwise", "train", *ARGS, "--nproc", "2", "--out-dir", str(out),
                           *extra], cwd=out.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_train_resumes_from_the_latest_checkpoint_exactly(tmp_path):
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    run_distributed(train_records, 2, [*ARGS, "--out-dir", str(straight)])
    assert sorted(p.name for p in (straight / "checkpoints").iterdir()) == ["step_00000002", "step_00000004"]
    # A run that died during step 4's save: its last complete checkpoint is step 2 (its metrics
    # already hold steps 3 and 4, which the resumed run redoes and rewrites).
    shutil.copytree(straight, crashed)
    os.rename(crashed / "checkpoints" / "step_00000004", crashed / "checkpoints" / "step_00000004.tmp")
    proc = _train_command(crashed, "--resume")
    assert "step_00000002" in proc.stderr and "step_00000004.tmp" in proc.stderr  # resumed; partial reported
    assert [step for step, _ in _losses(crashed)] == [1, 2, 3, 4]
    assert _losses(crashed) == _losses(straight)  # data order, dropout RNG and optimizer state restored


def _resume_another_model(first: list[str], again: list[str]) -> tuple[str, bool, str]:
    train_records(first)
    try:
        train_records(again)
    except Exception as e:  # noqa: BLE001 -- what the worker's guard would print
        return type(e).__name__, bool(getattr(e, "one_line", False)), str(e)
    return "", False, "resumed"


def test_resuming_another_model_size_is_one_line_naming_shapes_and_settings(tmp_path):
    """``--resume`` with another ``--dim``: one line (no traceback, no ``strict=False`` no flag offers) naming the
    shapes that differ, the setting the checkpoint was saved with, and what to do."""
    out = str(tmp_path / "run")
    tiny = ["--preset", "tiny", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1",
            "--ffn-hidden", "64", "--seq-len", "32", "--micro-batch-size", "2", "--data",
            str(REPO / "shardwise" / "models"), "--out-dir", out, "--steps", "1", "--save-every", "1"]
    kind, one_line, message = run_distributed(_resume_another_model, 2, tiny, tiny + ["--dim", "64", "--resume",
                                                                                     "--steps", "2"])[0]
    assert kind == "ConfigError" and one_line and "\n" not in message, message
    assert message.startswith("--resume=auto: the checkpoint holds another model: "), message
    assert "tensor shapes differ (" in message and "(256, 32) in the checkpoint, (256, 64) now" in message, message
    assert "it was saved with --dim 32 (now 64)" in message and "strict=False" not in message, message
    assert message.endswith("or start a new run (another --out-dir / --name, or --overwrite to replace this one)")
