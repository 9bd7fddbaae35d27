"""What a run says while it starts and when it fails: more processes than cores, start-up phases that take
long, worker errors said once with their ranks, other packages' warnings labelled as theirs.

The launcher tests start workers from a fork server that imports this module (torch and shardwise, through
``shardwise.app.launch``) once.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import types
import warnings

import pytest

from shardwise.app import launch


def _errors_of_ranks():
    """Ranks 0 and 1 fail alike (a traceback), rank 2 with a one-line error of its own."""
    import os

    if os.environ["RANK"] == "2":
        raise launch.WorkerError("rank 2's own trouble")
    raise ValueError("the same mistake on two ranks")


def _slow_start(seconds: float):
    time.sleep(seconds)


@pytest.mark.slow
def test_a_worker_error_is_said_once_with_the_ranks_that_raised_it(capfd):
    assert launch.launch_local(_errors_of_ranks, 3, (), "prog") == 1
    err = capfd.readouterr().err
    assert err.count("Traceback (most recent call last)") == 1, err
    assert err.count("ValueError: the same mistake on two ranks") == 2, err  # the traceback's last line, the one line
    lines = [line for line in err.splitlines() if line.startswith("prog:")]
    assert sorted(lines) == ["prog: rank 2: error: rank 2's own trouble",
                             "prog: ranks 0, 1: error: ValueError: the same mistake on two ranks"], err


@pytest.mark.slow
def test_a_long_start_up_is_said_until_rank_0_reports(capfd, monkeypatch):
    monkeypatch.setattr(launch, "STARTUP_NOTE_AFTER_S", 0.5)
    monkeypatch.setattr(launch, "STARTUP_NOTE_EVERY_S", 1.0)
    assert launch.launch_local(_slow_start, 1, (3.0,), "prog", startup_notes=True) == 0
    notes = [line for line in capfd.readouterr().err.splitlines() if line.startswith("prog: start-up: ")]
    assert notes and notes[0].startswith("prog: start-up: 1 worker processes starting (forked from one that "
                                         "imports their modules once; "), notes


# Records every question to CUDA (each reaches the driver on a CUDA build: cudaGetDeviceCount, whose binding
# also marks the process so that its forks cannot use CUDA, or the lazy init) while the fork server's modules
# are imported; a CPU build answers is_available() itself, so the questions are caught where they are asked.
_CUDA_CALLS_AT_IMPORT = """
import torch
calls = []
for module, names in ((torch.cuda, ("is_available", "device_count", "current_device", "init", "_lazy_init",
                                    "get_device_properties", "get_device_capability", "mem_get_info")),
                      (torch._C, ("_cuda_getDeviceCount", "_cuda_init"))):
    for name in names:
        if hasattr(module, name):
            real = getattr(module, name)
            setattr(module, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
import shardwise.app.worker_server, shardwise.app.train, shardwise.app.bench.cli, torch._dynamo
print(calls)
"""


@pytest.mark.slow
def test_the_fork_servers_imports_leave_cuda_alone():
    """The workers are forks of a server that imported torch, shardwise and torch._dynamo: had those imports
    asked CUDA anything, no worker could use its GPU ("Cannot re-initialize CUDA in forked subprocess")."""
    from tests.helpers import REPO

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _CUDA_CALLS_AT_IMPORT], env=env, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_phase_that_lasts_is_said_until_the_first_step():
    from shardwise.app.loop import Phase

    said = []
    phase = Phase("process-group setup")
    phase.watch(said.append, after_s=0.2, every_s=0.6)
    deadline = time.monotonic() + 10
    while len(said) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert said[:2] and said[0].startswith("start-up: process-group setup (") and said[0].endswith(" s so far)")
    phase.started()
    time.sleep(1.0)
    count = len(said)
    time.sleep(1.0)
    assert len(said) == count  # the first step: no more notes


def test_other_packages_warnings_are_labelled_and_shown_once(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(launch, "_SHOWN", set())
    third = types.ModuleType("somepkg.sub")
    exec("import warnings\ndef f():\n    warnings.warn('a notice of theirs', UserWarning)\n", third.__dict__)
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            launch.one_line_warnings("prog")
            third.f()
            third.f()
            warnings.warn("a notice of ours")  # this module counts as the project's (tests.*)
            logging.getLogger("somepkg").warning("logged by them")
            logging.getLogger("somepkg").warning("logged by them")
            logging.getLogger("shardwise.somewhere").warning("logged by us")
    finally:
        for handler in [h for h in root.handlers if h not in before]:
            root.removeHandler(handler)
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[somepkg.sub] UserWarning: a notice of theirs", "prog: warning: a notice of ours (UserWarning)",
                     "[somepkg] warning: logged by them", "prog: warning: logged by us"], lines
    monkeypatch.setenv("RANK", "1")  # another rank: theirs are rank 0's to show
    assert not launch._third_party_once("somepkg: something new")


def test_more_processes_than_cores_is_warned_with_the_numbers(tmp_path, capsys, monkeypatch):
    from shardwise.app import train

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train, "available_cores", lambda: 2)
    monkeypatch.setattr(train, "launch_local", lambda *args, **kwargs: 0)
    data = tmp_path / "corpus.txt"
    data.write_bytes(open(logging.__file__, "rb").read())
    assert train.main(["--nproc", "8", "--device", "cpu", "--data", str(data), "--name", "many"]) == 0
    assert ("shardwise train: warning: --nproc 8 on 2 CPU cores: each process gets 0.25 of a core, so every "
            "step takes longer than with --nproc 2") in capsys.readouterr().err

