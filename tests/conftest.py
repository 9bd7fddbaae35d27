"""The ``slow`` marker on the parametrized cases that run 4 processes.

A test that always starts 4 gloo processes or a subprocess carries ``@pytest.mark.slow`` itself; a test
parametrized over worlds gets it only for its 4-process cases: those whose ``world`` (or ``*_world``)
parameter is 4. ``pytest -m "not slow"`` runs the rest (docs/testing.md).
"""

from __future__ import annotations

import pytest


def _four_processes(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any((name == "world" or name.endswith("_world")) and value == 4 for name, value in params.items())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _four_processes(item):
            item.add_marker(pytest.mark.slow)
