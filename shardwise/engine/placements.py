"""The strategy table: how each data-parallel mesh axis places the three buffers.

Every sharding mode of shardwise is a choice, per data-parallel mesh axis, of
where the model weights (``parameter``), the accumulated gradients
(``gradient``) and the fp32 main weights with optimizer state (``optimizer``)
live on that axis. Named strategies (Megatron-FSDP's names and ZeRO stage
numbers) are rows of one table, so the engine only ever reasons about
placements.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence, Union

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

__all__ = [
    "AxisPlacements",
    "STRATEGY_PLACEMENTS",
    "OUTER_STRATEGY_PLACEMENTS",
    "HYBRID_NAMES",
    "outer_strategy_choices",
    "hybrid_problem",
    "resolve_strategy",
    "strategy_placements",
    "validate_axis_placements",
    "describe",
]

R = Replicate()
S = Shard(0)
P = Partial("avg")


class AxisPlacements(NamedTuple):
    """Where one mesh axis puts each of the three buffers of a parameter group."""

    parameter: Placement
    gradient: Placement
    optimizer: Placement


STRATEGY_PLACEMENTS: dict[str, AxisPlacements] = {
    "no_shard": AxisPlacements(R, P, R),  # ZeRO-0: DDP
    "optim": AxisPlacements(R, P, S),  # ZeRO-1
    "optim_grads": AxisPlacements(R, S, S),  # ZeRO-2
    "optim_grads_params": AxisPlacements(S, S, S),  # ZeRO-3
}

# The outer axis of a hybrid mesh: `no_shard` replicates everything across the
# outer axis (HSDP), `optim` additionally shards the optimizer state (HFSDP).
OUTER_STRATEGY_PLACEMENTS: dict[str, AxisPlacements] = {
    "no_shard": AxisPlacements(R, P, R),
    "optim": AxisPlacements(R, P, S),
}
#: what each outer strategy is called (flags' help, errors, the planner's labels)
HYBRID_NAMES = {"no_shard": "HSDP", "optim": "HFSDP"}


def outer_strategy_choices() -> str:
    """``'no_shard' = HSDP, 'optim' = HFSDP``: the outer strategies with their names, for help and errors."""
    return ", ".join(f"{name!r} = {HYBRID_NAMES[name]}" for name in OUTER_STRATEGY_PLACEMENTS)

_ALIASES = {
    0: "no_shard",
    1: "optim",
    2: "optim_grads",
    3: "optim_grads_params",
    "0": "no_shard",
    "1": "optim",
    "2": "optim_grads",
    "3": "optim_grads_params",
    "zero0": "no_shard",
    "zero1": "optim",
    "zero2": "optim_grads",
    "zero3": "optim_grads_params",
    "ddp": "no_shard",
}

StrategyLike = Union[str, int]


def resolve_strategy(strategy: StrategyLike, argument: str = "strategy") -> str:
    """Map a strategy name, alias or ZeRO stage number to its canonical name."""
    if isinstance(strategy, bool) or not isinstance(strategy, (str, int)):
        raise TypeError(
            f"{argument}={strategy!r} must be a strategy name ({sorted(STRATEGY_PLACEMENTS)}) or a ZeRO stage 0-3"
        )
    key = strategy.lower() if isinstance(strategy, str) else strategy
    if isinstance(key, str) and key in STRATEGY_PLACEMENTS:
        return key
    if key in _ALIASES:
        return _ALIASES[key]
    raise ValueError(
        f"{argument}={strategy!r} is not a sharding strategy; expected one of "
        f"{sorted(STRATEGY_PLACEMENTS)} or a ZeRO stage 0-3"
    )


def strategy_placements(
    strategy: StrategyLike = "optim_grads_params",
    outer_dp_sharding_strategy: StrategyLike | None = None,
    inner_axis: str = "dp_shard",
    outer_axis: str = "dp_outer",
) -> dict[str, AxisPlacements]:
    """Placements per mesh axis for a named strategy (and a hybrid outer strategy)."""
    inner = resolve_strategy(strategy, "strategy")
    placements = {inner_axis: STRATEGY_PLACEMENTS[inner]}
    if outer_dp_sharding_strategy is None:
        return placements
    outer = resolve_strategy(outer_dp_sharding_strategy, "outer_dp_sharding_strategy")
    problem = hybrid_problem(inner, outer, given_inner=strategy)
    if problem:
        raise ValueError(f"outer_dp_sharding_strategy={outer_dp_sharding_strategy!r} {problem}")
    return {outer_axis: OUTER_STRATEGY_PLACEMENTS[outer], inner_axis: placements[inner_axis]}


def hybrid_problem(inner: str, outer: str, inner_argument: str = "strategy", given_inner=None) -> str | None:
    """What is wrong with a hybrid mesh's outer strategy ``outer`` over ``inner`` (canonical names), said to
    follow the outer argument and its value, or ``None``. The one statement of the rule that ``fully_shard``,
    the Megatron face and ``shardwise train`` all apply: the outer axis takes a row of
    :data:`OUTER_STRATEGY_PLACEMENTS` (``no_shard`` = HSDP, ``optim`` = HFSDP), and HFSDP needs ZeRO-3 on the
    inner axis (``inner_argument`` names it, with the value ``given_inner`` as the caller was given it)."""
    if outer not in OUTER_STRATEGY_PLACEMENTS:
        return f"is not supported; expected one of {sorted(OUTER_STRATEGY_PLACEMENTS)} ({outer_strategy_choices()})"
    if outer == "optim" and inner != "optim_grads_params":
        return (f"(HFSDP) needs {inner_argument}='optim_grads_params' on the inner axis, "
                f"got {inner_argument}={inner if given_inner is None else given_inner!r}")
    return None


def _is_shard(p: Placement) -> bool:
    return isinstance(p, Shard)


def validate_axis_placements(axis: str, placements: AxisPlacements) -> None:
    """Reject placements the engine cannot realise on one axis."""
    if not isinstance(placements, AxisPlacements):
        if isinstance(placements, Sequence) and len(placements) == 3:
            placements = AxisPlacements(*placements)
        else:
            raise TypeError(
                f"placements[{axis!r}]={placements!r} must be an AxisPlacements(parameter, gradient, optimizer)"
            )
    param, grad, opt = placements
    for name, p, allowed in (
        ("parameter", param, (Replicate, Shard)),
        ("gradient", grad, (Partial, Shard)),
        ("optimizer", opt, (Replicate, Shard)),
    ):
        if not isinstance(p, allowed) or (isinstance(p, Shard) and p.dim != 0):
            kinds = " or ".join("Shard(0)" if a is Shard else f"{a.__name__}" for a in allowed)
            raise ValueError(f"placements[{axis!r}].{name}={p!r} is not supported; use {kinds}")
    # A buffer can only be sharded on an axis where every buffer it is derived from is too:
    # gradients are produced at the parameter's placement, the optimizer consumes gradients.
    if _is_shard(param) and not _is_shard(grad):
        raise ValueError(f"placements[{axis!r}]: parameter is Shard but gradient is {grad!r}")
    if _is_shard(grad) and not _is_shard(opt):
        raise ValueError(f"placements[{axis!r}]: gradient is Shard but optimizer is {opt!r}")


def normalize_placements(
    placements: Mapping[str, AxisPlacements | Sequence[Placement]],
) -> dict[str, AxisPlacements]:
    out = {}
    for axis, p in placements.items():
        validate_axis_placements(axis, p)
        out[axis] = p if isinstance(p, AxisPlacements) else AxisPlacements(*p)
    return out


def describe(placements: Mapping[str, AxisPlacements]) -> str:
    """A short human-readable form, e.g. ``dp_outer[R,P,S] dp_shard[S,S,S]``."""

    def short(p: Placement) -> str:
        return "S" if isinstance(p, Shard) else "R" if isinstance(p, Replicate) else "P"

    return " ".join(f"{axis}[{','.join(short(x) for x in p)}]" for axis, p in placements.items())


# Axis names that mean model parallelism wherever they appear: never taken for data-parallel axes by default.
_MODEL_PARALLEL_NAMES = ("tp", "ep", "pp", "cp", "etp", "expert_tp")


def resolve_axis_placements(
    axis_names: Sequence[str] | None,
    placements,
    strategy: StrategyLike | None,
    outer_dp_sharding_strategy: StrategyLike | None,
    model_parallel_axes: Sequence[str] = ("tp",),
) -> dict[str, AxisPlacements]:
    """Each data-parallel axis's placements from ``fully_shard``'s arguments, for a mesh with these axis names
    (``None``: the default 1-D ``dp_shard`` mesh). The one resolution the build and the rank-consistency check
    share. Without ``placements``, a mesh with one data-parallel axis takes ``strategy`` (ZeRO-3 by default) on
    it, and one with two is hybrid, whatever their names (FSDP2's 2-D mesh: the first axis replicates, HSDP,
    or takes ``outer_dp_sharding_strategy``; the second takes ``strategy``)."""
    if placements is not None and (strategy is not None or outer_dp_sharding_strategy is not None):
        raise ValueError("pass either placements=... or strategy=/outer_dp_sharding_strategy=, not both")
    if placements is None:
        outer = outer_dp_sharding_strategy
        if axis_names is None and outer is not None:
            raise ValueError(
                f"outer_dp_sharding_strategy={outer!r} needs a 2-D mesh with axes ('dp_outer', 'dp_shard'); "
                "pass mesh=shardwise.build_dp_mesh(outer=N)"
            )
        chosen = strategy if strategy is not None else 3
        data = None if axis_names is None else [n for n in axis_names if n not in tuple(model_parallel_axes) + ("cp",)]
        if data is not None and any(n in _MODEL_PARALLEL_NAMES for n in data):
            data = None  # an axis named like a model-parallel one that tp_axis/ep_axis do not name: say so later
        if data is not None and len(data) == 2:
            return strategy_placements(chosen, outer if outer is not None else "no_shard",
                                       inner_axis=data[1], outer_axis=data[0])
        if data is not None and len(data) == 1 and outer is None:
            return strategy_placements(chosen, inner_axis=data[0])
        return strategy_placements(chosen, outer)
    if isinstance(placements, (str, int)):
        return strategy_placements(placements, inner_axis=axis_names[-1] if axis_names else "dp_shard")
    if isinstance(placements, Mapping):
        return normalize_placements(placements)
    raise TypeError(f"placements={placements!r} must be a strategy name or a dict of axis -> AxisPlacements")
