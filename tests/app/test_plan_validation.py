"""docs/plan.md's validation table is what the planner predicts today, and every miss says why.

``scripts/plan_validation.py`` holds each validated run's inputs and measurement; the doc's block between its
markers must equal what the script prints, so a changed constant or term shows up as a changed table.
"""

from __future__ import annotations

from scripts.plan_validation import RUNS, TARGET, rows

from tests.helpers import REPO

START, END = "<!-- scripts/plan_validation.py -->", "<!-- end scripts/plan_validation.py -->"


def test_the_doc_shows_what_the_planner_predicts():
    doc = (REPO / "docs" / "plan.md").read_text()
    block = doc[doc.index(START) + len(START):doc.index(END)].strip().splitlines()
    assert block == rows(), "docs/plan.md's validation table is stale: paste `python scripts/plan_validation.py`"


def test_every_miss_names_the_term():
    unexplained = [run.label for run in RUNS if abs(run.predicted() / run.measured - 1) > TARGET and not run.note]
    assert not unexplained, unexplained
