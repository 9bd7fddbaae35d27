"""Misuses of FSDP2's face that train wrongly without a word, caught at the step where the state proves them.

Each is silent under torch's FSDP2 too; each costs one attribute test per unit (no collective) in a
steady step:

- an optimizer that holds a unit's *gathered* parameters (built between ``unshard()`` and ``reshard()``):
  they are rebuilt from the shards at every gather, so its updates are lost and the unit never trains
  (refused at the optimizer's first step);
- an optimizer step over units whose gradient sync is off (``set_requires_gradient_sync(False)`` never
  set back) with gradients still accumulating unsharded: none of their ``.grad`` exists, so nothing
  updates (refused at that step);
- plain (not sharded) trainable parameters stepped beside sharded ones on a mesh of several ranks: no
  ``fully_shard`` call owns them (the blocks were wrapped, the root not), so nothing reduces their
  gradients and the ranks drift apart. A warning, not an error: a script may all-reduce them itself;
- a unit still gathered (``unshard()`` without ``reshard()``) when a forward starts after its weights
  changed (an optimizer step, a load): that forward would compute with the old weights (refused there);
- parameters still on the meta device at the first forward (listed; FSDP2 lists them too, there).

The optimizer checks ride on a global optimizer step pre-hook, as ``replaced_params``' does; the forward
checks are called by the root's pre-forward.
"""

from __future__ import annotations

import warnings
import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .param_group import SHARDED_MARK, WeightState

__all__ = ["UnreducedGradientWarning", "watch_state", "mark_ignored", "check_gathered_weights_current",
           "check_materialized"]

_IGNORED_MARK = "_shardwise_ignored"
_states: "weakref.WeakSet" = weakref.WeakSet()
# optimizer -> (its number of param groups when looked at, the units whose sharded parameters it steps)
_seen: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, list]]" = weakref.WeakKeyDictionary()
_hook = None
_materialized: "weakref.WeakSet" = weakref.WeakSet()  # states whose first forward found no meta parameter


class UnreducedGradientWarning(UserWarning):
    """Parameters no ``fully_shard`` call owns are stepped beside sharded ones: their gradients are never
    reduced across ranks. Filter it (``warnings.filterwarnings("ignore", category=...)``) in a script that
    all-reduces them itself."""


def watch_state(state) -> None:
    """Let the step checks see ``state``'s units (called by ``fully_shard`` once per call)."""
    global _hook
    _states.add(state)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_step)


def mark_ignored(param: torch.Tensor) -> None:
    """``param`` was passed in ``ignored_params=``: left unreduced on purpose, never warned about."""
    setattr(param, _IGNORED_MARK, True)


def _units() -> dict[int, object]:
    found = {}
    for state in list(_states):
        for unit in state.all_units:
            found[id(unit)] = unit
    return found


def _check_step(optimizer, args, kwargs) -> None:
    seen = _seen.get(optimizer)
    if seen is None or seen[0] != len(optimizer.param_groups):
        seen = _seen[optimizer] = (len(optimizer.param_groups), _first_look(optimizer))
    # every step: one attribute per unit (sync is on in a steady step, and nothing more is read)
    unsynced = [u for u in seen[1] if not u.settings.requires_gradient_sync
                and any(g.has_unsharded_grads() for g in u.groups)]
    if unsynced:
        _refuse_unsynced(optimizer, unsynced)


def _first_look(optimizer) -> list:
    """The once-per-optimizer checks; the units whose sharded parameters ``optimizer`` steps."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    units = _units().values()
    owner_of_sharded, owner_of_gathered = {}, {}
    for unit in units:
        for group in unit.groups:
            for p in group.sharded_params:
                owner_of_sharded[id(p)] = unit
            for p in group.unsharded_params:
                owner_of_gathered[id(p)] = unit
    name = type(optimizer).__name__
    gathered = {owner_of_gathered[id(p)].name for p in params if id(p) in owner_of_gathered}
    if gathered:
        raise RuntimeError(
            f"optimizer={name} holds the gathered (unsharded) parameters of units {sorted(gathered)}: it was built "
            "while they were unsharded (unshard() without reshard()), and those tensors are rebuilt from the "
            "shards at every gather, so its steps would be lost and the units would never train; call reshard() "
            "on them, then build the optimizer from model.parameters()")
    stepped = {id(owner_of_sharded[id(p)]): owner_of_sharded[id(p)] for p in params if id(p) in owner_of_sharded}
    _warn_unowned(name, params)
    return list(stepped.values())


def _warn_unowned(name: str, params: list) -> None:
    multi_rank = [p for p in params if getattr(p, SHARDED_MARK, False) and isinstance(p, DTensor)
                  and p.device_mesh.size() > 1]
    if not multi_rank:
        return
    plain = [p for p in params if not isinstance(p, DTensor) and p.requires_grad and p.grad is not None
             and not getattr(p, _IGNORED_MARK, False)]
    if not plain:
        return
    shapes = [list(p.shape) for p in plain[:3]]
    warnings.warn(UnreducedGradientWarning(
        f"optimizer={name} steps {len(plain)} parameters that no fully_shard call owns (shapes {shapes}"
        f"{' ...' if len(plain) > 3 else ''}) beside parameters sharded over {multi_rank[0].device_mesh.size()} "
        "ranks: nothing reduces their gradients, so the ranks' copies drift apart. Call fully_shard(model) on "
        "the root after its blocks (FSDP2's idiom), or pass them in ignored_params= if you reduce them yourself"),
        stacklevel=3)


def _refuse_unsynced(optimizer, units: list) -> None:
    names = sorted(u.name for u in units)
    raise RuntimeError(
        f"optimizer={type(optimizer).__name__}.step() over units {names} whose gradient sync is off "
        "(set_requires_gradient_sync(False)) with their gradients still accumulating unsharded: none of their "
        ".grad exists, so this step would not update them; call model.set_requires_gradient_sync(True) before the "
        "last micro-batch's backward (or shardwise.engine.model_ops.finish_grad_accumulation(model) after it)")


def check_gathered_weights_current(units) -> None:
    """At a forward's start: refuse a unit still gathered (``unshard()`` without ``reshard()``) whose weights
    changed since (an optimizer step, a load): the forward would read the old weights."""
    stale = []
    for unit in units:
        for group in unit.groups:
            if (group.weight_state is WeightState.UNSHARDED and not group.persistent_unsharded
                    and not group.graph_safe and group.weights_changed_since_gather()):
                stale.append(unit.name)
                break
    if stale:
        raise RuntimeError(
            f"units {stale} are still unsharded (unshard() without reshard(), or set_reshard_after_backward(False) "
            "across a step) and their weights changed since they were gathered (an optimizer step or a load): this "
            "forward would compute with the old weights; call reshard() on them after the last backward, before "
            "the next forward")


def check_materialized(state) -> None:
    """At a model's first forward: refuse parameters still on the meta device (a module left there, never
    ``to_empty()``-ed), listing them, instead of failing inside a gather on a device mismatch. In FSDP2's words
    and order: the first unit holding any (the root, then the others in module order), its parameters listed."""
    if state in _materialized:
        return
    position = {id(m): i for i, m in enumerate(state.root.module.modules())}
    units = [state.root] + sorted(state.units, key=lambda u: min(position.get(id(m), len(position)) for m in u.modules))
    for unit in units:
        meta = [ref.fqn if unit.is_root else f"{unit.name}.{ref.fqn}" for group in unit.groups
                for ref, p in zip(group.refs, group.sharded_params) if p.device.type == "meta"]
        if meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, but the following were "
                f"still on meta device: {meta}; materialize them first: model.to_empty(device=...) and the "
                "model's own initialisation (or fully_shard(..., init_fn=shardwise.MetaInitializer(model)))")
    _materialized.add(state)
