"""docs/plan.md's worked examples: each ``$ shardwise plan ...`` block is run and must print what the doc shows."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "plan.md"
BLOCK = re.compile(r"```\n\$ (shardwise plan [^\n]*)\n(.*?)```", re.S)


def _examples() -> list[tuple[str, str]]:
    return BLOCK.findall(DOC.read_text())


def test_the_doc_has_its_three_worked_examples():
    assert len(_examples()) == 3


@pytest.mark.slow  # each plans a 70B model over every candidate (the fast path ruling out most before tracing)
@pytest.mark.parametrize("command,shown", _examples(), ids=lambda x: x[:60] if " --" in x else "")
def test_a_worked_example_prints_what_the_doc_shows(command, shown, capsys):
    from shardwise.app.cli import main

    argv = shlex.split(command)[1:]
    assert main(argv) == 0
    assert capsys.readouterr().out == shown
