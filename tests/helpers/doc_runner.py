"""Run a markdown page's code blocks as a reader would: in page order, in one fresh folder, on the CPU.

``python -m tests.helpers.doc_runner PAGE`` (from any folder: the runner works
in the current one) runs every ```` ```bash ```` and ```` ```python ```` block of
``PAGE``, in order, and stops at the first that fails, naming its line:

* ``python`` blocks run in this one process, sharing one namespace (as if the
  page were one script), except a block that starts a process group
  (``init_process_group``): it is a torchrun script, written to a file and run
  with ``torchrun --standalone --nproc-per-node N`` (``N`` from the block's own
  ``--nproc-per-node N``, else 2);
* ``bash`` blocks run with ``bash -e``; ``python3``, ``python`` and ``torchrun``
  are this interpreter (a folder of links first on ``PATH``), and the repository
  is on ``PYTHONPATH``;
* blocks of other languages, or none (output shown as an illustration), are not run.

Markers, an HTML comment on the line before a block (invisible in the rendered page):

* ``<!-- doc-runner: skip (REASON) -->``: not run (CUDA, several GPUs, files of the
  reader's own, a fragment of a larger program); the reason is reported;
* ``<!-- doc-runner: heavy (REASON) -->``: runs only with ``SHARDWISE_DOCS_HEAVY=1``
  (minutes of CPU: kept out of the suite's budget), else reported as skipped;
* ``<!-- doc-runner: torchrun N -->``: a python block run under torchrun with ``N``
  processes.

The folder holds ``corpus.txt`` (a few hundred KB of Python source as text) for
the blocks that train on "your text". The last output line is a JSON report:
``{"run": [...], "skipped": [[line, reason], ...]}``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^\s*<!--\s*doc-runner:\s*((?P<kind>skip|heavy)\s*\((?P<reason>.*)\)|torchrun\s+(?P<n>\d+))\s*-->\s*$")
HEAVY_ENV = "SHARDWISE_DOCS_HEAVY"  # =1: run the blocks marked heavy too
FENCE = re.compile(r"^(?P<indent>\s*)```(?P<lang>[A-Za-z0-9_+-]*)\s*$")
NPROC = re.compile(r"--nproc-per-node[ =](\d+)")
RUN_LANGUAGES = ("bash", "python")


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None = None  # the reason
    torchrun: int = 0  # processes, for a python block run under torchrun


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a markdown text, with the marker on the line before each (blank lines allowed)."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang, start = match["indent"], match["lang"], i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                         for line in lines[i + 1:end]) + "\n"
        block = Block(start + 1, lang, code)
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = MARKER.match(lines[before]) if before >= 0 else None
        if marker and marker["kind"] == "skip":
            block.skip = marker["reason"].strip()
        elif marker and marker["kind"] == "heavy" and os.environ.get(HEAVY_ENV) != "1":
            block.skip = f"heavy: {marker['reason'].strip()} ({HEAVY_ENV}=1 runs it)"
        elif marker:
            block.torchrun = int(marker["n"])
        elif lang == "python" and "init_process_group" in code:
            nproc = NPROC.search(code)
            block.torchrun = int(nproc[1]) if nproc else 2
        found.append(block)
        i = end + 1
    return found


def _bin_folder(folder: Path) -> Path:
    """``python3``, ``python`` and ``torchrun`` as this interpreter."""
    bin_dir = folder / ".doc-runner-bin"
    bin_dir.mkdir(exist_ok=True)
    # scripts, not links: a venv's python finds its pyvenv.cfg from the path it was started by
    for name, args in (("python3", ""), ("python", ""), ("torchrun", " -m torch.distributed.run")):
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}"{args} "$@"\n')
        script.chmod(0o755)
    return bin_dir


def _environment(folder: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PATH"] = f"{_bin_folder(folder)}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _corpus(folder: Path) -> None:
    sources = sorted((REPO / "shardwise" / "app").glob("*.py"))
    (folder / "corpus.txt").write_text("\n".join(path.read_text() for path in sources))


def run_page(page: Path, folder: Path) -> dict:
    """Run ``page``'s blocks in ``folder``; raises ``SystemExit(1)`` at the first that fails."""
    os.chdir(folder)
    _corpus(folder)
    env = _environment(folder)
    os.environ.update(PATH=env["PATH"], PYTHONPATH=env["PYTHONPATH"])
    namespace = {"__name__": "__main__"}
    report = {"run": [], "skipped": []}
    name = page.name if page.parent == REPO else f"{page.parent.name}/{page.name}"
    for block in blocks(page.read_text()):
        if block.lang not in RUN_LANGUAGES:
            continue
        if block.skip is not None:
            report["skipped"].append([block.line, block.skip])
            continue
        where, started = f"{name}:{block.line}", time.perf_counter()
        print(f"doc-runner: {where} ({block.lang}{f', torchrun x{block.torchrun}' if block.torchrun else ''})",
              flush=True)
        if block.lang == "python" and not block.torchrun:
            try:
                exec(compile(block.code, where, "exec"), namespace)
            except BaseException:  # noqa: BLE001 -- any failure of the block fails the page
                import traceback

                traceback.print_exc()
                print(f"doc-runner: FAILED {where}", flush=True)
                raise SystemExit(1) from None
        else:
            if block.lang == "python":
                script = folder / f"block_{block.line}.py"
                script.write_text(block.code)
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                       str(block.torchrun), script.name]
            else:
                cmd = ["bash", "-e", "-c", block.code]
            done = subprocess.run(cmd, cwd=folder, env=env)
            if done.returncode:
                print(f"doc-runner: FAILED {where}: exit status {done.returncode}", flush=True)
                raise SystemExit(1)
        report["run"].append([block.line, round(time.perf_counter() - started, 1)])
    return report


if __name__ == "__main__":
    print(json.dumps(run_page(Path(sys.argv[1]).resolve(), Path.cwd())), flush=True)
