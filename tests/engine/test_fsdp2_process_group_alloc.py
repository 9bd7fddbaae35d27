"""``set_allocate_memory_from_process_group_for_comm`` as FSDP2 defines it, run with torch's ``fully_shard`` and
shardwise's in the same test.

- On gloo, whose backend allocates no tensors of its own, the call changes nothing (FSDP2 falls back to
  ``torch.empty``): a model wrapped per block and at the root, the call on every module as the real clients make
  it (a prefetch utility passing its flag to every ``FSDPModule``), and toggled between steps, trains bit for bit as
  FSDP2 doing the same and as shardwise without the call, at world 1 and 2.
- A unit with its own ``fully_shard(collectives=...)`` raises ``AssertionError``, as FSDP2 does for a custom
  all-gather or reduce-scatter.
- Where the backend does allocate (NCCL), the unit's buffers must come from it. NCCL cannot run here, so the gloo
  groups are given a fake backend that says it allocates (``supports_tensor_alloc``) and records what is asked of
  it, and ``torch.cuda``'s pool API is recorded too: the unit's pool is made over that backend's allocator,
  registered plainly with its group once, and the unit's gathered weights and staging buffers are allocated
  inside that pool (the unit's only: not recursive, and not after ``False``), with the same values. Real NCCL
  memory and registration are not exercised here (no GPUs in CI).
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import shardwise
from shardwise.engine import process_group_alloc
from shardwise.engine.collectives import Collectives
from tests.helpers.distributed import device, run_distributed

DIM, STEPS = 8, 3
METHOD = "set_allocate_memory_from_process_group_for_comm"


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(DIM, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _wrapped(which: str, **kwargs) -> _Net:
    fully_shard = torch_fully_shard if which == "fsdp2" else shardwise.fully_shard
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = _Net().to(device())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _set_everywhere(model: nn.Module, enable: bool) -> None:
    """What the real clients do: the flag handed to every FSDPModule of the model."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_allocate_memory_from_process_group_for_comm(enable)


def _train(model: nn.Module, schedule: list) -> dict:
    """``STEPS`` AdamW steps; ``schedule[i]`` (``None``: no call) set on every module before step ``i``."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        if schedule[step] is not None:
            _set_everywhere(model, schedule[step])
        torch.manual_seed(100 + 10 * step + dist.get_rank())
        x, target = torch.randn(4, DIM, device=device()), torch.randint(0, 3, (4,), device=device())
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()
              for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


SCHEDULES = {"off": [None] * STEPS, "on": [True, None, None], "toggled": [True, False, True]}


def _both_libraries() -> dict:
    out = {}
    for which in ("fsdp2", "shardwise"):
        for name, schedule in SCHEDULES.items():
            model = _wrapped(which)
            out[which, name] = _train(model, schedule)
            if which == "shardwise":  # gloo allocates no tensors: every group keeps the default collectives
                groups = model.sharded_state.groups
                out[which, name]["collectives"] = {type(g.collectives).__name__ for g in groups}
                out[which, name]["flags"] = [u.settings.extra.get("allocate_memory_from_process_group_for_comm")
                                             for u in model.sharded_state.all_units]
    return out


def _same(a: dict, b: dict, what: str) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses {a['losses']} != {b['losses']}"
    assert a["params"].keys() == b["params"].keys()
    for name, value in a["params"].items():
        torch.testing.assert_close(b["params"][name], value, rtol=0, atol=0, msg=f"{what}: {name}")


@pytest.mark.parametrize("world", [1, 2])
def test_the_call_on_every_module_trains_as_fsdp2_and_as_without_it(world):
    for rank, out in enumerate(run_distributed(_both_libraries, world)):
        for name in SCHEDULES:
            _same(out["fsdp2", name], out["shardwise", name], f"rank {rank} {name}: shardwise against FSDP2")
            _same(out["shardwise", "off"], out["shardwise", name], f"rank {rank} {name}: against no call")
            assert out["shardwise", name]["collectives"] == {"Collectives"}, out["shardwise", name]
        assert out["shardwise", "off"]["flags"] == [None] * 3
        assert out["shardwise", "on"]["flags"] == out["shardwise", "toggled"]["flags"] == [True] * 3


# ------------------------------------------------------------------ a user's own collectives
class _Own(Collectives):
    """A user's collectives (the default transport, here): they decide where their buffers come from."""


def _custom_refused() -> dict:
    model = _wrapped("shardwise", collectives=_Own())
    out = {}
    for enable in (True, False):
        try:
            model.blocks[0].set_allocate_memory_from_process_group_for_comm(enable)
            out[enable] = "accepted"
        except AssertionError as error:
            out[enable] = str(error)
    out["collectives"] = {type(g.collectives).__name__ for g in model.sharded_state.groups}
    out["trains"] = _train(model, [None] * STEPS)["losses"]
    return out


def test_a_unit_with_its_own_collectives_raises_assertion_error_as_fsdp2():
    out = run_distributed(_custom_refused, 1)[0]
    for enable in (True, False):
        assert out[enable].startswith(f"cannot call {METHOD}() on a unit whose collectives are custom: _Own"), out
    assert out["collectives"] == {"_Own"} and len(out["trains"]) == STEPS


# ------------------------------------------------------------------ a backend that allocates (NCCL's part, faked)
class _Allocating:
    """The real gloo backend, saying it allocates tensors as NCCL's does, with a pool allocator and registration
    recorded."""

    def __init__(self, real, calls: list):
        self._real, self._calls = real, calls

    def supports_tensor_alloc(self, device) -> bool:
        self._calls.append(("supports", str(device)))
        return True

    @property
    def mem_allocator(self) -> str:
        return "the group's allocator"

    def register_mem_pool(self, pool, **kwargs) -> None:
        self._calls.append(("register", pool.name, kwargs))

    def __getattr__(self, name):
        return getattr(self._real, name)


class _Pool:
    made: list = []

    def __init__(self, allocator):
        self.allocator, self.name = allocator, f"pool {len(_Pool.made)}"
        _Pool.made.append(self)


_BUFFER_MODULES = ("shardwise.engine.distributed_buffer", "shardwise.engine.collectives")


@contextlib.contextmanager
def _faked_allocating_backend(calls: list, active: list, where: dict):
    """Every process group's backend allocates (a fake), ``torch.cuda``'s pools are recorded (``active``: the pools
    entered), and each storage the engine's buffer modules allocate is noted in ``where`` (its address: the pool
    that was active, or ``None``)."""
    real = {"get": dist.ProcessGroup._get_backend, "pool": torch.cuda.MemPool, "use": torch.cuda.use_mem_pool,
            "empty": torch.empty, "resize_": torch.UntypedStorage.resize_}

    @contextlib.contextmanager
    def use_mem_pool(pool):
        active.append(pool)
        try:
            yield
        finally:
            active.pop()

    def note(tensor_or_storage) -> None:
        if sys._getframe(2).f_globals.get("__name__", "") in _BUFFER_MODULES:
            where[tensor_or_storage.data_ptr()] = active[-1].name if active else None

    def empty(*args, **kwargs):
        t = real["empty"](*args, **kwargs)
        note(t)
        return t

    def resize_(storage, size):
        out = real["resize_"](storage, size)
        if size:
            note(storage)
        return out

    _Pool.made = []
    pools = dict(process_group_alloc._POOLS)  # the process's pools: this test's own are made afresh and dropped
    process_group_alloc._POOLS.clear()
    dist.ProcessGroup._get_backend = lambda group, dev: _Allocating(real["get"](group, dev), calls)
    torch.cuda.MemPool, torch.cuda.use_mem_pool = _Pool, use_mem_pool
    torch.empty, torch.UntypedStorage.resize_ = empty, resize_
    try:
        yield
    finally:
        dist.ProcessGroup._get_backend = real["get"]
        torch.cuda.MemPool, torch.cuda.use_mem_pool = real["pool"], real["use"]
        torch.empty, torch.UntypedStorage.resize_ = real["empty"], real["resize_"]
        process_group_alloc._POOLS.clear()
        process_group_alloc._POOLS.update(pools)


def _from_the_process_group(schedule: list, only_first_block: bool) -> dict:
    calls, active, where = [], [], {}
    seen: dict = {"block0": [], "block1": []}
    model = _wrapped("shardwise")
    with _faked_allocating_backend(calls, active, where):
        def look(name):
            def hook(module, args):  # after the unit's own pre-forward: the gathered weights are in place
                ptr = module.up.weight.untyped_storage().data_ptr()
                seen[name].append(where.get(ptr, "not noted"))
            return hook

        for i, block in enumerate(model.blocks):
            block.register_forward_pre_hook(look(f"block{i}"))
        if only_first_block:  # not recursive: the root and the other block keep PyTorch's allocator
            model.blocks[0].set_allocate_memory_from_process_group_for_comm(True)
            schedule = [None] * STEPS
        result = _train(model, schedule)
        pools = [(p.name, p.allocator) for p in _Pool.made]
        collectives = [sorted({type(g.collectives).__name__ for g in u.groups}) for u in model.sharded_state.all_units]
    inside = sorted({v for v in where.values() if v is not None})
    return dict(result, calls=calls, pools=pools, seen=seen, collectives=collectives, inside=inside)


def _runs() -> dict:
    return {"plain": _train(_wrapped("shardwise"), [None] * STEPS),
            "on": _from_the_process_group([True, None, None], False),
            "toggled": _from_the_process_group([True, False, True], False),
            "first_block": _from_the_process_group([None] * STEPS, True)}


def test_where_the_backend_allocates_the_units_buffers_come_from_its_registered_pool():
    for rank, runs in enumerate(run_distributed(_runs, 2)):
        for name in ("on", "toggled", "first_block"):
            _same(runs["plain"], runs[name], f"rank {rank} {name}")
        on, toggled, first = runs["on"], runs["toggled"], runs["first_block"]
        # one pool over the group's allocator, shared by every unit, registered plainly (no symm) once
        assert on["pools"] == [("pool 0", "the group's allocator")], on["pools"]
        assert [c for c in on["calls"] if c[0] == "register"] == [("register", "pool 0", {})], on["calls"]
        assert ("supports", "cpu") in on["calls"]
        assert on["collectives"] == [["ProcessGroupAlloc"]] * 3
        # every gather of every step lands in the pool (the first unit's weights at each forward)
        assert on["seen"] == {"block0": ["pool 0"] * STEPS, "block1": ["pool 0"] * STEPS}, on["seen"]
        assert on["inside"] == ["pool 0"]
        # False before the second step: that step's gathers come from PyTorch's allocator; True again: the same pool
        assert toggled["seen"]["block0"] == ["pool 0", None, "pool 0"], toggled["seen"]
        assert toggled["pools"] == [("pool 0", "the group's allocator")]
        # only the unit it was called on
        assert first["seen"] == {"block0": ["pool 0"] * STEPS, "block1": [None] * STEPS}, first["seen"]
        assert first["collectives"] == [["ProcessGroupAlloc"], ["Collectives"], ["Collectives"]]
