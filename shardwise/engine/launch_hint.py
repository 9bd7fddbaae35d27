"""One line instead of torch's traceback when a distributed script is started without a launcher.

A script that calls ``dist.init_process_group()`` (env:// rendezvous) and is run
as ``python example.py`` ends in torch's ``ValueError: ... environment variable
RANK expected, but not set`` under a traceback through torch's rendezvous code.
Importing shardwise installs a ``sys.excepthook`` that turns exactly that
uncaught error into one line saying to start the script with ``torchrun``;
every other exception goes to the hook that was there before.
"""

from __future__ import annotations

import os
import sys

__all__ = ["install_torchrun_hint", "TORCHRUN_HINT_MARK"]

TORCHRUN_HINT_MARK = "using env:// rendezvous: environment variable"  # torch's rendezvous error text


def _hint(previous):
    def hook(kind, error, trace):
        if issubclass(kind, ValueError) and TORCHRUN_HINT_MARK in str(error) and "expected, but not set" in str(error):
            script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] not in ("", "-c", "-") else "SCRIPT"
            var = str(error).split("environment variable", 1)[1].split()[0]
            print(f"{script}: error: {var} is not set: this is a distributed script; start it with torchrun, e.g. "
                  f"`torchrun --nproc-per-node 2 {script}` (CPU: gloo; one process per GPU)", file=sys.stderr,
                  flush=True)
            return
        previous(kind, error, trace)

    hook.shardwise_torchrun_hint = True
    return hook


def install_torchrun_hint() -> None:
    """Install the hook once (a second import, or one already installed, changes nothing)."""
    if not getattr(sys.excepthook, "shardwise_torchrun_hint", False):
        sys.excepthook = _hint(sys.excepthook)
