"""Every name the adapter's API page documents for ``mcore_fsdp_adapter`` is in ``shardwise.megatron.mcore_fsdp_adapter``.

The page (``shared/reference/seed-mcore_fsdp_adapter.txt``, beside the repository) is the
API shardwise implements; tools built on Megatron-Core import these names from that module.
Its names and parameter lists are kept in ``tests/helpers/data/mcore_fsdp_adapter_page.json``
(:func:`parse_page` of the page; the first test re-parses the page where it is reachable and
holds the record to it). Each module-level name must be importable, each documented
function and method must take the documented parameters in order, each documented class
member must exist; then the non-trivial ones are run (through the adapter's names, not
their implementations').
"""

from __future__ import annotations

import inspect
import json
import random
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import shardwise.megatron.mcore_fsdp_adapter as adapter
from shardwise.engine.placements import STRATEGY_PLACEMENTS

from tests.helpers import DATA, REPO
from tests.helpers.distributed import run_distributed

RECORD_PATH = DATA / "mcore_fsdp_adapter_page.json"
PAGE_PATHS = [REPO.parent / "shared" / "reference" / "seed-mcore_fsdp_adapter.txt",
              Path("/work/shared/reference/seed-mcore_fsdp_adapter.txt")]
PREFIX = "core.distributed.fsdp.mcore_fsdp_adapter."
MEMBER = re.compile(r"^(?:static |abstractmethod )?([A-Za-z_]\w*)\s*([(:])")


def _parameters(text: str) -> list[str] | None:
    """The parameter names of ``name( a: T, b=1, *rest, )...`` (brackets in types respected), or None."""
    if not text.startswith("("):
        return None
    depth, current, parts = 0, "", []
    for ch in text[1:]:
        if ch in "([" or (ch == "{"):
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                parts.append(current)
                break
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    names = [re.split(r"[:=]", p.strip(), maxsplit=1)[0].strip() for p in parts]
    return [n for n in names if n]


def parse_page(text: str) -> dict:
    """``{"module": {name: params or None}, "classes": {class: {member: params or None}}}`` from the page's API part."""
    api = text.split("\nAPI#", 1)[1]
    module: dict = {}
    classes: dict = {}
    current = None
    for line in api.splitlines():
        line = line.strip()
        if line.startswith("class " + PREFIX):
            name = re.match(r"\w+", line[len("class " + PREFIX):]).group(0)
            module[name] = None
            current = classes.setdefault(name, {})
        elif line.startswith(PREFIX):
            rest = line[len(PREFIX):]
            name = re.match(r"\w+", rest).group(0)
            module[name] = _parameters(rest[len(name):].lstrip())
            current = None
        elif current is not None and "#" in line:
            found = MEMBER.match(line)
            if found:
                head = line[found.start(1):]
                name = found.group(1)
                current[name] = _parameters(head[len(name):].lstrip()) if found.group(2) == "(" else None
    return {"module": module, "classes": classes}


RECORD = json.loads(RECORD_PATH.read_text())


def test_the_record_is_the_pages_names():
    page = next((p for p in PAGE_PATHS if p.exists()), None)
    if page is None:
        pytest.skip("the API page (shared/reference/seed-mcore_fsdp_adapter.txt) is not beside the repository; "
                    "the recorded names are checked below")
    assert parse_page(page.read_text()) == RECORD, f"re-record {RECORD_PATH.name} from {page}"


def test_the_record_holds_the_names_the_issue_lists():
    listed = {"_AxisPlacements", "_DATA_PARALLEL_PLACEMENTS", "_materialize_meta_module",
              "_materialize_owned_meta_modules", "_build_expert_mesh_and_placements", "_build_hybrid_dp_mesh",
              "_get_hsdp_tp_mesh", "_get_dp_tp_mesh", "_check_mesh_ranks_and_group_ranks_are_consistent",
              "_get_rng_state_dict", "_load_rng_state_dict", "logger", "__all__", "FullyShardedDataParallel",
              "FullyShardedDataParallelV1", "FullyShardedDataParallelV2"}
    assert listed == set(RECORD["module"])


def _names(params):
    return [("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
            for p in params]


@pytest.mark.parametrize("name", sorted(RECORD["module"]))
def test_each_module_name_is_there_with_its_parameters(name):
    assert hasattr(adapter, name), f"shardwise.megatron.mcore_fsdp_adapter has no {name}"
    value = getattr(adapter, name)
    documented = RECORD["module"][name]
    if documented is not None:
        assert callable(value), name
        params = inspect.signature(value).parameters.values()
        assert _names(params) == documented, name


MEMBERS = [(cls, member) for cls, members in RECORD["classes"].items() for member in members]


@pytest.mark.parametrize("cls,member", MEMBERS, ids=[f"{c}.{m}" for c, m in MEMBERS])
def test_each_class_member_is_there_with_its_parameters(cls, member):
    owner = getattr(adapter, cls)
    assert hasattr(owner, member), f"{cls} has no {member}"
    documented = RECORD["classes"][cls][member]
    if documented is not None:
        function = inspect.getattr_static(owner, member)
        static = isinstance(function, staticmethod)
        params = list(inspect.signature(getattr(owner, member)).parameters.values())
        if not static:
            params = params[1:]  # self
        assert _names(params) == documented, (cls, member)


# ------------------------------------------------------------------ what they do
def test_all_is_the_factory_and_the_logger_is_the_modules():
    assert adapter.__all__ == ["FullyShardedDataParallel"]
    assert adapter.logger.name == "shardwise.megatron.mcore_fsdp_adapter"


def test_axis_placements_are_a_named_tuple_of_the_three_buffers():
    assert adapter._AxisPlacements._fields == ("parameter", "gradient", "optimizer")
    assert issubclass(adapter._AxisPlacements, tuple)
    for strategy, row in adapter._DATA_PARALLEL_PLACEMENTS.items():  # ZeRO 0-3, the engine's table
        assert isinstance(row, adapter._AxisPlacements) and row == STRATEGY_PLACEMENTS[strategy]
    assert set(adapter._DATA_PARALLEL_PLACEMENTS) == {"no_shard", "optim", "optim_grads", "optim_grads_params"}


class _Replacing(nn.Module):
    """A Transformer-Engine-style reset: a new Parameter by setattr."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(2, 3))

    def reset_parameters(self):
        self.weight = nn.Parameter(torch.arange(6.0).view(2, 3))


def test_meta_materialization_through_the_adapters_names():
    with torch.device("meta"):
        one = nn.Linear(3, 2)
        tree = nn.Sequential(nn.Linear(3, 3), _Replacing())
    torch.manual_seed(0)
    adapter._materialize_meta_module(one, torch.device("cpu"))
    torch.manual_seed(0)
    assert torch.equal(one.weight.detach(), nn.Linear(3, 2).weight.detach())  # its own reset ran
    adapter._materialize_owned_meta_modules(tree, torch.device("cpu"))
    assert not any(p.is_meta for p in tree.parameters())
    assert torch.equal(tree[1].weight.detach(), torch.arange(6.0).view(2, 3))


def test_rng_state_round_trips_through_the_adapters_names():
    state = adapter._get_rng_state_dict()
    first = (random.random(), torch.rand(3))
    adapter._load_rng_state_dict(state)
    again = (random.random(), torch.rand(3))
    assert first[0] == again[0] and torch.equal(first[1], again[1])


def _meshes_body():
    import torch.distributed as dist

    from shardwise.megatron import build_process_groups

    pg = build_process_groups(tensor_model_parallel_size=2)
    table = adapter._get_dp_tp_mesh(pg.dp_cp, pg.tp)
    consistent = adapter._check_mesh_ranks_and_group_ranks_are_consistent(table, dist.get_process_group_ranks(pg.tp))
    hybrid = build_process_groups(num_distributed_optimizer_instances=2)
    mesh = adapter._build_hybrid_dp_mesh(hybrid.inter_dist_opt, hybrid.intra_dp_cp, "cpu")
    hsdp = adapter._get_hsdp_tp_mesh(hybrid.inter_dist_opt, hybrid.intra_dp_cp, build_process_groups().tp)
    expert = adapter._build_expert_mesh_and_placements(SimpleConfig(), SimpleDDP(), pg, "cpu")
    return (dist.get_rank(), table.tolist(), consistent, mesh.mesh.tolist(), mesh.mesh_dim_names,
            hsdp.tolist(), expert)


class SimpleConfig:
    expert_model_parallel_size = 1


class SimpleDDP:
    data_parallel_sharding_strategy = "optim_grads_params"
    num_distributed_optimizer_instances = 1


def test_mesh_helpers_through_the_adapters_names():
    """(The mesh helpers' refusals are tested on their implementations, ``tests/megatron/test_megatron_parallelism.py``.)"""
    for rank, table, consistent, mesh, names, hsdp, expert in run_distributed(_meshes_body, 4):
        assert table == [[0, 1], [2, 3]]  # dp rows of tp groups (consecutive TP ranks)
        assert consistent is True
        assert mesh == [[0, 1], [2, 3]] and names == ("dp_outer", "dp_shard")
        assert hsdp == [[[0], [1]], [[2], [3]]]  # (outer, inner, tp=1)
        assert expert == (None, None)  # no expert parallelism: neither


if __name__ == "__main__" and "--record" in sys.argv:  # re-record from the page
    source = next(p for p in PAGE_PATHS if p.exists())
    RECORD_PATH.write_text(json.dumps(parse_page(source.read_text()), indent=1, sort_keys=True) + "\n")
