"""The application's one error type for settings, and its one way of saying things.

Its own module so that every part of ``shardwise train`` (the config, the
run folder, the data flags, the Hugging Face flags) raises the same
``ConfigError`` without importing the command itself (no import circle).
"""

from __future__ import annotations

import sys

__all__ = ["PROG", "ConfigError", "say"]

PROG = "shardwise train"


class ConfigError(ValueError):
    """A bad setting, reported as ``--flag value: reason`` (one line; exit status 2)."""

    one_line = True
    exit_code = 2

    def __init__(self, name: str, value, why: str):
        flag = name if name.startswith("-") else "--" + name.replace("_", "-")
        super().__init__(f"{flag} {value}: {why}" if value != "" else f"{flag}: {why}")


def say(message: str) -> None:
    """One line on stderr, prefixed with the command's name."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)
