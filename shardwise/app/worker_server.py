"""The first module the fork server of :func:`~shardwise.app.launch.launch_local` imports.

``launch_local`` starts its workers from multiprocessing's forkserver: one server process, started by the
launcher, imports the workers' modules once (``set_forkserver_preload``: this module, then the module of the
function the workers run, e.g. ``shardwise.app.train`` with torch and shardwise, then the launcher's extras,
e.g. ``torch._dynamo``), and every worker is a fork of it, with those imports done. A spawned worker was a
fresh interpreter importing them itself: about 3.7 s of CPU per worker (``docs/testing.md``).

Imported in the server (and only there, by ``launch_local``'s preload list), this module
- keeps the server's environment as it was before the imports (:data:`START_ENV`): a worker starts from the
  launcher's environment at its launch plus what the imports added, as a spawned one did
  (``launch._worker``);
- makes the server go when its launcher dies (``PR_SET_PDEATHSIG``), so the workers, whose parent it is, get
  their SIGTERM as they did when the launcher was their parent;
- prints the server's stacks on SIGUSR1 instead of dying of it: ``kill -USR1 -<launcher pid>`` reaches the
  whole process group, and a dead server would take the workers with it.

Nothing the server imports may initialise CUDA (a process forked after that cannot use it): importing torch,
shardwise and torch._dynamo does not.
"""

from __future__ import annotations

import os
import sys

START_ENV = dict(os.environ)  # before any import below: the launcher's environment when it started the server


def _in_fork_server() -> bool:
    """Whether this import runs in multiprocessing's fork server (its ``main`` preloading modules)."""
    forkserver = sys.modules.get("multiprocessing.forkserver")
    if forkserver is None:
        return False
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if _in_fork_server():
    from .launch import _set_parent_death_signal, dump_stacks_on_sigusr1

    _set_parent_death_signal()
    dump_stacks_on_sigusr1()
