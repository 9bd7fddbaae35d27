"""The ``slow`` marker on the parametrized cases that run 4 processes, and how the tests share 2 processes.

A test that always starts 4 gloo processes or a subprocess carries ``@pytest.mark.slow`` itself; a test
parametrized over worlds gets it only for its 4-process cases: those whose ``world`` (or ``*_world``)
parameter is 4. ``pytest -m "not slow"`` runs the rest (docs/testing.md).

``pytest -n 2`` (pytest-xdist) runs the tests on two workers, each with its own gloo pools
(tests/helpers/distributed.py). A worker is handed a whole test file at a time, so a file's module-scoped
fixtures (a Megatron-LM run, a trained folder) run once and the Megatron files' pools close after the file
(tests/megatron/conftest.py); the tests of a file in ``SPLIT`` share nothing and go one by one to whichever
worker is free. The files (or tests of ``SPLIT``) holding slow tests are handed out first, in collection
order, the longest known ones (``LONGEST``) before them: the long ones start early and the short ones fill
in at the end, so no worker idles while the other finishes a three-minute test.
"""

from __future__ import annotations

import pytest

# files whose tests are independent of each other (no module-scoped fixture worth sharing, nothing left for the
# next test): under xdist their tests go one by one to whichever worker is free
SPLIT = {"tests/docs/test_doc_blocks.py", "tests/engine/test_torch_tools.py", "tests/app/test_plan_doc.py",
         "tests/app/test_stuck_rank.py"}
# the units that take longest (a minute or more each on 2 cores; docs/testing.md, "How long it takes"), started
# first in this order: under -n 2 the other worker goes through the rest meanwhile, and no worker is left with a
# long one at the end (a prefix of a unit's node id)
LONGEST = (
    "tests/megatron/test_megatron_lm_recipes.py",
    "tests/docs/test_doc_blocks.py::test_the_pages_code_blocks_run_as_written[docs/pipeline.md]",
    "tests/app/test_plan_doc.py::test_a_worked_example_prints_what_the_doc_shows",
    "tests/megatron/test_megatron_swiglu_checkpoint.py",
    "tests/docs/test_doc_blocks.py::test_the_pages_code_blocks_run_as_written[docs/megatron.md]",
    "tests/docs/test_doc_blocks.py::test_the_pages_code_blocks_run_as_written[docs/cli.md]",
)


def _four_processes(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any((name == "world" or name.endswith("_world")) and value == 4 for name, value in params.items())


def _unit(nodeid: str) -> str:
    """What an xdist worker is handed as a whole: the test's file, or the test itself for a file of ``SPLIT``."""
    file = nodeid.split("::", 1)[0]
    return nodeid if file in SPLIT else file


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _four_processes(item):
            item.add_marker(pytest.mark.slow)
    slow = {_unit(item.nodeid) for item in items if item.get_closest_marker("slow")}

    def order(item) -> tuple[int, bool]:
        unit = _unit(item.nodeid)
        longest = next((i for i, prefix in enumerate(LONGEST) if unit.startswith(prefix)), len(LONGEST))
        return longest, unit not in slow

    items.sort(key=order)  # stable: each file's own order kept


@pytest.hookimpl(optionalhook=True)  # an xdist hook: without pytest-xdist, never called
def pytest_xdist_make_scheduler(config, log):
    # xdist's loadgroup would do this with xdist_group marks, but it renames items through Item._nodeid, which
    # pytest 9.2's nodes no longer read: a scheduler of our own, xdist's loadscope with ``_unit`` as the scope
    from xdist.scheduler import LoadScopeScheduling

    class _ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    config.option.loadscopereorder = False  # keep the collection order above (xdist's: largest file first)
    return _ByUnit(config, log)


# the doc-runner's report (tests/docs/test_doc_blocks.py: per page, the blocks run and those skipped, with why),
# sent as each page's user property: under xdist the pages run in the workers, and this list is the main process's
_DOC_RUNNER: list[str] = []


def pytest_runtest_logreport(report):
    if report.when == "call":
        _DOC_RUNNER.extend(value for name, value in report.user_properties if name == "doc-runner")


def pytest_terminal_summary(terminalreporter):
    if _DOC_RUNNER:
        terminalreporter.section("doc-runner: code blocks of README.md and docs/")
        for line in sorted(_DOC_RUNNER):  # page order, whichever worker ran which page first
            terminalreporter.write_line(line)
