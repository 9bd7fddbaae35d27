"""Parameters shardwise replaced, and the rule that no optimizer may step them.

``fully_shard`` (and meta materialization) put new parameter objects into the
modules; the old ones are discarded. An optimizer built before holds the old
ones: its ``step()`` updates tensors the model no longer uses, which never get
a gradient, so the loss stays flat and nothing says why. Each replaced
parameter carries a mark, and a global optimizer step pre-hook (registered
once, at the first replacement) looks at an optimizer's parameters the first
time it steps; an optimizer found clean is not looked at again unless it
gains a parameter group (one dictionary lookup per step after that), so every
torch optimizer is covered at no measurable cost.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

__all__ = ["mark_replaced", "is_replaced", "check_optimizer_params"]

_MARK = "_shardwise_replaced_by"
_checked: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()  # -> its groups
_hook = None


def mark_replaced(param: torch.Tensor, by: str) -> None:
    """Record that ``by`` (e.g. ``"fully_shard"``) replaced ``param`` in its module; from now on an
    optimizer that holds it is refused at its first ``step()``."""
    global _hook
    setattr(param, _MARK, by)
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check_at_first_step)


def is_replaced(param: torch.Tensor, by: str) -> bool:
    """Whether ``mark_replaced(param, by)`` marked ``param`` (``"fully_shard"``: an earlier call took its values)."""
    return getattr(param, _MARK, None) == by


def _check_at_first_step(optimizer, args, kwargs) -> None:
    if _checked.get(optimizer) == len(optimizer.param_groups):
        return
    check_optimizer_params(optimizer)
    # Clean: not looked at again until add_param_group adds a group (a failed one is checked at every step).
    _checked[optimizer] = len(optimizer.param_groups)


def check_optimizer_params(optimizer, model: torch.nn.Module | None = None) -> None:
    """Refuse an optimizer that holds parameters shardwise replaced (it was built before ``fully_shard``),
    and, given ``model``, any tensor that is not one of ``model``'s parameters."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    name = type(optimizer).__name__
    replaced = [p for p in params if getattr(p, _MARK, None)]
    if replaced:
        by = getattr(replaced[0], _MARK)
        raise ValueError(
            f"optimizer={name}: {len(replaced)} of its {len(params)} parameters were replaced by {by} after the "
            f"optimizer was built, so its step would update discarded tensors while the model never changes; "
            f"build the optimizer from model.parameters() after fully_shard")
    if model is not None:
        current = {id(p) for p in model.parameters()}
        foreign = [p for p in params if id(p) not in current]
        if foreign:
            raise ValueError(
                f"optimizer={name}: {len(foreign)} of its {len(params)} parameters are not parameters of the model; "
                f"build the optimizer from model.parameters() after fully_shard")
