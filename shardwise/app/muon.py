"""``--optimizer muon`` (train and bench): torch's Muon on the layers' matrices, AdamW on the rest.

Muon's authors prescribe AdamW for the embeddings, the output head, norms and
biases, and Muon (``torch.optim.Muon``, unchanged) for the hidden layers' 2-D
weights. Those matrices are sharded ``Owned()`` (``shardwise.engine.owner_layout``):
whole on one owner rank, so each is orthogonalised once, by its owner, with no
collective of its own. ``adjust_lr_fn="match_rms_adamw"`` (Moonlight/Kimi: the
update scaled to AdamW's RMS, ``0.2 sqrt(max(A, B))``) lets AdamW's learning rate
and weight decay carry over, so one ``--lr`` serves both.
"""

from __future__ import annotations

import torch
from torch import nn

from ..engine.owner_layout import Owned, ns_flops
from ..models import UNIT_MODULES

__all__ = ["OPTIMIZERS", "muon_names", "owned_placement_fn", "MuonWithAdamW", "ns_flops_per_rank"]

OPTIMIZERS = ("adamw", "muon")


def muon_names(model: nn.Module) -> set[str]:
    """The 2-D parameters inside the model's layers (``models.UNIT_MODULES``): Muon's; not the embedding or head."""
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, UNIT_MODULES):
            names |= {f"{module_name}.{n}" if module_name else n
                      for n, p in module.named_parameters() if p.dim() == 2}
    return names


def owned_placement_fn(model: nn.Module):
    """``shard_placement_fn`` for ``fully_shard``: ``Owned()`` for :func:`muon_names`' parameters, ``None`` (FSDP2's
    ``Shard(0)``) for the rest. Read before wrapping (the function sees the original parameters)."""
    names = muon_names(model)
    ids = {id(p) for n, p in model.named_parameters() if n in names}
    return lambda p: Owned() if id(p) in ids else None


class MuonWithAdamW:
    """``torch.optim.Muon`` over the layers' matrices and ``torch.optim.AdamW`` over the rest, stepped and zeroed
    together. ``param_groups`` lists both optimizers' groups (a schedule that sets ``lr`` sets both);
    ``optimizers`` is the pair, for torch's state-dict functions (``get_state_dict(model, list)``)."""

    def __init__(self, model: nn.Module, names: set[str], lr: float, weight_decay: float = 0.0,
                 adamw_groups=None, **adamw_kwargs):
        named = list(model.named_parameters())
        self.muon = torch.optim.Muon([p for n, p in named if n in names], lr=lr, weight_decay=weight_decay,
                                     adjust_lr_fn="match_rms_adamw")
        rest = [p for n, p in named if n not in names]
        self.adamw = torch.optim.AdamW(adamw_groups(rest) if adamw_groups else rest, lr=lr,
                                       weight_decay=weight_decay, **adamw_kwargs)
        self.optimizers = [self.muon, self.adamw]

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    @property
    def state(self) -> dict:
        return {**self.muon.state, **self.adamw.state}

    def step(self, closure=None):
        self.muon.step()
        return self.adamw.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def ns_flops_per_rank(model: nn.Module, names: set[str], group=None) -> list[int]:
    """Newton-Schulz FLOPs of the matrices each rank holds whole (its owned ones), one entry per rank."""
    import torch.distributed as dist

    mine = sum(ns_flops(p.shape) for n, p in model.named_parameters()
               if n in names and _local(p).numel() == p.numel())
    world = dist.get_world_size(group)
    device = next(model.parameters()).device
    out = [torch.zeros((), dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(out, torch.tensor(float(mine), dtype=torch.float64, device=device), group=group)
    return [int(t.item()) for t in out]


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p
