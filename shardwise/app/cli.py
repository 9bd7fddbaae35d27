"""The ``shardwise`` command: ``shardwise <command> [flags]``.

Each command is a module with a ``main(argv) -> int``; add one by adding a line
to ``COMMANDS``. The module is imported only when its command runs.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["COMMANDS", "main"]

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("shardwise.app.train", "train a reference model with fully_shard"),
    "ckpt": ("shardwise.app.ckpt", "inspect, verify or export a checkpoint (info, verify, export)"),
    "plan": ("shardwise.app.plan.cli", "rank configurations by memory and step time at any GPU count, before launch"),
    "bench": ("shardwise.app.bench.cli", "compare shardwise with FSDP2, DDP and megatron-fsdp (speed, memory, exposed comm)"),
}


def _usage() -> str:
    lines = ["usage: shardwise <command> [flags]   (shardwise <command> --help for its flags)", "", "commands:"]
    lines += [f"  {name:10s} {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"shardwise: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[command][0])
        return module.main(rest) or 0
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's status for SIGINT
        print(f"shardwise {command}: interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
