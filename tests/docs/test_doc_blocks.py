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
PAGE_TIMEOUT_S = 900


def _untracked() -> set[str] | None:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=REPO,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.parametrize("page", PAGES)
def test_the_pages_code_blocks_run_as_written(page, tmp_path, record_property):
    code = [b for b in blocks((REPO / page).read_text()) if b.lang in RUN_LANGUAGES]
    if not code:
        record_property("doc-runner", f"{page}: no bash or python blocks")  # listed at the end (conftest.py)
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
    record_property("doc-runner", f"{page}: {len(report['run'])} run ({took:.0f} s), {len(report['skipped'])} skipped"
                    + "".join(f"\n    skipped x{n}: {reason}" for reason, n in reasons.items()))
    assert len(report["run"]) + len(report["skipped"]) == len(code)
    after = _untracked()
    assert before is None or after is None or after <= before, f"{page} wrote into the repository: {after - before}"


@pytest.mark.slow
def test_the_runner_reads_markers_and_fails_on_a_broken_block(tmp_path, monkeypatch):
    """The runner's own rules: fences inside list items, the markers, torchrun for a process group, and a
    failing block fails the page, naming its line."""
    page = tmp_path / "page.md"
    page.write_text("""# a page
- an item:

  ```bash
  echo indented > made.txt
  ```
<!-- doc-runner: skip (needs CUDA) -->
```python
raise SystemExit("never run")
```
<!-- doc-runner: heavy (minutes) -->

```bash
exit 3
```
```python
import torch.distributed as dist  # torchrun --nproc-per-node 3 this.py
dist.init_process_group("gloo")
```
```text
not code
```
```bash
test -f made.txt && false
```
""")
    monkeypatch.delenv("SHARDWISE_DOCS_HEAVY", raising=False)
    found = blocks(page.read_text())
    assert [(b.line, b.lang, b.skip, b.torchrun) for b in found] == [
        (4, "bash", None, 0), (8, "python", "needs CUDA", 0),
        (13, "bash", "heavy: minutes (SHARDWISE_DOCS_HEAVY=1 runs it)", 0), (16, "python", None, 3),
        (20, "text", None, 0), (23, "bash", None, 0)]
    assert found[0].code == "echo indented > made.txt\n"
    page.write_text(page.read_text().replace('```python\nimport torch.distributed as dist  # torchrun --nproc-per-node '
                                             '3 this.py\ndist.init_process_group("gloo")\n```\n', ""))
    done = subprocess.run([sys.executable, "-m", "tests.helpers.doc_runner", str(page)], cwd=tmp_path, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert done.returncode == 1 and "page.md:19: exit status 1" in done.stdout, done.stdout
    assert (tmp_path / "made.txt").read_text() == "indented\n"  # the blocks before it ran, in the page's folder
