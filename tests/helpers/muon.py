"""The Muon cases' shared pieces: the tiny model's Muon/AdamW split, the two torch optimizers as one, the wrap
with ``Owned()`` matrices, and torch's Newton-Schulz iteration in fp32 for exactness checks."""

from __future__ import annotations

import contextlib

import torch

import shardwise
from shardwise.engine.owner_layout import Owned
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM

CONFIG = TinyConfig()


def is_muon(name: str, p: torch.Tensor) -> bool:
    """The blocks' matrices: Muon's; everything else (embedding/head, norms, biases): AdamW's."""
    return name.startswith("blocks.") and p.dim() == 2


class TwoOptimizers:
    """Muon and AdamW stepped and zeroed together (the loop's one ``optimizer``)."""

    def __init__(self, model, muon_lr: float = 0.02):
        named = list(model.named_parameters())
        self.muon = torch.optim.Muon([p for n, p in named if is_muon(n, p)], lr=muon_lr, weight_decay=0.1,
                                     adjust_lr_fn="match_rms_adamw")
        self.adamw = torch.optim.AdamW([p for n, p in named if not is_muon(n, p)], lr=1e-2, weight_decay=0.1)

    def step(self):
        self.muon.step()
        self.adamw.step()

    def zero_grad(self):
        self.muon.zero_grad()
        self.adamw.zero_grad()


def build():
    torch.manual_seed(0)
    return TinyLM(CONFIG)


def wrap(hsdp: bool = False, bf16: bool = False):
    """``fully_shard`` over the blocks with their matrices ``Owned()`` (ZeRO-3, or HSDP on a (2, N/2) mesh;
    ``bf16``: bf16 compute, fp32 main weights)."""
    def wrapped(model):
        owned = {id(p) for n, p in model.named_parameters() if is_muon(n, p)}
        mesh = shardwise.build_dp_mesh(outer=2) if hsdp else None
        policy = shardwise.MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None)
        return shardwise.fully_shard(model, mesh, unit_modules=[Block], mixed_precision=policy,
                                     outer_dp_sharding_strategy="no_shard" if hsdp else None,
                                     shard_placement_fn=lambda p: Owned() if id(p) in owned else None)
    return wrapped


def _fp32_newton_schulz(grad, coefficients, steps, eps):
    """torch.optim.Muon's quintic iteration (``_zeropower_via_newtonschulz``) in fp32 instead of bf16."""
    a, b, c = coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


@contextlib.contextmanager
def newton_schulz_in_fp32(on: bool = True):
    """torch.optim.Muon with its iteration in fp32 (``on``), for runs whose gradients are summed in another
    order than the reference's: torch's bf16 iteration turns an fp32 rounding into a bf16 one."""
    import torch.optim._muon as torch_muon

    kept = torch_muon._zeropower_via_newtonschulz
    if on:
        torch_muon._zeropower_via_newtonschulz = _fp32_newton_schulz
    try:
        yield
    finally:
        torch_muon._zeropower_via_newtonschulz = kept
