"""A small transformer with every awkward feature the engine must handle.

Tied embedding/output weights, a frozen parameter, a (7, 15) linear, a
parameter with fewer rows than ranks, a block called twice, root-owned
parameters, and layer norms (1-D parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class TinyConfig:
    vocab: int = 61
    dim: int = 32
    heads: int = 4
    hidden: int = 48
    layers: int = 3
    seq: int = 12
    checkpointing: str = "none"  # "none" | "reentrant" | "non_reentrant"
    reuse_last_block: bool = True


class Block(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.heads = c.heads
        self.norm1 = nn.LayerNorm(c.dim)
        self.qkv = nn.Linear(c.dim, 3 * c.dim, bias=False)  # a k-bias has an exactly-zero true gradient
        self.proj = nn.Linear(c.dim, c.dim, bias=False)
        self.norm2 = nn.LayerNorm(c.dim)
        self.fc1 = nn.Linear(c.dim, c.hidden)
        self.fc2 = nn.Linear(c.hidden, c.dim)
        self.odd = nn.Linear(15, 7, bias=False)  # an uneven (7, 15) weight

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x + F.pad(self.odd(x[..., :15]), (0, d - 7))


class TinyLM(nn.Module):
    def __init__(self, c: TinyConfig):
        super().__init__()
        self.c = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.segment = nn.Parameter(torch.randn(1, c.dim) * 0.02)  # fewer rows than ranks
        self.scale = nn.Parameter(torch.ones(c.dim), requires_grad=False)  # frozen
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def _run(self, block, x):
        if self.c.checkpointing == "none":
            return block(x)
        return checkpoint(block, x, use_reentrant=self.c.checkpointing == "reentrant")

    def forward(self, tokens, targets):
        x = self.embed(tokens) * self.scale + self.segment
        for block in self.blocks:
            x = self._run(block, x)
        if self.c.reuse_last_block:
            x = self._run(self.blocks[-1], x)  # a module called twice in one forward
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def batch(step: int, size: int, c: TinyConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, c.vocab, (size, c.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
