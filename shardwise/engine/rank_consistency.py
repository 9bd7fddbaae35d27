"""Rank consistency at wrap time: every rank of a mesh must wrap the same thing.

Sharding is a contract between ranks: each collective that follows assumes that
every rank packed the same parameters, in the same order, with the same shapes
and dtypes, into the same units, under the same placements and meshes. When
one rank builds another model (an extra layer, another hidden size, the same
numel in another shape) or passes other arguments, the collectives hang, crash
with ``Connection reset by peer``, or silently average unrelated numbers.

:func:`check_rank_consistency` runs before anything is sharded. Each rank
builds a short, deterministic description of what must agree (the
:func:`describe` dict), hashes it, and ranks exchange ``(digest, mesh ranks,
local problem)`` in ONE ``all_gather_object`` over the default group. Every
rank then reads the same gathered list, so all reach the same verdict: when
digests differ a second exchange of the full descriptions names the first
differing field and the ranks, and every rank raises the same ``ValueError``.
No rank can stop before the exchange (describing never raises: a problem found
locally travels in the exchange), so no rank is left waiting in a collective.

The parameters' values (one float64 sum each, of those every data-parallel rank
should hold alike) travel as a digest of their own: values that differ are no
refusal (FSDP2 shards whatever each rank holds, and a load after wrapping makes
them agree), so a second exchange of the sums only names the parameters that
differ, which :func:`check_rank_consistency` returns for ``weight_origin`` to
watch until something writes them.

Local problems, found without communication and raised on every rank:
a mesh or expert mesh that is not a DeviceMesh, an expert mesh with no parameter for it (``plan_fn`` chose none),
tensor-parallel slices (``tensor_model_parallel=True``) of a TP group of more
than one rank wrapped on a mesh without the ``tp`` axis (or built with another
TP group than the mesh's), expert-parallel models whose experts per rank do
not match the expert mesh (or with no expert mesh), and an expert mesh that
does not cover the same ranks as the dense mesh.

:func:`raise_together` is the small building block other wrap-time checks use
(the Megatron face's group checks): run a local check on every rank, exchange
its outcome, raise on every rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .fully_shard_options import FullyShardOptions
from .mesh import EXPERT_CHOICES, mesh_axis_names
from .placements import describe as describe_placements
from .resolution import plan_choice, resolve_units
from .spmd_mesh import spmd_param_of

__all__ = ["check_rank_consistency", "describe", "first_difference", "raise_together"]

_PREFIX = "ranks disagree before sharding: "
# Fields compared before the parameters, in this order (the first difference is reported).
_SCALAR_FIELDS = (
    ("mesh", "the mesh"),
    ("expert_mesh", "the expert mesh"),
    ("placements", "the placements (strategy)"),
    ("expert_placements", "the expert placements"),
    ("axes", "(tp_axis, ep_axis)"),
    ("options", "the fully_shard options"),
)


# ------------------------------------------------------------------ exchange
def _world() -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _all_gather(obj: Any, group=None) -> list:
    out: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def raise_together(error: Optional[str], group=None) -> None:
    """Raise ``ValueError`` on every rank of ``group`` when some rank has an ``error``.

    Every rank must call it (it is one ``all_gather_object``). A rank raises its
    own message; the others raise the lowest failing rank's, naming that rank,
    so no rank goes on into a collective the failing ones will never join.
    """
    me, world = _world()
    if world == 1:
        if error:
            raise ValueError(error)
        return
    errors = _all_gather(error, group)
    if error:
        raise ValueError(error)
    failing = [r for r, e in enumerate(errors) if e]
    if failing:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
        first = failing[0]
        raise ValueError(
            f"{errors[first]} (found on rank{'s' if len(failing) > 1 else ''} "
            f"{[ranks[r] for r in failing]}; rank {me} stops too so that no rank waits in a collective)"
        )


# ---------------------------------------------------------------- describing
def _canon(value: Any) -> Any:
    """A deterministic, rank-independent, picklable form of an argument value."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,) + tuple(
            (f.name, _canon(getattr(value, f.name))) for f in dataclasses.fields(value)
        )
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _canon(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_canon(v) for v in value)
    return type(value).__qualname__  # objects: only their kind (addresses differ by rank)


def _mesh_ranks(mesh: Optional[DeviceMesh], world: int) -> list[int]:
    return list(range(world)) if mesh is None else mesh.mesh.flatten().tolist()


def _describe_mesh(mesh: Optional[DeviceMesh], world: int, default: str) -> str:
    if mesh is None:
        return default
    return (
        f"{mesh.device_type} mesh {list(mesh.mesh_dim_names or ())} of shape {tuple(mesh.mesh.shape)} "
        f"over ranks {mesh.mesh.tolist()}"
    )


def _effective_placements(options: FullyShardOptions) -> str:
    """The placements ``fully_shard`` will use, described (raw arguments when they are invalid)."""
    resolved = _resolve(options)
    if resolved is None:
        return (f"invalid: placements={options.placements!r} strategy={options.strategy!r} "
                f"outer_dp_sharding_strategy={options.outer_dp_sharding_strategy!r}")
    return describe_placements(resolved)


def _given_strategy(placements, strategy, outer) -> str:
    """The placement arguments as the user wrote them, to name in a difference (not compared: ``strategy=1``
    and ``strategy="optim"`` agree)."""
    if placements is not None and not isinstance(placements, (str, int)):
        return "placements={...}"
    given = [f"placements={placements!r}"] if placements is not None else []
    given += [f"strategy={strategy!r}"] if strategy is not None or placements is None else []
    given += [f"outer_dp_sharding_strategy={outer!r}"] if outer is not None else []
    return ", ".join(given) + (" (the default, ZeRO-3)" if placements is None and strategy is None else "")


def _resolve(options: FullyShardOptions) -> Optional[dict]:
    """``fully_shard``'s placement resolution (``FullyShardOptions.axis_placements`` on the axis names
    ``mesh_axis_names`` reads, with the call's ``tp_axis``/``ep_axis``, as the build calls it), without raising
    (``None`` for invalid arguments)."""
    try:
        return options.axis_placements(None if options.mesh is None else mesh_axis_names(options.mesh))
    except (ValueError, TypeError, IndexError):
        return None


def _unit_names(module: nn.Module, unit_modules) -> tuple[str, ...]:
    """The names of the modules ``fully_shard`` will make units (``resolution.resolve_units``)."""
    names = {id(m): name for name, m in module.named_modules()}
    return tuple(names[id(m)] for m in resolve_units(module, unit_modules))


def _describe_params(module: nn.Module) -> tuple:
    first: dict[int, str] = {}
    out = []
    for name, p in module.named_parameters(remove_duplicate=False):
        tied = first.setdefault(id(p), name)
        tp = f"dim {int(getattr(p, 'partition_dim', 0))}" if getattr(p, "tensor_model_parallel", False) else "none"
        spmd = spmd_param_of(p)  # taken from a DTensor: its global shape (TP slices may be uneven, as FSDP2 takes)
        out.append((
            name,
            tuple(p.shape if spmd is None else spmd.global_shape(p.shape)),
            str(p.dtype).replace("torch.", ""),
            bool(p.requires_grad),
            tp,
            bool(getattr(p, "allreduce", True)),
            None if tied == name else tied,
        ))
    return tuple(out)


def _expert_params(module: nn.Module, expert_mesh: Optional[DeviceMesh], plan_fn) -> tuple[str, ...]:
    """The parameter names ``plan_fn`` puts on the expert mesh (none without one), in ``named_parameters`` order."""
    if expert_mesh is None:
        return ()
    if plan_fn is not None and not callable(plan_fn):
        return ()  # fully_shard names the bad argument itself
    return tuple(name for name, param in module.named_parameters(remove_duplicate=False)
                 if plan_choice(plan_fn, name, param) in EXPERT_CHOICES)


def describe(module: nn.Module, options: FullyShardOptions) -> dict:
    """What must agree across the ranks of a mesh, as a small picklable dict.

    Parameters are described as this rank holds them (TP/EP slices have the
    same local shape on every rank; one taken from a DTensor, its global shape): ``(name, shape, dtype, requires_grad,
    tensor-parallel partition dim, allreduce mark, tied-to name)``, in
    ``named_parameters`` order with shared parameters listed under every name;
    with an expert mesh, the names ``plan_fn`` puts on it.
    """
    _, world = _world()
    o = options
    return {
        "mesh": _describe_mesh(o.mesh, world, f"the default 1-D dp_shard mesh over {world} ranks"),
        "expert_mesh": _describe_mesh(o.expert_mesh, world, "none"),
        "placements": _effective_placements(o),
        "given": _given_strategy(o.placements, o.strategy, o.outer_dp_sharding_strategy),
        "expert_placements": "taken from the placements" if o.expert_placements is None
        else _effective_placements(FullyShardOptions(placements=o.expert_placements)),
        "axes": (o.tp_axis, o.ep_axis),
        "options": _canon(o.must_agree()),
        "params": _describe_params(module),
        "units": _unit_names(module, o.unit_modules),
        "expert_params": _expert_params(module, o.expert_mesh, o.plan_fn),
        # Under TP, replicated parameters may differ across the TP group until the build syncs them.
        "values": () if o.sync_module_states or o.check_module_states in (False, "off")
        or o.tp_axis in ((o.mesh and o.mesh.mesh_dim_names) or ())
        else _checksums(module, o.expert_mesh, o.plan_fn),
    }


def _checksums(module: nn.Module, expert_mesh, plan_fn) -> tuple:
    """``(name, sum in float64)`` of every parameter all data-parallel ranks must hold alike: not yet sharded,
    materialized, and neither a tensor-parallel slice nor an expert (those differ across their ranks by
    design). One reduction per parameter and one host read for all, so weights loaded on one rank only
    (FSDP1's ``sync_module_states`` habit) are named before they are mixed row by row."""
    experts = set(_expert_params(module, expert_mesh, plan_fn))
    names, sums, seen = [], [], set()
    for name, p in module.named_parameters():
        if (id(p) in seen or p.is_meta or isinstance(p, DTensor) or name in experts
                or getattr(p, "tensor_model_parallel", False)):
            continue
        if type(p) not in (torch.Tensor, nn.Parameter):  # a tensor subclass (FSDP2's extensions' TwoTensor, ...)
            continue  # whose sum is its own business (no .tolist() on some): not compared
        seen.add(id(p))
        names.append(name)
        sums.append(p.detach().sum(dtype=torch.float64))
    if not sums:
        return ()
    return tuple(zip(names, torch.stack(sums).cpu().tolist()))


def _digest(description: dict) -> str:
    compared = {k: v for k, v in description.items() if k not in ("given", "values")}
    return hashlib.blake2b(repr(compared).encode(), digest_size=16).hexdigest()


def _values_digest(description: Optional[dict]) -> str:
    values = () if description is None else description.get("values", ())
    return hashlib.blake2b(repr(values).encode(), digest_size=16).hexdigest()


def _differing_values(mine: tuple, theirs: tuple) -> list[str]:
    """The names of the parameters whose sums differ between two ranks' ``values`` (NaN sums agree)."""
    return [name for (name, u), (_, v) in zip(mine, theirs) if u != v and not (u != u and v != v)]


# ------------------------------------------------------- naming a difference
_PARAM_FIELDS = ("shape", "dtype", "requires_grad", "tensor-parallel split", "allreduce mark", "tied to")


def _show(value: Any) -> str:
    return repr(value) if not isinstance(value, str) else value


def first_difference(a: dict, b: dict, ra: int, rb: int) -> Optional[str]:
    """The first field where descriptions ``a`` (rank ``ra``) and ``b`` (rank ``rb``) differ, in words."""
    for key, label in _SCALAR_FIELDS:
        if a[key] != b[key] and key == "placements" and a.get("given") != b.get("given"):  # name what was passed
            return (f"{a.get('given')} (placements {a[key]}) on rank {ra} but {b.get('given')} (placements {b[key]}) "
                    f"on rank {rb}")
        if a[key] != b[key]:
            return f"{label}: {_show(a[key])} on rank {ra} but {_show(b[key])} on rank {rb}"
    pa, pb = a["params"], b["params"]
    if pa != pb:
        na, nb = [p[0] for p in pa], [p[0] for p in pb]
        counts = f" ({len(na)} parameters on rank {ra}, {len(nb)} on rank {rb})"
        if na != nb:
            sa, sb = set(na), set(nb)
            for name in na:
                if name not in sb:
                    return f"parameter {name!r} exists on rank {ra} but not on rank {rb}{counts}"
            for name in nb:
                if name not in sa:
                    return f"parameter {name!r} exists on rank {rb} but not on rank {ra}{counts}"
            k = next(i for i, (x, y) in enumerate(zip(na, nb)) if x != y)
            return f"parameters come in another order: #{k} is {na[k]!r} on rank {ra} but {nb[k]!r} on rank {rb}"
        for x, y in zip(pa, pb):
            for field, u, v in zip(_PARAM_FIELDS, x[1:], y[1:]):
                if u != v and field == "tied to":
                    def tie(t):
                        return f"the same tensor as {t!r}" if t else "a tensor of its own"
                    return f"parameter {x[0]!r} is {tie(u)} on rank {ra} but {tie(v)} on rank {rb}"
                if u != v:
                    return f"parameter {x[0]!r} has {field} {_show(u)} on rank {ra} but {_show(v)} on rank {rb}"
    ua, ub = a["units"], b["units"]
    if ua != ub:
        for name in ua:
            if name not in ub:
                return f"module {name!r} is a unit (unit_modules) on rank {ra} but not on rank {rb}"
        for name in ub:
            if name not in ua:
                return f"module {name!r} is a unit (unit_modules) on rank {rb} but not on rank {ra}"
        return f"the units are {list(ua)} on rank {ra} but {list(ub)} on rank {rb}"
    xa, xb = a.get("expert_params", ()), b.get("expert_params", ())
    if xa != xb:
        for name, mine, theirs in [(n, ra, rb) for n in xa if n not in xb] + [(n, rb, ra) for n in xb if n not in xa]:
            return f"parameter {name!r} is on the expert mesh (plan_fn) on rank {mine} but not on rank {theirs}"
    return None


# -------------------------------------------------------------- local checks
def _group_of(module: nn.Module, names: Iterable[str]):
    """``(attr, ranks or None)`` of the first attribute in ``names`` holding a process group or None."""
    own = vars(module)  # instance attributes only: nn.Module.__getattr__ misses are slow
    for name in names:
        if name in own:
            value = own[name]
            if value is None:
                return name, None
            if isinstance(value, dist.ProcessGroup):
                return name, dist.get_process_group_ranks(value)
    return None


def _int_attr(obj: Any, names: Iterable[str]) -> Optional[int]:
    own = vars(obj) if hasattr(obj, "__dict__") else {}
    for name in names:
        value = own.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _axis_row(mesh: DeviceMesh, axis: str, me: int) -> Optional[list[int]]:
    """The ranks along ``axis`` of ``mesh`` that share this rank's other coordinates."""
    dim = list(mesh.mesh_dim_names).index(axis)
    rows = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.mesh.shape[dim])
    for row in rows.tolist():
        if me in row:
            return row
    return None


def _tp_problem(module: nn.Module, mesh: Optional[DeviceMesh], experts: Iterable[str], tp_axis: str, me: int,
                world: int, data_axes: Optional[Iterable[str]]) -> Optional[str]:
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ("dp_shard",)
    if data_axes is None or any(n not in data_axes and n != tp_axis for n in names):
        return None  # invalid placements or an axis neither data- nor model-parallel: fully_shard names it
    mesh_row = _axis_row(mesh, tp_axis, me) if mesh is not None and tp_axis in names else None
    for prefix, sub in module.named_modules():
        # (a DTensor, sharded by an earlier call, carries its own split: checked by that call)
        params = [(n, p) for n, p in sub._parameters.items()
                  if p is not None and getattr(p, "tensor_model_parallel", False) and not isinstance(p, DTensor)]
        params = [(n, p) for n, p in params if (f"{prefix}.{n}" if prefix else n) not in experts]
        if not params:
            continue
        pname = f"{prefix}.{params[0][0]}" if prefix else params[0][0]
        found = _group_of(sub, ("tp_group", "group", "tensor_model_parallel_group"))
        size = len(found[1]) if found is not None and found[1] is not None else 1 if found is not None else None
        if size is None:
            size = _int_attr(sub, ("tp_size", "tensor_model_parallel_size", "tp"))
            config = getattr(sub, "config", None)
            if size is None and config is not None:
                size = _int_attr(config, ("tensor_model_parallel_size",))
        if mesh_row is None:
            if size is not None and size > 1:
                return (
                    f"parameter {pname!r} is a tensor-parallel slice (tensor_model_parallel=True, partition_dim="
                    f"{int(getattr(params[0][1], 'partition_dim', 0))}) of a TP group of {size} ranks, but the mesh "
                    f"axes {list(names)} have no tensor-parallel axis tp_axis={tp_axis!r}: its slices would be "
                    f"averaged as if they were replicas; wrap on a mesh with a {tp_axis!r} axis of {size} ranks "
                    f"(e.g. shardwise.build_dp_mesh(tp={size}))"
                )
            continue
        if found is not None:
            ranks = found[1] if found[1] is not None else [me]
            if ranks != mesh_row:
                return (
                    f"module {prefix or '<root>'!r} was built with tensor-parallel ranks {ranks} (its "
                    f"{found[0]!r}), but the mesh axis {tp_axis!r} has ranks {mesh_row} on rank {me}"
                )
        elif size is not None and size != len(mesh_row):
            return (
                f"module {prefix or '<root>'!r} holds tensor-parallel slices for {size} ranks, but the mesh "
                f"axis {tp_axis!r} has {len(mesh_row)} ranks"
            )
    return None


def _ep_problem(module: nn.Module, mesh, expert_mesh, tp_axis: str, ep_axis: str, me: int, world: int) -> Optional[str]:
    enames = tuple(expert_mesh.mesh_dim_names or ()) if expert_mesh is not None else ()
    ep_row = _axis_row(expert_mesh, ep_axis, me) if ep_axis in enames else None
    if expert_mesh is not None:
        dense = set(_mesh_ranks(mesh, world))
        expert = _mesh_ranks(expert_mesh, world)
        if sorted(expert) != sorted(dense):
            return (
                f"the expert mesh covers ranks {sorted(expert)}, but the mesh covers {sorted(dense)}: "
                "experts must be sharded over the same ranks as the dense parameters"
            )
        if ep_row is not None:
            dense_dp = len(dense)
            if mesh is not None and tp_axis in (mesh.mesh_dim_names or ()):
                dense_dp //= mesh.size(list(mesh.mesh_dim_names).index(tp_axis))
            expert_dp = len(expert) // len(ep_row)
            if tp_axis in enames:  # expert tensor parallelism: its TP axis is no data parallelism
                expert_dp //= expert_mesh.size(enames.index(tp_axis))
            # (more expert than dense data parallelism is right where expert TP is smaller than TP)
            if dense_dp % expert_dp and expert_dp % dense_dp:
                return (
                    f"the expert mesh's data-parallel size {expert_dp} does not divide the dense data-parallel "
                    f"size {dense_dp}, nor the other way round"
                )
    for prefix, sub in module.named_modules():
        where = f"module {prefix or '<root>'!r}"
        total = _int_attr(sub, ("num_experts", "num_moe_experts"))
        local = _int_attr(sub, ("num_local_experts",)) or (_int_attr(sub, ("local",)) if total else None)
        group = _group_of(sub, ("ep_group", "expert_parallel_group"))
        ep = None
        if total and local and total % local == 0:
            ep, what = total // local, f"holds {local} of {total} experts per rank"
        elif group is not None and group[1] is not None and len(group[1]) > 1:
            ep, what = len(group[1]), f"was built with expert-parallel ranks {group[1]} (its {group[0]!r})"
        if ep is None:
            continue
        if expert_mesh is None:
            if ep > 1:
                return (
                    f"{where} {what} (expert parallelism over {ep} ranks), but no expert_mesh was given: "
                    f"the experts of different ranks would be averaged as if they were replicas; pass "
                    f"expert_mesh=shardwise.build_expert_mesh({ep})"
                )
            continue
        if ep_row is None:
            continue  # fully_shard names the missing ep axis itself
        if ep != len(ep_row):
            return (
                f"{where} {what} (expert parallelism over {ep} ranks), but the expert mesh axis {ep_axis!r} has "
                f"{len(ep_row)} rank{'s' if len(ep_row) > 1 else ''}"
            )
        if group is not None and group[1] is not None and group[1] != ep_row:
            return (
                f"{where} was built with expert-parallel ranks {group[1]} (its {group[0]!r}), but the expert "
                f"mesh axis {ep_axis!r} has ranks {ep_row} on rank {me}"
            )
    return None


def _local_problem(module, mesh, expert_mesh, tp_axis, ep_axis, me, world, data_axes, experts=()) -> Optional[str]:
    for m, what in ((mesh, "mesh"), (expert_mesh, "expert mesh")):
        if m is not None and me not in _mesh_ranks(m, world):
            return f"rank {me} is not in the {what} {m.mesh.tolist()}"
    return _tp_problem(module, mesh, set(experts), tp_axis, me, world, data_axes) or _ep_problem(
        module, mesh, expert_mesh, tp_axis, ep_axis, me, world
    )


# ---------------------------------------------------------------- the check
class _NotAMesh(TypeError):
    pass


def _check_mesh_types(**meshes) -> None:
    """Name a mesh argument that is not a DeviceMesh (``mesh="dp"``), before anything reads its attributes."""
    for name, value in meshes.items():
        if value is not None and not isinstance(value, DeviceMesh):
            raise _NotAMesh(
                f"{name}={value!r} must be a torch.distributed.DeviceMesh or None (e.g. shardwise.build_dp_mesh() "
                f"or shardwise.build_expert_mesh(ep)), got a {type(value).__name__}")


def check_rank_consistency(module: nn.Module, options: FullyShardOptions) -> tuple[str, ...]:
    """Raise ``ValueError`` on every rank unless all ranks of each mesh wrap the same thing; the names of
    the parameters (in ``module``) whose values differ across the ranks of this rank's mesh.

    Takes ``fully_shard``'s options, unresolved (``mesh=None`` is the
    default data-parallel mesh over all ranks; ``placements`` or
    ``strategy``/``outer_dp_sharding_strategy``; unit classes or instances;
    ``FullyShardOptions.must_agree`` the rest that must agree); ``plan_fn`` picks the
    expert parameters (with an expert mesh: TP slices among them are not checked
    against the dense mesh). A collective over the default group: every rank must call
    it, before any parameter is sharded. Ranks are compared with the ranks of
    their own mesh (pipeline stages may wrap different models).
    """
    me, world = _world()
    description, problem = None, None
    mesh, expert_mesh, plan_fn = options.mesh, options.expert_mesh, options.plan_fn
    try:  # never raise before the exchange: a rank that stops here would strand the others
        _check_mesh_types(mesh=mesh, expert_mesh=expert_mesh)
        description = describe(module, options)
        resolved = _resolve(options)
        data_axes = None if resolved is None else list(resolved)
        problem = _local_problem(module, mesh, expert_mesh, options.tp_axis, options.ep_axis, me, world, data_axes,
                                 description["expert_params"])
        if problem is None and expert_mesh is not None and not description["expert_params"] and (
                plan_fn is None or callable(plan_fn)):
            problem = (
                "an expert_mesh was given, but plan_fn puts no parameter on it (the default, experts_by_mark, "
                "takes the parameters marked allreduce=False); pass plan_fn=... to say which are experts"
            )
        peers = tuple(sorted(_mesh_ranks(mesh, world)))
    except _NotAMesh as err:
        problem, peers = str(err), tuple(range(world))
    except Exception as err:  # noqa: BLE001 - reported on every rank below
        problem = f"rank {me} could not describe its model and arguments: {type(err).__name__}: {err}"
        peers = tuple(range(world))
    digest = _digest(description) if description is not None else "none"
    if world == 1:
        if problem:
            raise ValueError(problem)
        return ()
    gathered = _all_gather((digest, peers, problem, _values_digest(description)))
    # Every rank reads the same list: the same verdict, the same (second) exchange, the same message.
    # Each distinct mesh once, keyed by the first rank that reported it (the rank a refusal names): ranks
    # reporting equal meshes agree or disagree alike, and comparing every rank's mesh with each of its members'
    # took world^3 steps (20 s a call at 1,024 ranks; the planner wraps a model per candidate and depth).
    meshes: dict[tuple, int] = {}
    for r, (_, ranks, _, _) in enumerate(gathered):
        meshes.setdefault(ranks, r)
    for ranks, r in meshes.items():
        for s in ranks:
            if 0 <= s < world and gathered[s][1] != ranks:
                raise ValueError(
                    f"{_PREFIX}the mesh covers ranks {list(ranks)} on rank {r} but {list(gathered[s][1])} on rank {s}"
                )
    failing = [r for r, g in enumerate(gathered) if g[2]]
    where = f"ranks {failing}" if len(failing) > 1 else f"rank {failing[0]}" if failing else ""
    local = f"{gathered[failing[0]][2]} (on {where})" if failing else None
    pairs = []  # (reference rank, differing ranks) for every mesh whose digests disagree
    for ranks in sorted(meshes):
        ref = ranks[0]
        differ = [s for s in ranks if gathered[s][0] != gathered[ref][0]]
        if differ:
            pairs.append((ref, differ))
    if pairs:
        descriptions = _all_gather(description)
        ref, differ = pairs[0]
        detail = None
        if descriptions[ref] is not None and descriptions[differ[0]] is not None:
            detail = first_difference(descriptions[ref], descriptions[differ[0]], ref, differ[0])
        if detail is None:
            detail = local or f"rank {differ[0]} differs from rank {ref}"
        elif local:
            detail = f"{detail}; and {local}"
        who = f"ranks {differ} differ" if len(differ) > 1 else f"rank {differ[0]} differs"
        raise ValueError(
            f"{_PREFIX}{detail} ({who} from rank {ref}; every rank of a mesh must build the same model and pass "
            "fully_shard the same arguments)"
        )
    if local:
        raise ValueError(local)
    # Values: not a refusal (see the module docstring); the same verdict on every rank decides the exchange.
    if all(gathered[s][3] == gathered[ranks[0]][3] for ranks in meshes for s in ranks):
        return ()
    values = _all_gather(description["values"])
    return tuple(sorted({name for s in peers if s != peers[0]
                         for name in _differing_values(values[peers[0]], values[s])},
                        key=[n for n, _ in values[peers[0]]].index))
