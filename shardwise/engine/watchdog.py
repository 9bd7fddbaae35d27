"""A rank that stops making progress (stopped, frozen, dead without a word) named within a bounded time.

A collective waits for a stopped peer until the process group's timeout (minutes) and then cannot say
which rank it waited for. ``StallWatchdog`` gives each rank a heartbeat: a thread bumps a counter in the
c10d store every ``interval_s`` and reads its ring neighbour's (rank ``r`` watches ``r + 1``). A
neighbour whose counter has not moved for ``stall_s`` is stopped or frozen (the thread beats on while the
main thread waits in a collective or computes, so a slow step is no stall); its watcher posts the rank's
name, every rank sees it at its next beat and calls ``on_stall(message)`` (by default: one line on stderr
and exit 1, since the main thread may be stuck in a collective nothing else can end). A store that stops
answering means its host is frozen: under ``init_process_group("env://")`` that is rank 0.

Each rank does three small store operations per beat, never a collective, so the cost is independent of
the model and of the world size.
"""

from __future__ import annotations

import datetime
import itertools
import os
import sys
import threading
import time
from typing import Callable

import torch.distributed as dist

__all__ = ["StallWatchdog"]

_GENERATIONS = itertools.count()  # every rank makes its watchdogs in the same order: one key space each
_DONE = -(10 ** 12)  # added to a counter when its rank closes its watchdog: no longer watched


def _default_on_stall(message: str) -> None:
    print(f"shardwise: rank {dist.get_rank()}: error: {message}", file=sys.stderr, flush=True)
    os._exit(1)


class StallWatchdog:
    """Name the rank that stopped making progress, on every other rank, within about ``stall_s`` seconds.

    ``with shardwise.StallWatchdog(stall_s=60): train()`` around a loop (after ``init_process_group``, on
    every rank of ``group``). ``describe()`` (optional) says what this rank is doing ("step 6, forward");
    the message naming a stalled rank quotes its last. ``store`` defaults to a client of the default
    process group's store with a short timeout.
    """

    def __init__(self, stall_s: float = 60.0, *, interval_s: float | None = None, group=None, store=None,
                 describe: Callable[[], str] | None = None, on_stall: Callable[[str], None] | None = None):
        if not stall_s > 0:
            raise ValueError(f"stall_s={stall_s!r} must be a positive number of seconds")
        self.stall_s = float(stall_s)
        self.interval_s = float(interval_s) if interval_s is not None else min(5.0, self.stall_s / 5)
        if not 0 < self.interval_s < self.stall_s:
            raise ValueError(f"interval_s={interval_s!r} must be positive and below stall_s={stall_s!r}")
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(self.world))
        self.global_ranks = ranks
        self.describe = describe or (lambda: "")
        self.on_stall = on_stall or _default_on_stall
        base = store if store is not None else dist.distributed_c10d._get_default_store().clone()
        base.set_timeout(datetime.timedelta(seconds=max(1.0, self.interval_s)))
        self.store = dist.PrefixStore(f"shardwise_watchdog/{next(_GENERATIONS)}/", base)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._store_ok_at = time.monotonic()
        self._thread: threading.Thread | None = None
        self.stalled: str | None = None  # the message, once a stall is seen

    # ------------------------------------------------------------------ the loop
    def start(self) -> "StallWatchdog":
        if self.world > 1 and self._thread is None:
            try:  # the first beat before this returns: a rank stopped right after start is seen with its last
                self._beat()
            except Exception:  # noqa: BLE001 -- the thread retries, and judges the store
                pass
            self._store_ok_at = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="shardwise-stall-watchdog", daemon=True)
            self._thread.start()
            # A store operation on a stopped host may block past any timeout: a second thread judges the store
            threading.Thread(target=self._watch_store, name="shardwise-stall-watchdog-store", daemon=True).start()
        return self

    def close(self) -> None:
        """Stop beating and say so: peers stop watching this rank (it finished, or failed on its own)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=self.stall_s)  # a store operation on a stopped host may never return
        self._thread = None
        try:
            self.store.add(f"beat/{self.rank}", _DONE)
        except Exception:  # noqa: BLE001 -- the store is gone: nobody is watching any more
            pass

    def __enter__(self) -> "StallWatchdog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch_store(self) -> None:
        while not self._stop.wait(self.interval_s):
            if time.monotonic() - self._store_ok_at > self.stall_s:
                self._stalled(self._store_host_message())
                return

    def _run(self) -> None:
        neighbour = (self.rank + 1) % self.world
        seen, seen_at = None, time.monotonic()
        first = True
        while True:  # the first beat at once, then one every interval_s
            if self._stop.is_set() or (not first and self._stop.wait(self.interval_s)):
                return
            first = False
            now = time.monotonic()
            try:
                self._beat()
                count = self.store.add(f"beat/{neighbour}", 0)
                posted = self.store.check(["stalled"]) and self.store.get("stalled").decode()
                self._store_ok_at = time.monotonic()
            except Exception:  # noqa: BLE001 -- a timeout or a lost connection: _watch_store judges the store
                continue
            if posted:
                self._stalled(posted)
                return
            if count < 0:  # the neighbour closed its watchdog
                continue
            if count != seen:
                seen, seen_at = count, now
            elif now - seen_at > self.stall_s:
                message = self._neighbour_message(neighbour, count)
                try:
                    self.store.set("stalled", message)  # every rank says the same line
                except Exception:  # noqa: BLE001
                    pass
                self._stalled(message)
                return

    def _beat(self) -> None:
        self.store.add(f"beat/{self.rank}", 1)
        self.store.set(f"doing/{self.rank}", self.describe()[:200])

    def _neighbour_message(self, neighbour: int, count: int) -> str:
        try:
            doing = self.store.get(f"doing/{neighbour}").decode() if self.store.check([f"doing/{neighbour}"]) else ""
        except Exception:  # noqa: BLE001
            doing = ""
        where = f" (its last: {doing})" if doing else (" (it never sent one)" if count == 0 else "")
        return (f"rank {self.global_ranks[neighbour]} stopped making progress: no heartbeat for {self.stall_s:g} s"
                f"{where}; it is stopped (SIGSTOP, a debugger), frozen or dead")

    def _store_host_message(self) -> str:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return f"the c10d store (torchrun's agent) has not answered for {self.stall_s:g} s"
        return (f"rank {self.global_ranks[0]} stopped making progress: the c10d store it hosts has not answered "
                f"for {self.stall_s:g} s; it is stopped (SIGSTOP, a debugger), frozen or dead")

    def _stalled(self, message: str) -> None:
        with self._lock:  # one call, whichever thread sees it first
            if self.stalled is not None:
                return
            self.stalled = message
        self._stop.set()
        self.on_stall(message)
