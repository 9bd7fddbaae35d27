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

__all__ = ["OPTIMIZERS", "muon_names", "owned_placement_fn", "MuonAdamW", "ns_flops_per_rank"]

OPTIMIZERS = ("adamw", "muon")


def check_muon(cfg) -> tuple | None:
    """``(flag, value, why)`` when ``shardwise train``'s flags do not go with ``--optimizer muon`` (or name an
    unknown optimizer); ``None`` when they do."""
    if cfg.optimizer not in OPTIMIZERS:
        return "optimizer", cfg.optimizer, f"use one of {', '.join(OPTIMIZERS)}"
    if cfg.optimizer != "muon":
        return None
    if cfg.strategy not in ("optim_grads_params", "3") or cfg.outer_strategy not in ("", "no_shard"):
        return ("optimizer", cfg.optimizer, f"needs --strategy optim_grads_params (ZeRO-3; with --outer-strategy "
                f"no_shard: HSDP), not {cfg.strategy}{' / ' + cfg.outer_strategy if cfg.outer_strategy else ''}: "
                "Muon's matrices are whole on one owner rank of the shard axis")
    for flag in ("pp", "cp"):
        if getattr(cfg, flag) > 1:
            return "optimizer", cfg.optimizer, f"not built with --{flag} {getattr(cfg, flag)}"
    for flag in ("offload", "cuda_graphs", "fp8", "hf_config", "init_from"):
        if getattr(cfg, flag, None):
            return "optimizer", cfg.optimizer, f"not built with --{flag.replace('_', '-')}"
    return None


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


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over the named matrices and ``torch.optim.AdamW`` over the rest, as one torch optimizer.

    Each step runs the two torch optimizers unchanged over their own groups; this optimizer's ``param_groups``
    are theirs (Muon's first) and its ``state`` is the one both write, so a schedule that sets ``lr`` sets both
    and torch's ``state_dict`` / ``get_optimizer_state_dict`` / DCP see one optimizer (``shardwise train``'s
    checkpoints). ``adamw_groups(params)`` may split AdamW's parameters into groups (weight decay or not).
    """

    def __init__(self, model: nn.Module, names: set[str], lr: float, weight_decay: float = 0.0,
                 adamw_groups=None, **adamw_kwargs):
        named = list(model.named_parameters())
        self.muon = torch.optim.Muon([p for n, p in named if n in names], lr=lr, weight_decay=weight_decay,
                                     adjust_lr_fn="match_rms_adamw")
        rest = [p for n, p in named if n not in names]
        self.adamw = torch.optim.AdamW(adamw_groups(rest) if adamw_groups else rest, lr=lr,
                                       weight_decay=weight_decay, **adamw_kwargs)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._share()

    def _share(self) -> None:
        """The two torch optimizers read this one's groups and write its state."""
        k = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:k], self.param_groups[k:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # new group and state objects
        self._share()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss


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
