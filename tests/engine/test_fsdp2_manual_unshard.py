"""Explicit ``unshard()`` / ``reshard()`` calls, as FSDP2 defines them, run with torch's ``fully_shard`` and
shardwise's in the same test (issue 54: torch's ``test_unshard_async`` and ``test_manual_reshard*`` with the name
rebound). fp32 comparisons are exact: both libraries compute the same sums in the same order on the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import replicate
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

import shardwise
from tests.helpers.distributed import device, run_distributed


def _fully_shard(which: str):
    return torch_fully_shard if which == "fsdp2" else shardwise.fully_shard


def _what(t: torch.Tensor) -> tuple:
    return ("DTensor" if isinstance(t, DTensor) else "Tensor", tuple(t.shape))


class _MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.out_proj(F.relu(self.in_proj(x)))


class _Reduce(nn.Module):
    """A plain (replicated) layer whose output is all-reduced asynchronously, not through autograd."""

    def __init__(self, dim: int, mesh):
        super().__init__()
        self.mesh, self.weight = mesh, nn.Parameter(torch.randn(dim, dim))

    def forward(self, x):
        y = F.relu(x @ self.weight)
        return y, dist.all_reduce(y, group=self.mesh.get_group(), async_op=True)


class _Heads(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.mlp1, self.mlp2, self.mlp3 = _MLP(dim), _MLP(dim), _MLP(dim)

    def forward(self, ys, works):
        out = 0
        for mlp, y, work in zip((self.mlp1, self.mlp2, self.mlp3), ys, works):
            work.wait()
            out = out + mlp(y)
        return out


class _Overlapped(nn.Module):
    """Each head's gather is started by hand (``unshard(async_op=True)``) while a plain layer's all-reduce is in
    flight; the handles are never waited on: the unit's own forward finishes the gather."""

    def __init__(self, dim: int, mesh):
        super().__init__()
        self.reduce = nn.ModuleList(_Reduce(dim, mesh) for _ in range(3))
        self.heads = _Heads(dim)
        self.seen: list = []

    def forward(self, x):
        ys, works = [], []
        for reduce, mlp in zip(self.reduce, (self.heads.mlp1, self.heads.mlp2, self.heads.mlp3)):
            y, work = reduce(x)
            ys.append(y)
            works.append(work)
            mlp.unshard(async_op=True)
            self.seen.append(_what(mlp.in_proj.weight))  # registered between the start and the unit's forward
        return self.heads(ys, works)


def _unshard_async_train(which: str) -> dict:
    fully_shard = _fully_shard(which)
    mesh = init_device_mesh(device().type, (dist.get_world_size(),))
    torch.manual_seed(42)
    model = _Overlapped(8, mesh).to(device())
    for mlp in (model.heads.mlp1, model.heads.mlp2, model.heads.mlp3):
        fully_shard(mlp, reshard_after_forward=False)
    fully_shard(model.heads)
    replicate(model)  # torch's composable DDP over the rest: it must leave the sharded units alone
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    torch.manual_seed(43 + dist.get_rank())
    inp = torch.randn(2, 8, device=device())
    losses, after_forward = [], []
    for _ in range(4):
        loss = model(inp).sum()
        after_forward.append(_what(model.heads.mlp1.in_proj.weight))
        loss.backward()
        with implicit_replication():
            optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
              for n, p in model.named_parameters()}
    return {"losses": losses, "seen": model.seen, "after_forward": after_forward, "params": params}


def test_unshard_async_handles_left_to_the_forward_train_as_fsdp2():
    """torch's test_unshard_async: ``unshard(async_op=True)`` on units that keep their weights after forward, the
    handles dropped, torch's ``replicate`` over the unwrapped layers; what the modules hold between the start of
    the gather and the unit's forward, after forward, the losses and the trained weights are FSDP2's, exactly."""
    theirs = run_distributed(_unshard_async_train, 2, "fsdp2")
    ours = run_distributed(_unshard_async_train, 2, "shardwise")
    for rank, (t, o) in enumerate(zip(theirs, ours)):
        assert o["losses"] == t["losses"], rank
        assert o["seen"] == t["seen"], rank
        assert o["after_forward"] == t["after_forward"] == [("Tensor", (32, 8))] * 4, rank
        for name, value in t["params"].items():
            torch.testing.assert_close(o["params"][name], value, rtol=0, atol=0, msg=name)


def _handle_then_read(which: str) -> dict:
    """``unshard(async_op=True)``, read the registered parameter, ``wait()``, read it again, register a forward's
    input through it, then ``reshard()``: what each step shows."""
    fully_shard = _fully_shard(which)
    torch.manual_seed(0)
    model = _MLP(4).to(device())
    fully_shard(model.in_proj)
    fully_shard(model)
    out = {}
    handle = model.in_proj.unshard(async_op=True)
    out["before_wait"] = _what(model.in_proj.weight)
    handle.wait()
    handle.wait()  # a second wait is a no-op
    out["after_wait"] = _what(model.in_proj.weight)
    out["value"] = model.in_proj.weight.detach().clone().cpu()
    model.in_proj.reshard()
    out["after_reshard"] = _what(model.in_proj.weight)
    out["full"] = model.in_proj.weight.full_tensor().detach().cpu()
    torch.manual_seed(1)
    model(torch.randn(3, 4, device=device())).sum().backward()
    out["grad"] = model.in_proj.weight.grad.full_tensor().cpu()
    return out


def test_unshard_handle_wait_registers_the_gathered_weights_as_fsdp2():
    theirs = run_distributed(_handle_then_read, 2, "fsdp2")[0]
    ours = run_distributed(_handle_then_read, 2, "shardwise")[0]
    for key in ("before_wait", "after_wait", "after_reshard"):
        assert ours[key] == theirs[key], key
    assert theirs["after_wait"] == ("Tensor", (16, 4))
    for key in ("value", "full", "grad"):
        torch.testing.assert_close(ours[key], theirs[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(theirs["value"], theirs["full"], rtol=0, atol=0)
