"""A stalled rank ends the run within --timeout (plus a margin), Ctrl-C ends it with one line and 130,
SIGUSR1 prints every process's stacks and the run goes on.

Each test runs ``shardwise train`` in its own session with a hard time limit and kills the whole
session afterwards, so a regression fails the test instead of hanging CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO

HARD_LIMIT_S = 120
ARGS = ["--preset", "tiny", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1",
        "--ffn-hidden", "64", "--seq-len", "32", "--micro-batch-size", "2", "--steps", "100000", "--nproc", "2"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(Path(json.__file__).read_bytes() * 4)
    return str(path)


def _start(out: Path, data: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "shardwise", "train", *ARGS, "--data", data, "--out-dir", str(out), *extra]
    # A suite started as a background job runs with SIGINT ignored, and the run would inherit that (and rightly
    # keep ignoring Ctrl-C, as under nohup): give it the terminal's default, as an interactive shell would.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(cmd, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)


def _wait_for_steps(proc: subprocess.Popen, out: Path, steps: int, deadline: float) -> None:
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.2)
    raise AssertionError(f"no {steps} steps in time")


def _workers(launcher_pid: int) -> list[int]:
    """The launcher's worker processes (rank order = start order): the children of its fork server (the child
    running ``multiprocessing.forkserver``), not multiprocessing's other helpers (the resource tracker)."""
    processes = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            processes[int(entry.name)] = (ppid, (entry / "cmdline").read_bytes())
        except (OSError, IndexError, ValueError):
            continue
    servers = {pid for pid, (ppid, cmdline) in processes.items()
               if ppid == launcher_pid and b"multiprocessing.forkserver" in cmdline}
    found = [pid for pid, (ppid, _) in processes.items() if ppid in servers]
    return sorted(found, key=lambda pid: float((Path("/proc") / str(pid) / "stat").read_text()
                                              .rsplit(")", 1)[1].split()[19]))  # start time


def _finish(proc: subprocess.Popen) -> None:
    """Never leave anything behind: continue and kill the whole session."""
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def _communicate(proc: subprocess.Popen, deadline: float) -> str:
    """The run's stderr once it has exited; past the deadline, a failure that shows where every process of
    the run is (their stacks, which SIGUSR1 prints, and their states)."""
    try:
        return proc.communicate(timeout=max(1.0, deadline - time.monotonic()))[1]
    except subprocess.TimeoutExpired:
        states = subprocess.run(["ps", "-s", str(proc.pid), "-o", "pid,ppid,stat,wchan:24,etime,args"],
                                capture_output=True, text=True).stdout
        os.killpg(proc.pid, signal.SIGUSR1)
        try:
            err = proc.communicate(timeout=3)[1]
        except subprocess.TimeoutExpired as e:
            err = (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        raise AssertionError(f"the run did not exit in time; processes:\n{states}\nstderr (end):\n{err[-6000:]}")


def _stderr_lines(err: str) -> list[str]:
    """Messages, without the progress bar (a message may follow the bar on its line)."""
    lines = []
    for line in err.replace("\r", "\n").splitlines():
        if "shardwise train:" in line:
            lines.append(line[line.index("shardwise train:"):])
        elif line and not line.startswith("tiny x"):
            lines.append(line)
    return lines


def _stop_a_rank(tmp_path, data, rank: int, *options: str):
    """Start a 2-rank ``shardwise train`` with ``options``, SIGSTOP ``rank`` (by PID) after two steps, and wait
    for the launcher: ``(proc, worker pids, stderr, seconds from the stop to the launcher's end)``."""
    out = tmp_path / "run"
    proc = _start(out, data, *options)
    try:
        deadline = time.monotonic() + HARD_LIMIT_S
        _wait_for_steps(proc, out, 2, deadline)
        workers = _workers(proc.pid)
        assert len(workers) == 2, workers
        os.kill(workers[rank], signal.SIGSTOP)
        stopped = time.monotonic()
        err = _communicate(proc, deadline)
        elapsed = time.monotonic() - stopped
    finally:
        _finish(proc)
    return proc, workers, err, elapsed


@pytest.mark.slow
def test_a_stopped_rank_ends_the_run_within_its_timeout(tmp_path, data):
    timeout_s, margin_s = 5, 20
    # rank 1 hangs (as a deadlock or a dead GPU would look)
    proc, workers, err, elapsed = _stop_a_rank(tmp_path, data, 1, "--timeout", str(timeout_s))
    assert proc.returncode == 1, err
    assert elapsed < timeout_s + margin_s, f"took {elapsed:.1f}s"
    lines = _stderr_lines(err)
    survivor = [line for line in lines if line.startswith("shardwise train: rank 0: error:")]
    assert len(survivor) == 1, lines
    assert f"a collective timed out after {timeout_s} s: rank 1 stalled" in survivor[0]
    assert survivor[0].startswith("shardwise train: rank 0: error: step ")  # which step and collective
    assert (f"shardwise train: rank 1 (pid {workers[1]}, stopped) was still running 3 s after rank 0 failed "
            f"(exit status 1); stopping it") in lines
    assert "Traceback" not in err


@pytest.mark.slow
@pytest.mark.parametrize("stopped_rank", [1, 0])
def test_a_stopped_rank_is_named_by_the_watchdog_well_before_the_timeout(tmp_path, data, stopped_rank):
    """With the default --timeout (300 s) the collective would wait five minutes and could not say who it
    waited for; the heartbeat names the stopped rank after --stall-timeout, on the rank that survives (rank 0
    hosts the c10d store: its peers find the store silent)."""
    stall_s, margin_s, survivor_rank = 5, 20, 1 - stopped_rank
    proc, workers, err, elapsed = _stop_a_rank(tmp_path, data, stopped_rank, "--stall-timeout", str(stall_s))
    assert proc.returncode == 1, err
    assert elapsed < stall_s + margin_s, f"took {elapsed:.1f}s"
    lines = _stderr_lines(err)
    prefix = f"shardwise train: rank {survivor_rank}: error: rank {stopped_rank} stopped making progress: "
    survivor = [line for line in lines if line.startswith(f"shardwise train: rank {survivor_rank}: error:")]
    assert len(survivor) == 1, lines
    why = (f"no heartbeat for {stall_s} s (its last: " if stopped_rank == 1 else
           f"the c10d store it hosts has not answered for {stall_s} s; it is stopped")
    assert survivor[0].startswith(prefix + why), survivor[0]
    assert any(line.startswith(f"shardwise train: rank {stopped_rank} (pid {workers[stopped_rank]}, stopped) was "
                               "still running") for line in lines), lines
    assert "Traceback" not in err


def _train_then_ctrl_c(out: Path, data: str, meanwhile=None) -> tuple[subprocess.Popen, str]:
    """Start a run, let it train 2 steps, call ``meanwhile(proc, deadline)``, press Ctrl-C; the run and its stderr."""
    proc = _start(out, data)
    try:
        deadline = time.monotonic() + HARD_LIMIT_S
        _wait_for_steps(proc, out, 2, deadline)
        if meanwhile is not None:
            meanwhile(proc, deadline)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
        err = _communicate(proc, deadline)
    finally:
        _finish(proc)
    return proc, err


@pytest.mark.slow
def test_ctrl_c_prints_one_line_and_exits_130(tmp_path, data):
    proc, err = _train_then_ctrl_c(tmp_path / "run", data)
    assert proc.returncode == 130, err
    lines = _stderr_lines(err)
    assert lines[-1] == "shardwise train: interrupted (Ctrl-C); stopping 2 worker(s)", lines
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert not [line for line in lines if "error" in line], lines


@pytest.mark.slow
def test_sigusr1_prints_every_process_stack_and_the_run_goes_on(tmp_path, data):
    out = tmp_path / "run"

    def dump_stacks(proc, deadline):
        os.killpg(proc.pid, signal.SIGUSR1)  # the launcher and both workers
        steps = len((out / "metrics.jsonl").read_text().splitlines())
        _wait_for_steps(proc, out, steps + 2, deadline)  # still training

    proc, err = _train_then_ctrl_c(out, data, dump_stacks)
    assert proc.returncode == 130, err
    assert err.count("most recent call first") >= 3, err[-3000:]  # one current thread per process at least
    assert "launch_local" in err and "_worker" in err, err[-3000:]
