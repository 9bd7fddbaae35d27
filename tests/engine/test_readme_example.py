"""The README's engine example, run as written on 2 gloo processes: a newcomer's first code must work.

Its data differ per rank (each rank's own slice), so the check is that every rank's loss falls as the
example's own printout promises and that its weights stay finite; parity with one process is the engine
tests' job (tests/helpers/parity.py).
"""

import re

from tests.helpers import REPO
from tests.helpers.distributed import run_distributed


def _readme_example() -> str:
    """The python block of the README's "Using the engine" section."""
    section = (REPO / "README.md").read_text().split("\n## Using the engine\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one python block in README's 'Using the engine', found {len(blocks)}"
    return blocks[0]


def _run_example(code: str) -> dict:
    import torch

    namespace = {"__name__": "__readme__"}  # not __main__: the pool keeps its process groups
    exec(compile(code, "README.md", "exec"), namespace)
    full = {name: p.full_tensor() for name, p in namespace["model"].named_parameters()}
    return {"losses": namespace["losses"], "finite": all(bool(torch.isfinite(t).all()) for t in full.values())}


def test_the_readme_engine_example_trains_as_written():
    results = run_distributed(_run_example, 2, _readme_example())
    for rank, result in enumerate(results):
        losses = result["losses"]
        assert len(losses) == 20 and result["finite"], (rank, losses)
        # counting sequences are easy: a tiny model learns a large part of them in 20 steps
        assert losses[-1] < losses[0] - 1.0, (rank, losses)
