"""A distributed script started without torchrun ends in one line saying to use torchrun, not torch's traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.helpers import REPO


@pytest.mark.slow
def test_a_script_run_without_torchrun_is_told_to_use_it(tmp_path):
    script = tmp_path / "example.py"
    script.write_text("import torch.distributed as dist\nimport shardwise\n\ndist.init_process_group('gloo')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and done.stderr.splitlines() == [
        "example.py: error: RANK is not set: this is a distributed script; start it with torchrun, e.g. "
        "`torchrun --nproc-per-node 2 example.py` (CPU: gloo; one process per GPU)"], done.stderr


def test_other_uncaught_errors_keep_their_traceback(capsys):
    import shardwise  # noqa: F401 -- installs the hook

    try:
        raise ValueError("something else")
    except ValueError as e:
        sys.excepthook(type(e), e, e.__traceback__)
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "ValueError: something else" in err
