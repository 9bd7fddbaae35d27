"""The application's one error type for settings, and its one way of saying things.

Its own module so that every part of ``shardwise train`` (the config, the
run folder, the data flags, the Hugging Face flags) raises the same
``ConfigError`` without importing the command itself (no import circle).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import sys

__all__ = ["PROG", "ConfigError", "ConfigProblems", "Problems", "ShortUsageParser", "say"]

PROG = "shardwise train"


class ConfigError(ValueError):
    """A bad setting, reported as ``--flag value: reason`` (one line; exit status 2)."""

    one_line = True
    exit_code = 2

    def __init__(self, name: str, value, why: str):
        self.name = name
        flag = name if name.startswith("-") else "--" + name.replace("_", "-")
        super().__init__(f"{flag} {value}: {why}" if value != "" else f"{flag}: {why}")


class ConfigProblems(ConfigError):
    """Several bad settings at once, one ``--flag value: reason`` line each (so one run of the command names
    everything to fix, not one problem per try)."""

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        self.name = self.errors[0].name
        ValueError.__init__(self, f"{len(self.errors)} problems:\n" + "\n".join(f"  {e}" for e in self.errors))


class Problems:
    """The settings' problems found so far: checks add them (or raise, inside :meth:`collect`) and carry on."""

    def __init__(self):
        self.errors: list[ConfigError] = []

    def add(self, name: str, value, why: str) -> None:
        """One problem per setting: the first found (a NaN is "not finite", not also "not positive")."""
        if not self.named((name,)):
            self.errors.append(ConfigError(name, value, why))

    @contextlib.contextmanager
    def collect(self):
        """Run a check that raises :class:`ConfigError` at its first problem: that problem is kept."""
        try:
            yield
        except ConfigError as e:
            self.errors.extend(getattr(e, "errors", [e]))

    def named(self, names) -> bool:
        """Whether a problem names one of the fields ``names``."""
        return any(e.name in names for e in self.errors)

    def __bool__(self) -> bool:
        return bool(self.errors)

    def raise_any(self) -> None:
        if len(self.errors) == 1:
            raise self.errors[0]
        if self.errors:
            raise ConfigProblems(self.errors)


def say(message: str) -> None:
    """One line on stderr, prefixed with the command's name."""
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


class ShortUsageParser(argparse.ArgumentParser):
    """argparse whose errors are three lines: a short usage, the error (with the closest flag for a misspelt
    one) and where the flags are listed; argparse's own prints every flag of the usage first (40 lines)."""

    def error(self, message: str):
        unknown = message.partition("unrecognized arguments: ")[2].split()
        flags = [s for action in self._actions for s in action.option_strings if s.startswith("--")]
        close = [match for arg in unknown if arg.startswith("--")
                 for match in difflib.get_close_matches(arg.split("=")[0], flags, n=1)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        self.exit(2, f"usage: {self.prog} [flags]\n{self.prog}: error: {message}{hint}\n"
                     f"({self.prog} --help lists every flag)\n")
