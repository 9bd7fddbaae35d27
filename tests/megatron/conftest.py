"""Megatron's process groups destroyed after each Megatron test file; the worker pools live on.

Megatron-Core's ``parallel_state.initialize_model_parallel`` makes dozens of process groups per call
(gloo copies included) and ``destroy_model_parallel`` forgets them without destroying them; in the
session-long worker pools their gloo threads piled up (hundreds per worker) until every later test
crawled. After each file every worker destroys the groups made during it. Restarting the workers
instead cost a fresh interpreter importing torch and Megatron per worker per file (18 pool starts in
this folder) and up to half a minute of teardown for each pool of such workers. A worker that still holds more threads than a fresh one plus the file's cached groups
could explain is restarted all the same.
"""

from __future__ import annotations

import pytest

from tests.helpers.distributed import (
    close_pool,
    destroy_groups_made_since_mark,
    live_pools,
    mark_groups,
    run_distributed,
)

# A worker's threads after the cleanup: torch's and gloo's for the world group, a few per group kept
# from before the file. More means groups still leak, and the pool is restarted.
MAX_THREADS_AFTER_CLEANUP = 64


@pytest.fixture(autouse=True, scope="module")
def _megatron_groups_destroyed_per_file():
    for world_size in live_pools():
        run_distributed(mark_groups, world_size)
    yield
    for world_size in live_pools():
        threads = run_distributed(destroy_groups_made_since_mark, world_size, MAX_THREADS_AFTER_CLEANUP)
        if max(threads) > MAX_THREADS_AFTER_CLEANUP:
            close_pool(world_size)
