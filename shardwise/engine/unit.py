"""A unit: the module (or modules) whose parameter groups are gathered, freed and reduced together.

One ``fully_shard`` call makes one unit (``fully_shard([norm, head])``: one
unit of two modules). The unit keeps the per-iteration bookkeeping the hooks
need: how many of its forward calls still owe a backward (a module may run
twice in one forward), whether it was gathered for backward, whether its
gradients were reduced; and the settings FSDP2's ``FSDPModule`` methods
change per unit (``UnitSettings``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn as nn

from .collectives import InFlight
from .param_group import ParamGroup
from .post_forward_shard import PostForwardShard, is_group_size

__all__ = ["Unit", "UnitSettings"]


@dataclass
class UnitSettings:
    """What a unit does at each point of a step; FSDP2's per-module setters change these.

    ``reshard_after_forward`` ``None`` means: after forward unless the unit is its model's root.
    """

    reshard_after_forward: bool | None = True
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True  # False: grads stay unsharded and accumulate (no communication)
    requires_all_reduce: bool = True  # False: reduce-scatter, but leave the replicas' all-reduce for later
    unshard_in_backward: bool = True  # False: backward does not gather the weights (it never reads them)
    forward_prefetch: list["Unit"] | None = None  # None: the next unit in the recorded forward order
    backward_prefetch: list["Unit"] | None = None  # None: the previous unit in that order
    policy: object = None  # the unit's MixedPrecisionPolicy: cast_forward_inputs / output_dtype
    extra: dict = field(default_factory=dict)


class Unit:
    def __init__(self, name: str, module: nn.Module | Sequence[nn.Module], groups: Sequence[ParamGroup],
                 reshard_after_forward: bool | None, settings: UnitSettings | None = None):
        self.name = name or "<root>"
        self.modules = list(module) if isinstance(module, (list, tuple)) else [module]
        self.module = self.modules[0]
        self.groups = list(groups)
        self.settings = settings or UnitSettings()
        self.settings.reshard_after_forward = reshard_after_forward
        self.is_root = False  # the unit whose module is its model's root (set by the state that holds it)
        # FSDP2's lazy init, per unit: whether a forward has fixed the unit's role (FSDP2's ``_is_root`` no longer
        # ``None``): its root's first forward, or its own forward (or an enclosing unit's) before that one
        self.role_fixed = False
        self.fsdp2_refusals = False  # made by an FSDP2-style call: FSDP2's first-forward refusals apply (fully_shard)
        self.post_forward: PostForwardShard | None = None  # reshard_after_forward=k: the parts kept over k ranks
        # FSDP2's group forward: a unit's forward starts at the first of its modules to run (the weights are
        # gathered, the backward hook set) and ends after the last (or at the root's forward end)
        self.in_forward = False
        self.modules_to_run: set[int] = set()
        self.reset_iteration()

    @property
    def _reshard_wanted(self) -> bool:
        """The setting: ``None`` is after forward unless the unit is its model's root."""
        setting = self.settings.reshard_after_forward
        return (not self.is_root) if setting is None else bool(setting)

    @property
    def reshard_after_forward(self) -> bool:
        """Whether forward's end frees the gathered weights (never when nothing is sharded)."""
        return self._reshard_wanted and any(not g.persistent_unsharded for g in self.groups)

    def end_forward(self) -> None:
        """What the unit's modules hold after its forward, as under FSDP2: the sharded DTensors when it reshards
        (weights freed; only registered where nothing is sharded), else the gathered parameters, kept for
        backward, until a reshard (after backward, or ``reshard()``)."""
        if self.reshard_after_forward:
            self.reshard(after_forward=True)  # (under reshard_after_forward=k, keeps the parts over k ranks)
        elif self._reshard_wanted:
            self.use_sharded()

    def reset_iteration(self, keep_forward_counts: bool = False, keep_forward_state: bool = False) -> None:
        """Forget this backward's bookkeeping; ``keep_forward_counts`` keeps what forwards whose
        backward is still to come owe (several micro-batches in flight, under ``no_sync``);
        ``keep_forward_state`` also keeps that the unit ran forward with grad (a later backward
        of the same step still reduces it)."""
        if not keep_forward_counts:
            self.pending_backward = 0  # grad-enabled forward calls whose post-backward has not fired
            # Forwards run without grad inside a grad-enabled root forward: reentrant
            # checkpointing, which re-runs each of them (with grad) inside backward.
            self.expected_recompute = 0
        if not keep_forward_state:
            self.ran_with_grad = False
            self.in_forward = False
            self.modules_to_run = set()
        self.gathered_for_backward = False
        self.reduced = False

    @property
    def trainable_groups(self) -> list[ParamGroup]:
        return [g for g in self.groups if g.requires_grad]

    # Everything below is a loop over groups; the hooks decide when. The weight buffers' own work (gather,
    # refresh, free) runs outside torch.func's transforms: a unit first called inside ``torch.func.jvp``
    # gathers plain tensors, as FSDP2's collectives do, not functorch wrappers (which have no storage).
    def _restore_post_forward(self) -> None:
        if self.post_forward is not None and self.post_forward.holds:
            self.post_forward.restore()  # gathered over the k ranks: the groups' own gathers then do nothing

    def start_unshard(self) -> None:
        with torch._C._DisableFuncTorch():
            self._restore_post_forward()
            for g in self.groups:
                g.start_unshard()

    def finish_unshard(self) -> None:
        with torch._C._DisableFuncTorch():
            self._restore_post_forward()
            for g in self.groups:
                g.finish_unshard()

    def unshard(self) -> None:
        self.finish_unshard()
        for g in self.groups:
            g.use_unsharded()

    def reshard(self, after_forward: bool = False) -> None:
        """Free the gathered weights; at forward's end under ``reshard_after_forward=k``, keep their parts
        over ``k`` ranks instead."""
        if after_forward and self.post_forward is not None and is_group_size(self.settings.reshard_after_forward):
            self.post_forward.keep()
            return
        if self.post_forward is not None:
            self.post_forward.drop()
        with torch._C._DisableFuncTorch():
            for g in self.groups:
                g.reshard()

    def use_sharded(self) -> None:
        for g in self.groups:
            g.use_sharded()

    def refresh_model_weights(self) -> None:
        with torch._C._DisableFuncTorch():
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

    def stash_unsynced_grads(self) -> None:
        """A post-backward (or a backward's end) that leaves the grads unreduced: FSDP2 accumulates them in the
        reduction's dtype from here on (``unsynced_grads``)."""
        for g in self.trainable_groups:
            g.stash_unsynced_grads()

    def install_grads(self) -> None:
        for g in self.trainable_groups:
            g.install_grads()

    def __repr__(self) -> str:
        return f"Unit({self.name}, groups={len(self.groups)})"
