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
