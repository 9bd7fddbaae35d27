"""torch's ``share_comm_ctx`` over shardwise units (issue 54: torch's ``test_share_comm_context``), run with
torch's ``fully_shard`` and shardwise's in the same test.

torch's function reads each module's ``_get_fsdp_state()._comm_ctx`` and sets the first one's on the others;
for a shardwise unit that is its model's side streams (``StreamSet``). Checked here:

- three layers, each its own root, their lazy init run and their context shared, as torch's test does: the
  shared object is one for all three, and the model trains bit for bit as FSDP2 doing the same, at world 1 and 2;
- shardwise's units on one device share one set of side streams already, whichever call made them; a
  graph-safe model has its own, and everything that holds it (step controller, gradient windows, the
  backward's reduce point) runs on the first model's after the call, its staging pool kept. On CPU there are
  no streams (``None``), so the first model's are stood in for by two marker objects set before the call;
- a torch FSDP2 module and a shardwise one in one call: ``TypeError`` naming the mix (torch hands its own
  context to shardwise's unit).

torch's own test also patches FSDP2's internal ``foreach_all_gather`` / ``foreach_reduce`` to count the
streams they were given, which shardwise never calls (docs/engine.md lists it).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import share_comm_ctx
from torch.distributed.tensor import DTensor

import shardwise
from tests.helpers.distributed import device, run_distributed

DIM, LAYERS, STEPS = 16, 3, 3


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


def _shared(which: str) -> nn.Sequential:
    fully_shard = torch_fully_shard if which == "fsdp2" else shardwise.fully_shard
    torch.manual_seed(42)
    model = nn.Sequential(*[_MLP() for _ in range(LAYERS)]).to(device())
    for layer in model:
        fully_shard(layer)
        layer._get_fsdp_state()._lazy_init()
    share_comm_ctx(list(model))
    return model


def _train(model: nn.Module) -> dict:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        torch.manual_seed(100 + 10 * step + dist.get_rank())
        loss = model(torch.randn(4, 3, DIM, device=device())).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    params = {n: p.full_tensor().detach().cpu() if isinstance(p, DTensor) else p.detach().cpu()
              for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def _both() -> dict:
    out = {}
    for which in ("fsdp2", "shardwise"):
        model = _shared(which)
        contexts = [layer._get_fsdp_state()._comm_ctx for layer in model]
        out[which, "one_context"] = all(c is contexts[0] for c in contexts)
        out[which] = _train(model)
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_shared_contexts_train_as_fsdp2(world):
    for rank, out in enumerate(run_distributed(_both, world)):
        assert out["fsdp2", "one_context"] and out["shardwise", "one_context"], (rank, out)
        assert out["shardwise"]["losses"] == out["fsdp2"]["losses"], rank
        for name, value in out["fsdp2"]["params"].items():
            torch.testing.assert_close(out["shardwise"]["params"][name], value, rtol=0, atol=0, msg=name)


def _holders() -> dict:
    """shardwise's units on one device already share one set of side streams, whichever call made them; a
    graph-safe model has its own (its staging buffers are static), and the call moves it to the first's."""
    torch.manual_seed(42)
    model = nn.Sequential(*[_MLP() for _ in range(LAYERS)]).to(device())
    for i, layer in enumerate(model):
        shardwise.fully_shard(layer, graph_safe=i > 0)
    first = model[0]._get_fsdp_state().state.streams
    out = {"graph_safe_apart": [layer._get_fsdp_state().state.streams is not first for layer in model[1:]]}
    gather, reduce = object(), object()  # stand-ins for the first model's CUDA streams
    before = (first.gather, first.reduce)
    first.gather, first.reduce = gather, reduce
    share_comm_ctx(list(model))
    seen = []
    for layer in model[1:]:
        controller = layer._get_fsdp_state().state
        windows = [group.window.streams for unit in controller.all_units for group in unit.groups]
        holders = [controller.streams, controller.backward_steps.streams, *windows]
        seen.append({"gather": all(h.gather is gather for h in holders),
                     "reduce": all(h.reduce is reduce for h in holders),
                     "own_pool": controller.streams.pool is not first.pool})
    first.gather, first.reduce = before
    out["seen"] = seen
    return out


def test_every_holder_of_a_models_streams_moves_to_the_shared_ones():
    out = run_distributed(_holders, 1)[0]
    assert out["graph_safe_apart"] == [True] * (LAYERS - 1), out
    assert out["seen"] == [{"gather": True, "reduce": True, "own_pool": True}] * (LAYERS - 1), out


def _mixed() -> dict:
    torch.manual_seed(42)
    theirs, ours = _MLP().to(device()), _MLP().to(device())
    torch_fully_shard(theirs)
    shardwise.fully_shard(ours)
    theirs._get_fsdp_state()._lazy_init()
    try:
        share_comm_ctx([theirs, ours])
    except TypeError as error:
        return {"error": str(error)}
    return {"error": None}


def test_a_torch_module_and_a_shardwise_one_in_one_call_are_refused():
    error = run_distributed(_mixed, 1)[0]["error"]
    assert error is not None and "FSDPCommContext" in error and "share_comm_ctx" in error, error
