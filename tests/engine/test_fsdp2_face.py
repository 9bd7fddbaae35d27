"""FSDP2's face: cases the real clients (tests/clients/) found, each reduced to the engine's behaviour."""

from __future__ import annotations

from tests.helpers.distributed import run_distributed

# --------------------------------------------------------------------------------------------------------
# A unit whose first module's input needs no grad (the tied [embedding, norm, head] unit of torchtitan and
# Accelerate): no hook sees that module's backward, so the unit must reduce at the end of backward, after
# the embedding's gradient has landed in the shared weight, not when the norm's and head's backward are done.

V, D = 24, 16


def _tied_model():
    import torch
    import torch.nn as nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(V, D)
            self.block = nn.Sequential(nn.Linear(D, D), nn.Tanh())
            self.norm = nn.LayerNorm(D)
            self.head = nn.Linear(D, V, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, tokens):
            return self.head(self.norm(self.block(self.embed(tokens))))

    torch.manual_seed(0)
    return Tied()


def _tied_unit_grads(world: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import shardwise

    tokens = torch.randint(0, V, (world, 2, 8), generator=torch.Generator().manual_seed(1))
    reference = _tied_model()
    sum(F.cross_entropy(reference(t).flatten(0, 1), t.flatten()) for t in tokens).div(world).backward()
    model = _tied_model()
    shardwise.fully_shard(model.block)
    shardwise.fully_shard([model.embed, model.norm, model.head])
    shardwise.fully_shard(model)
    assert model.head.weight is model.embed.weight
    t = tokens[dist.get_rank()]
    F.cross_entropy(model(t).flatten(0, 1), t.flatten()).backward()
    return {n: (p.grad.full_tensor(), dict(reference.named_parameters())[n].grad) for n, p in model.named_parameters()}


def test_tied_unit_led_by_an_embedding_reduces_after_the_embedding_backward():
    import torch

    grads = run_distributed(_tied_unit_grads, 2, 2)[0]
    assert "embed.weight" in grads
    for name, (got, want) in grads.items():
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7, msg=name)
