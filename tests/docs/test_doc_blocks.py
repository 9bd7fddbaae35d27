"""Every code block of README.md and docs/*.md runs as written, in page order, on the CPU.

Each page runs in a fresh folder through ``tests/helpers/doc_runner.py`` (one process per page: its
python blocks share it; bash blocks and torchrun scripts are its children). A block that cannot run
here carries a ``<!-- doc-runner: skip (REASON) -->`` marker in the page; the end of the test run lists,
per page, the blocks run and the blocks skipped with their reasons. Nothing may be written into the
repository (the blocks run elsewhere; a block that wrote into the checkout by an absolute path fails).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from tests.helpers import REPO
from tests.helpers.doc_runner import RUN_LANGUAGES, blocks

PAGES = ["README.md"] + sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md"))
REPORT: list[str] = []  # printed at the end of the run (conftest.py)
PAGE_TIMEOUT_S = 900


def _untracked() -> set[str] | None:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


@pytest.mark.parametrize("page", PAGES)
def test_the_pages_code_blocks_run_as_written(page, tmp_path):
    code = [b for b in blocks((REPO / page).read_text()) if b.lang in RUN_LANGUAGES]
    if not code:
        REPORT.append(f"{page}: no bash or python blocks")
        return
    before = _untracked()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    done = subprocess.run([sys.executable, "-m", "tests.helpers.doc_runner", str(REPO / page)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=PAGE_TIMEOUT_S)
    tail = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"{page}: a block failed\n{tail}"
    report = json.loads(done.stdout.strip().splitlines()[-1])
    reasons = Counter(reason for _, reason in report["skipped"])
    took = sum(seconds for _, seconds in report["run"])
    REPORT.append(f"{page}: {len(report['run'])} run ({took:.0f} s), {len(report['skipped'])} skipped"
                  + "".join(f"\n    skipped x{n}: {reason}" for reason, n in reasons.items()))
    assert len(report["run"]) + len(report["skipped"]) == len(code)
    after = _untracked()
    assert before is None or after is None or after <= before, f"{page} wrote into the repository: {after - before}"
