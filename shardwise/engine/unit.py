"""A unit: a module whose parameter groups are gathered, freed and reduced together.

The unit keeps the per-iteration bookkeeping the hooks need: how many of its
forward calls still owe a backward (a module may run twice in one forward),
whether it was gathered for backward, and whether its gradients were reduced.
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from .collectives import InFlight
from .param_group import ParamGroup

__all__ = ["Unit"]


class Unit:
    def __init__(self, name: str, module: nn.Module, groups: Sequence[ParamGroup], reshard_after_forward: bool):
        self.name = name or "<root>"
        self.module = module
        self.groups = list(groups)
        self.reshard_after_forward = reshard_after_forward and any(
            not g.persistent_unsharded for g in self.groups
        )
        self.reset_iteration()

    def reset_iteration(self, keep_forward_counts: bool = False) -> None:
        """Forget this backward's bookkeeping; ``keep_forward_counts`` keeps what forwards whose
        backward is still to come owe (several micro-batches in flight, under ``no_sync``)."""
        if not keep_forward_counts:
            self.pending_backward = 0  # grad-enabled forward calls whose post-backward has not fired
            # Forwards run without grad inside a grad-enabled root forward: reentrant
            # checkpointing, which re-runs each of them (with grad) inside backward.
            self.expected_recompute = 0
        self.ran_with_grad = False
        self.gathered_for_backward = False
        self.reduced = False

    @property
    def trainable_groups(self) -> list[ParamGroup]:
        return [g for g in self.groups if g.requires_grad]

    # Everything below is a loop over groups; the hooks decide when.
    def start_unshard(self) -> None:
        for g in self.groups:
            g.start_unshard()

    def unshard(self) -> None:
        for g in self.groups:
            g.finish_unshard()
            g.use_unsharded()

    def reshard(self) -> None:
        for g in self.groups:
            g.reshard()

    def use_sharded(self) -> None:
        for g in self.groups:
            g.use_sharded()

    def refresh_model_weights(self) -> None:
        for g in self.groups:
            g.refresh_model_weights()

    def reduce_grads(self, finalize: bool) -> list[tuple[ParamGroup, InFlight]]:
        self.reduced = True
        return [(g, g.reduce_grads(finalize)) for g in self.trainable_groups]

    def finalize_idle_groups(self) -> list[tuple[ParamGroup, InFlight]]:
        """Finalize windows left open by earlier micro-batches of a unit this backward skipped."""
        out = []
        for g in self.trainable_groups:
            flight = g.finalize_without_new_grads()
            if flight is not None:
                out.append((g, flight))
        return out

    def install_grads(self) -> None:
        for g in self.trainable_groups:
            g.install_grads()

    def __repr__(self) -> str:
        return f"Unit({self.name}, groups={len(self.groups)})"
