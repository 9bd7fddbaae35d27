"""The doc-runner's report at the end of the run: per page, the blocks run and those skipped, with why."""

from tests.docs.test_doc_blocks import REPORT


def pytest_terminal_summary(terminalreporter):
    if not REPORT:
        return
    terminalreporter.section("doc-runner: code blocks of README.md and docs/")
    for line in REPORT:
        terminalreporter.write_line(line)
