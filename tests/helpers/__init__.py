"""What the tests share: the gloo worker pool, the parity harness, the tiny models and their cases.

Imported as a package (``from tests.helpers.distributed import run_distributed``): pytest puts the
repository root on ``sys.path`` (``pythonpath`` in pyproject.toml), and the spawned workers inherit it.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root
DATA = Path(__file__).resolve().parent / "data"  # checked-in test data
