"""The Megatron face's cached process groups after the default group is initialized again.

``build_process_groups`` and the dist index keep the groups they make (every rank makes the same ones in the
same order, so reusing one saves a rendezvous). A cache outlives its groups: a process that destroys the
default group and initializes a new one (a second job in one interpreter, a test harness) must get new
groups, not the dead ones. This file's workers are not reused after it (tests/megatron/conftest.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from shardwise.megatron import build_process_groups
from shardwise.megatron.dist_index import _own_group

from tests.helpers.distributed import run_distributed


def _groups_across_a_new_default_group(store_file: str):
    before, own = build_process_groups(backend="gloo"), _own_group("gloo")
    assert build_process_groups(backend="gloo").dp_cp is before.dp_cp  # cached while the default group lives
    rank = dist.get_rank()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)
    after, own_after = build_process_groups(backend="gloo"), _own_group("gloo")
    total, mine = torch.ones(1), torch.ones(1)
    dist.all_reduce(total, group=after.dp_cp)
    dist.all_reduce(mine, group=own_after)
    return after.dp_cp is before.dp_cp, own_after is own, total.item(), mine.item()


def test_a_new_default_group_gets_new_groups(tmp_path):
    for same_dp, same_own, total, mine in run_distributed(_groups_across_a_new_default_group, 2,
                                                           str(tmp_path / "store")):
        assert not same_dp and not same_own
        assert (total, mine) == (2.0, 1.0)
