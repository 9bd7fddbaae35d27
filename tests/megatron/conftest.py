"""Fresh worker processes for each Megatron test file.

Megatron-Core's ``parallel_state.initialize_model_parallel`` makes dozens of process groups per call
(gloo copies included) and ``destroy_model_parallel`` forgets them without destroying them; in the
session-long worker pools their gloo threads pile up (hundreds per worker) until every later test
crawls. Closing the pools after each file frees them with the processes. The workers are killed, not
asked to leave: an orderly exit of a worker holding hundreds of gloo threads took up to 10 s (the join's
limit) per pool, and nothing is checked on the way out. A fresh pool is a fork of the preloaded server
(tests/helpers/distributed.py), a fraction of a second.
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import _close_pools


@pytest.fixture(autouse=True, scope="module")
def _fresh_workers_per_file():
    yield
    _close_pools(graceful=False)
