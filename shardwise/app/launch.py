"""Start one worker process per rank on this machine (what ``torchrun`` would do) and watch them.

``launch_local`` starts the workers with the environment torchrun sets and
watches them the way torchrun's agent does: as soon as one exits with an error,
the others get a short grace period to stop by themselves (a rank that lost its
peer fails its collective within the process-group timeout) and are then
stopped -- SIGTERM, SIGCONT for a stopped process, SIGKILL -- with one line
naming every rank that was still running. Ctrl-C (SIGINT) and SIGTERM stop all
workers and return 130 / 143. The workers are forks of one server process that
imported their modules once (multiprocessing's forkserver, :mod:`.worker_server`),
not fresh interpreters importing torch each.

``run_guarded`` is the body of every worker (here or under torchrun): errors that
carry ``one_line = True`` (bad settings, collective timeouts, lost peers) print
as one line; anything else prints its traceback and then one line; Ctrl-C exits
quietly with 130; warnings print as one line each.

Every process of a run (launcher and workers) prints each thread's Python stack
to stderr on SIGUSR1 (``kill -USR1 -<launcher pid>`` for all of them): where a
stuck run is stuck, without stopping it.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import json
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.reduction
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable

__all__ = ["free_port", "launch_local", "under_launcher", "process_started_at", "run_guarded", "WorkerError",
           "report_started", "available_cores", "fail_now",
           "dump_stacks_on_sigusr1", "one_line_warnings", "describe_collective_error", "EXIT_INTERRUPTED"]

EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM
GRACE_S = 3.0  # after one rank failed: how long the others may take to stop by themselves
INTERRUPT_GRACE_S = 10.0  # after Ctrl-C: how long the workers may take to stop by themselves


class WorkerError(RuntimeError):
    """An error reported as one line without a traceback (``exit_code`` is the worker's exit status)."""

    one_line = True
    exit_code = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_started_at() -> float:
    """When this process started, as ``time.time()`` (Linux: ``/proc``), else now: a command's wall time
    then includes the interpreter's start and the imports (torch's take seconds)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        started = boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()
    return started if 0 <= time.time() - started < 86400 * 365 else time.time()


def under_launcher() -> bool:
    """True when torchrun (or another launcher) already set this process's rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# ------------------------------------------------------------------ one-line output
def _one_line(text) -> str:
    return " ".join(str(text).split())


_SHOWN: set[str] = set()  # third-party notices this process (or the launcher that started it) has shown


def _ours(module: str) -> bool:
    return module == "__main__" or module.split(".")[0] in ("shardwise", "tests")


def _third_party_once(text: str) -> bool:
    """Whether to show a notice of another package: once per run, by the launcher or rank 0 (every rank
    imports the same packages and would repeat it)."""
    if os.environ.get("RANK", "0") != "0" or text in _SHOWN:
        return False
    _SHOWN.add(text)
    return True


def _warning_source() -> str:
    """The module that called ``warnings.warn`` (the frames above ``showwarning``, past the warnings module)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") in ("warnings", __name__):
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


class _Dedup(logging.Filter):
    """Remembers what was logged so a warning carrying the same text is not printed twice; another package's
    record is shown once per run (:func:`_third_party_once`)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        text = _one_line(record.getMessage())
        self.seen.add(text)
        return _ours(record.name) or bool(record.exc_info) or _third_party_once(f"{record.name}: {text}")


class _OneLineFormatter(logging.Formatter):
    def __init__(self, prog: str):
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        text = _one_line(record.getMessage())
        if _ours(record.name):
            text = f"{self.prog}: {record.levelname.lower()}: {text}"
        else:  # labelled with its source, not as shardwise's own
            text = f"[{record.name}] {record.levelname.lower()}: {text}"
        if record.exc_info:  # an error logged with its traceback keeps it
            text += "\n" + self.formatException(record.exc_info)
        return text


def one_line_warnings(prog: str) -> None:
    """Print warnings (and WARNING log records) as ``prog: warning: message (Category)``, one line each;
    another package's as ``[module] Category: message``, once per run (the launcher's or rank 0's)."""
    dedup = _Dedup()

    def show(message, category, filename, lineno, file=None, line=None):
        text = _one_line(message)
        if text in dedup.seen:  # already printed by the logging call next to it
            return
        source = _warning_source()
        if _ours(source):
            out = f"{prog}: warning: {text} ({category.__name__})"
        elif _third_party_once(f"{source}: {text}"):
            out = f"[{source}] {category.__name__}: {text}"
        else:
            return
        try:
            print(out, file=file or sys.stderr, flush=True)
        except (OSError, ValueError):
            pass

    warnings.showwarning = show
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_OneLineFormatter(prog))
    handler.addFilter(dedup)
    handler.setLevel(logging.WARNING)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, "_shardwise", False)]:
        root.removeHandler(old)
    handler._shardwise = True
    root.addHandler(handler)


def dump_stacks_on_sigusr1() -> None:
    """SIGUSR1 prints every thread's Python stack to stderr and the process goes on (POSIX only)."""
    if hasattr(signal, "SIGUSR1"):
        with contextlib.suppress(ValueError, RuntimeError, OSError):  # no usable stderr: nothing to print to
            faulthandler.register(signal.SIGUSR1, all_threads=True)


# ------------------------------------------------------------------ errors
_TIMEOUT_MARKS = ("timed out", "watchdog caught collective")  # gloo, the store, NCCL's watchdog
_PEER_MARKS = ("connection closed by peer", "connection reset by peer", "broken pipe", "connection refused",
               "remote worker crashing")


def describe_collective_error(error: BaseException, timeout_s: float | None = None,
                              peers: str = "another rank") -> str | None:
    """One line for an error of a collective (a timeout or a lost peer); ``None`` for any other error.

    ``peers`` names who the collective waited for ("rank 1" in a world of two).
    """
    if not isinstance(error, RuntimeError):  # DistBackendError, DistNetworkError and gloo's errors are
        return None
    text = str(error).lower()
    if any(mark in text for mark in _TIMEOUT_MARKS):
        after = f" after {timeout_s:g} s" if timeout_s else ""
        return (f"a collective timed out{after}: {peers} stalled (stopped, hung or far slower); "
                f"raise --timeout if it is only slow")
    if any(mark in text for mark in _PEER_MARKS):
        return f"lost the connection to {peers}: it died or was killed"
    return None


def run_guarded(fn: Callable, args: tuple, prog: str, report_to: str | None = None) -> int:
    """Run ``fn(*args)``; an exit status, with every failure reported (one line when it can be).

    After Ctrl-C (SIGINT) the exit is quiet with status 130, also when what fails first is a
    collective whose peer was interrupted too. With ``report_to`` (a file; :func:`launch_local`'s
    workers) the error is written there for the launcher, which says each error once with the ranks
    that raised it, instead of printed.
    """
    global _GUARDED
    _GUARDED = (prog, report_to)
    one_line_warnings(prog)
    dump_stacks_on_sigusr1()
    interrupted = []

    def on_sigint(signum, frame):
        interrupted.append(signum)
        raise KeyboardInterrupt

    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:  # a worker started with SIGINT ignored keeps ignoring it
        previous = None
    else:
        try:
            signal.signal(signal.SIGINT, on_sigint)
        except ValueError:  # not the main thread: Python's own handler stays
            previous = None
    try:
        fn(*args)
        return 0
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED  # the launcher (or the shell) says it once
    except Exception as e:  # noqa: BLE001 -- every failure becomes an exit status and a message
        if interrupted:
            return EXIT_INTERRUPTED
        one_line = getattr(e, "one_line", False)
        _report({"message": _one_line(e) if one_line else f"{type(e).__name__}: {_one_line(e)[:500]}",
                 "traceback": "" if one_line else traceback.format_exc()}, prog, report_to)
        return int(getattr(e, "exit_code", 1)) if one_line else 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        sys.stdout.flush()
        sys.stderr.flush()


def _report(report: dict, prog: str, report_to: str | None) -> None:
    """An error for the launcher (``report_to``), which says it once for the ranks that raised it; else printed."""
    if report_to is not None:
        try:
            with open(report_to, "w") as f:
                json.dump(report, f)
            return
        except OSError:
            pass  # the launcher's folder is gone: say it here
    print(f"{report['traceback']}{prog}: error: {report['message']}", file=sys.stderr, flush=True)


_GUARDED: tuple[str, str | None] = ("shardwise", None)  # run_guarded's prog and report file, for fail_now


def fail_now(message: str) -> None:
    """Report ``message`` as this worker's one-line error and exit 1 at once: for a thread that found the
    run cannot go on while the main thread waits in a collective nothing else can end (a stalled peer)."""
    prog, report_to = _GUARDED
    _report({"message": message, "traceback": ""}, prog, report_to)
    sys.stderr.flush()
    os._exit(1)


# ------------------------------------------------------------------ local launcher
def _set_parent_death_signal() -> None:
    """Linux: this worker gets SIGTERM when the launcher dies (no orphaned ranks)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 -- not Linux: nothing to do
        pass


_STARTED = None  # in a worker of launch_local(startup_notes=True): the event that ends the launcher's notes
STARTUP_NOTE_AFTER_S, STARTUP_NOTE_EVERY_S = 5.0, 10.0


def report_started() -> None:
    """Called by rank 0 once it runs (it says its own phases from then on): the launcher stops its notes."""
    if _STARTED is not None:
        _STARTED.set()


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's share), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Stdio:
    """The launcher's stdout and stderr, for a worker forked from the fork server: the server's are the
    launcher's when it started it (a test's capture may have replaced them since); a spawned worker
    inherited the launcher's at its start, and a forked one takes them over from this."""

    def __reduce__(self):
        fds = [fd for fd in (1, 2) if _is_open(fd)]
        return _take_stdio, (fds, [multiprocessing.reduction.DupFd(fd) for fd in fds])


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _take_stdio(fds: list[int], copies: list) -> None:
    for fd, copy in zip(fds, copies):
        received = copy.detach()
        if received != fd:
            os.dup2(received, fd)
            os.close(received)


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, prog: str, reports: str, shown: set,
            started=None, env: dict | None = None, stdio=None) -> None:
    global _STARTED
    if env is not None:
        # Forked from the server: what it imported (torch, shardwise: about a million objects) lives as long
        # as the worker; leaving it out of the collector's full passes (the end's gc.collect() in
        # destroy_process_groups and every automatic one) saves their time and keeps those pages shared.
        gc.freeze()
    _set_parent_death_signal()
    _SHOWN.update(shown)  # what the launcher showed already (the same imports' notices)
    _STARTED = started
    report_to = os.path.join(reports, f"rank{rank}.json")
    if env is not None:  # forked from the server: the launcher's environment at the launch, as a spawned worker's
        server = sys.modules.get("shardwise.app.worker_server")
        for key in set(getattr(server, "START_ENV", ())) - set(env):  # gone since the server started
            os.environ.pop(key, None)
        os.environ.update(env)  # what the server's imports added (TORCHINDUCTOR_CACHE_DIR) stays, as it would
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    code = run_guarded(fn, args, f"{prog}: rank {rank}" if world > 1 else prog, report_to)
    if code == EXIT_INTERRUPTED:
        # Nothing is left to finish (output is flushed, checkpoints are written atomically), and tearing
        # down torch's objects at exit took over 10 s of garbage collection on a loaded 2-core host,
        # past the launcher's grace: leave at once.
        os._exit(code)
    if env is not None:  # a forked process ends in os._exit: what a spawned one's exit ran, run it here
        atexit._run_exitfuncs()
    sys.exit(code)


def _context(fn: Callable, preload: tuple[str, ...]):
    """The fork server's context, preloading :mod:`.worker_server`, ``fn``'s module and ``preload``; spawn
    where there is no fork server (not POSIX). The server is multiprocessing's one per process: started by
    the first launch, it serves the later ones too (with the modules it preloaded then)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    modules = ["shardwise.app.worker_server"]  # first: it keeps the environment from before the imports
    if fn.__module__ != "__main__":  # the main module is not the server's to import (the worker imports it)
        modules.append(fn.__module__)
    ctx.set_forkserver_preload(modules + [m for m in preload if m not in modules])
    return ctx


def _state(pid: int) -> str:
    """', stopped' for a stopped process (SIGSTOP, Ctrl-Z), '' otherwise."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""
    return ", stopped" if state in ("T", "t") else ""


def _how(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


def _stop(processes: list, prog: str, reason: str) -> None:
    """Stop every process still alive: SIGTERM (+ SIGCONT so a stopped one gets it), then SIGKILL."""
    alive = [(rank, p) for rank, p in enumerate(processes) if p.is_alive()]
    for rank, p in alive:
        print(f"{prog}: rank {rank} (pid {p.pid}{_state(p.pid)}) was still running {reason}; stopping it",
              file=sys.stderr, flush=True)
        try:
            p.terminate()
            os.kill(p.pid, signal.SIGCONT)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 2.0
    for _, p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for _, p in alive:
        if p.is_alive():
            p.kill()
        p.join()


def _say_reports(reports: str, prog: str, world: int) -> None:
    """Each error the workers wrote, once, with the ranks that raised it (a traceback printed once too)."""
    ranks_of: dict[tuple, list[int]] = {}
    for rank in range(world):
        try:
            with open(os.path.join(reports, f"rank{rank}.json")) as f:
                report = json.load(f)
        except (OSError, ValueError):
            continue
        ranks_of.setdefault((report["traceback"], report["message"]), []).append(rank)
    for (trace, message), ranks in ranks_of.items():
        who = "" if world == 1 else f"rank {ranks[0]}: " if len(ranks) == 1 else \
            f"ranks {', '.join(map(str, ranks))}: " if len(ranks) < world else f"every rank ({world}): "
        print(f"{trace}{prog}: {who}error: {message}", file=sys.stderr, flush=True)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(signum)


def launch_local(fn: Callable, world: int, args: tuple, prog: str, startup_notes: bool = False,
                 preload: tuple[str, ...] = ()) -> int:
    """Run ``fn(*args)`` in ``world`` processes with the env torchrun sets; an exit status.

    0 when every rank finished; otherwise the first failing rank's status (1 when it was
    killed by a signal), 130 on Ctrl-C, 143 on SIGTERM. With ``startup_notes``, a start-up that
    lasts more than a few seconds is said until rank 0 calls :func:`report_started`. The workers
    are forked from a server that imported ``fn``'s module and ``preload`` (modules every worker
    imports later; none may initialise CUDA) once.
    """
    dump_stacks_on_sigusr1()
    ctx = _context(fn, preload)
    forked = ctx.get_start_method() == "forkserver"
    port = free_port()
    started = ctx.Event() if startup_notes else None
    reports = tempfile.mkdtemp(prefix="shardwise-errors-")  # each failing worker's error, said once below
    env, stdio = (dict(os.environ), _Stdio()) if forked else (None, None)
    processes = [ctx.Process(target=_worker, args=(rank, world, port, fn, args, prog, reports, set(_SHOWN),
                                                   started, env, stdio), name=f"rank{rank}")
                 for rank in range(world)]
    launched_at, next_note = time.monotonic(), STARTUP_NOTE_AFTER_S
    previous_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for p in processes:
            p.start()
        pending = {p.sentinel: rank for rank, p in enumerate(processes)}
        while pending:
            ready = multiprocessing.connection.wait(list(pending), timeout=1.0 if started is not None else None)
            waited = time.monotonic() - launched_at
            if started is not None and not started.is_set() and waited >= next_note:
                next_note += STARTUP_NOTE_EVERY_S
                print(f"{prog}: start-up: {world} worker processes starting (forked from one that imports their "
                      f"modules once; {available_cores()} CPU cores here) ({waited:.0f} s so far)",
                      file=sys.stderr, flush=True)
            for sentinel in ready:
                rank = pending.pop(sentinel)
                p = processes[rank]
                p.join()
                if p.exitcode == 0:
                    continue
                deadline = time.monotonic() + GRACE_S  # peers of a failed rank fail their collective
                for other in processes:
                    other.join(max(0.0, deadline - time.monotonic()))
                _say_reports(reports, prog, world)
                for other_rank, other in enumerate(processes):  # those that could not say why themselves
                    if other.exitcode == EXIT_INTERRUPTED:
                        print(f"{prog}: rank {other_rank} was interrupted", file=sys.stderr, flush=True)
                    elif other.exitcode is not None and other.exitcode < 0:
                        print(f"{prog}: rank {other_rank} (pid {other.pid}) was {_how(other.exitcode)}",
                              file=sys.stderr, flush=True)
                _stop(processes, prog, f"{GRACE_S:g} s after rank {rank} failed ({_how(p.exitcode)})")
                return p.exitcode if p.exitcode > 0 else 1
        return 0
    except KeyboardInterrupt as e:
        term = bool(e.args) and e.args[0] == signal.SIGTERM
        started = [p for p in processes if p.pid is not None]
        if term:  # only this process got it: pass it on
            for p in started:
                with contextlib.suppress(OSError):
                    p.terminate()
        deadline = time.monotonic() + INTERRUPT_GRACE_S  # a Ctrl-C in a terminal reached the workers too
        for p in started:
            with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: stop waiting
                p.join(max(0.0, deadline - time.monotonic()))
        print(f"{prog}: {'terminated (SIGTERM)' if term else 'interrupted (Ctrl-C)'}; stopping {world} worker(s)",
              file=sys.stderr, flush=True)
        _stop(started, prog, "after the interrupt")
        return EXIT_TERMINATED if term else EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous_term)
        shutil.rmtree(reports, ignore_errors=True)
