"""``shardwise train --cp N``: each sequence split over ``N`` ranks (context parallelism).

The world is ``dp x cp`` ranks on a (``dp_outer``,) ``dp_shard``, ``cp`` mesh
(``shardwise.build_dp_mesh(cp=N)``); ``fully_shard`` shards the parameters over
``dp_shard`` x ``cp`` together, so gradients are reduced over both. The ``cp``
ranks of one data rank read the same rows (``TokenLoader`` over ``world / cp``
data ranks) and each trains its zig-zag slice of them
(``shardwise.models.context_parallel``); the GPT's loss is the token mean over
the whole sequences, the same on every CP rank, so the step's loss counts one
CP rank per data rank.

Checked here, at config time: :func:`check_flags` (the flags alone),
:func:`check_world` (with the number of processes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .errors import ConfigError
from .loop import DataParallelRun

__all__ = ["check_flags", "check_world", "ContextParallelRun"]


def check_flags(cfg, model) -> None:
    """Refuse what ``--cp`` cannot train, naming the flag and value (before any process starts)."""
    if cfg.cp < 1:
        raise ConfigError("cp", cfg.cp, "must be at least 1 (the ranks each sequence is split over)")
    if cfg.cp == 1:
        return
    if cfg.seq_len % (2 * cfg.cp):
        raise ConfigError("seq_len", cfg.seq_len, f"must be divisible by 2 x --cp = {2 * cfg.cp} (each sequence "
                          "is cut into 2 x cp equal chunks, two per rank)")
    not_built = [("pp", cfg.pp > 1, "pipeline stages"),
                 ("hf_config", bool(cfg.hf_config), "Hugging Face models (their own attention)"),
                 ("init_from", bool(cfg.init_from), "Hugging Face models (their own attention)"),
                 ("compile", bool(cfg.compile), "compiled layers (the K/V all-gather inside a compiled unit is "
                                                "untested; --no-compile)"),
                 ("eval_data", bool(cfg.eval_data), "evaluation"),
                 ("eval_fraction", bool(cfg.eval_fraction), "evaluation")]
    for name, used, what in not_built:
        if used:
            raise ConfigError(name, getattr(cfg, name), f"with --cp {cfg.cp} is not built yet ({what})")
    kinds = set(model.layer_kinds) - {"A"}
    if kinds:
        raise ConfigError("layer_pattern", model.layer_pattern, f"--cp {cfg.cp} is built for attention layers (A) "
                          f"only, not {sorted(kinds)} (MoE's load-balancing loss, Mamba's scan)")


def check_world(cfg, world: int) -> None:
    """``--cp`` (and ``--outer-dp`` inside the data ranks) against the number of processes."""
    if world % cfg.cp:
        raise ConfigError("cp", cfg.cp, f"must divide the number of processes ({world})")
    dp = world // cfg.cp
    if cfg.outer_dp and dp % cfg.outer_dp:
        raise ConfigError("outer_dp", cfg.outer_dp, f"must divide the data-parallel ranks (processes / --cp = {dp})")


class ContextParallelRun(DataParallelRun):
    """One model on every rank; the ``cp`` ranks of a data rank share its rows, each trains its slice."""

    def __init__(self, model: torch.nn.Module, cp_group):
        super().__init__(model)
        self.cp_group = cp_group
        self.cp, self.cp_rank = dist.get_world_size(cp_group), dist.get_rank(cp_group)
        self.data_ranks = dist.get_world_size() // self.cp
        self.data_rank = dist.get_rank() // self.cp  # cp is the mesh's innermost axis

    def forward_backward(self, loader, grad_accum: int, device: torch.device) -> torch.Tensor:
        """Like one model's, on this rank's zig-zag slice; the loss counted on CP rank 0 only (every CP rank
        holds the same whole-sequence loss)."""
        loss_sum = super().forward_backward(_Sliced(loader, self.cp_group), grad_accum, device)
        return loss_sum if self.cp_rank == 0 else torch.zeros_like(loss_sum)


class _Sliced:
    """``next()`` of a loader of whole rows, as this CP rank's zig-zag slice of them."""

    def __init__(self, loader, cp_group):
        self.loader, self.cp_group = loader, cp_group

    def __next__(self):
        from ..models.context_parallel import zigzag_split

        return tuple(zigzag_split(t, self.cp_group) for t in next(self.loader))
