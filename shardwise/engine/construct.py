"""The steps ``fully_shard`` is made of: check, plan, build the groups unit by unit, attach.

``fully_shard`` (in ``fully_shard.py``) reads as the recipe; each step is here.
Every check runs before anything is sharded, in this order: the module and
the mixed-precision policy, the rank-consistency collective (in
``consistency.py``), the option types, the placements and plans, the bucket
size, the units, the parameters. Then groups are built deepest unit first
(materializing meta parameters just before), buffers move to the device, and
the hooks are attached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from .collectives import Collectives, StreamSet
from .fully_shard_options import FullyShardOptions
from .param_group import SHARDED_MARK, ParamGroup, ParamRef
from .sharded_state import ShardedState
from .mesh import EXPERT, PLAN_CHOICES, ShardingPlan, build_dp_mesh, experts_by_mark, fold_context_parallel, named_mesh
from .offload import OffloadPolicy
from .placements import normalize_placements, resolve_axis_placements
from .precision import MixedPrecisionPolicy, from_torch_policy
from .quantized_gather import gather_mark
from .replaced_params import is_replaced
from .unit import Unit, UnitSettings
from .sharded_module import STATE_ATTR

__all__ = [
    "check_call",
    "adopt_units",
    "taken_modules",
    "unit_settings",
    "check_modules",
    "resolve_policy",
    "resolve_offload",
    "check_options",
    "build_plans",
    "check_bucket_size",
    "resolve_units",
    "check_parameters",
    "Ownership",
    "GroupBuilder",
    "build_units",
    "move_buffers",
    "register_hooks",
]

_FLOATING = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ------------------------------------------------------------------ checks
def check_call(module, dp_mesh_dims, unit_modules) -> list[nn.Module]:
    """The modules of this call (one, or FSDP2's list); what ``fully_shard`` refuses before looking at them."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fully_shard(dp_mesh_dims=...) (a full SPMD mesh with DTensor parameters) is not built: pass the "
            "data-parallel sub-mesh, mesh=spmd_mesh[dims], and the model's own parameters")
    if len(modules) > 1 and unit_modules is not None:
        raise ValueError("unit_modules= takes one module, not a list: call fully_shard on each unit instead")
    return modules


def check_modules(modules: list[nn.Module], state_attr: str = STATE_ATTR) -> list:
    """Refuse what ``fully_shard`` cannot take: a non-module, the same module twice, a module already a unit,
    a subtree already adopted by an ancestor's call (FSDP2 is applied bottom-up). The states of the units
    inside the modules (earlier calls on submodules), which this call adopts."""
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"module must be an nn.Module or a list of them, got {type(m).__name__}")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError(f"fully_shard got the same module twice in {[type(m).__name__ for m in modules]}")
    adopted: dict[int, object] = {}
    for m in modules:
        if hasattr(m, state_attr):
            raise ValueError(f"module {type(m).__name__} is already sharded by shardwise.fully_shard (one unit "
                             "per module: call fully_shard once on it)")
        for name, sub in m.named_modules():
            state = sub.__dict__.get(state_attr)
            if state is None:
                continue
            if not any(sub is x for x in state.root.modules):
                raise ValueError(
                    f"submodule {name!r} ({type(sub).__name__}) was already taken in by the fully_shard call on "
                    f"{state.root.module.__class__.__name__}: call fully_shard bottom-up, the inner modules first")
            adopted[id(state)] = state
    mine = {id(p) for state in adopted.values() for g in state.groups for p in g.sharded_params}
    for m in modules:
        for name, p in m.named_parameters():
            if getattr(p, SHARDED_MARK, False) and id(p) not in mine:
                raise ValueError(
                    f"parameter {name!r} of {type(m).__name__} is already sharded, by the fully_shard call on an "
                    "ancestor: call fully_shard bottom-up, the inner modules first")
    return list(adopted.values())


def resolve_policy(mp_policy, mixed_precision) -> MixedPrecisionPolicy:
    """The engine's policy from ``mp_policy`` (torch's or shardwise's class) or ``mixed_precision`` (shardwise's)."""
    if mp_policy is not None and mixed_precision is not None:
        raise ValueError("pass mp_policy= (FSDP2's name) or mixed_precision=, not both")
    policy = mp_policy if mp_policy is not None else mixed_precision
    if policy is None or isinstance(policy, MixedPrecisionPolicy):
        return policy or MixedPrecisionPolicy()
    if isinstance(policy, TorchMixedPrecisionPolicy):
        return from_torch_policy(policy)
    raise TypeError(f"mp_policy must be a MixedPrecisionPolicy (torch.distributed.fsdp's or shardwise's), "
                    f"got {type(policy).__name__}")


def resolve_offload(offload_policy) -> OffloadPolicy | None:
    """shardwise's ``OffloadPolicy`` from torch's (``OffloadPolicy()``: none; ``CPUOffloadPolicy``: everything)."""
    if offload_policy is None or isinstance(offload_policy, OffloadPolicy):
        return offload_policy
    if isinstance(offload_policy, TorchCPUOffloadPolicy):
        return OffloadPolicy(fraction=1.0, pin_memory=offload_policy.pin_memory)
    if isinstance(offload_policy, TorchOffloadPolicy):
        return None
    raise TypeError(f"offload_policy must be an OffloadPolicy (torch.distributed.fsdp's or shardwise's) or None, "
                    f"got {type(offload_policy).__name__}")


def _check_argument_types(**arguments) -> None:
    """Refuse values of the wrong type (``reshard_after_forward="no"`` is truthy)."""
    for name, (value, kind) in arguments.items():
        if not isinstance(value, kind):
            raise TypeError(f"{name}={value!r} must be a {kind.__name__}")


def check_options(options: FullyShardOptions) -> Callable:
    """Refuse options of the wrong type; the ``plan_fn`` to use (``experts_by_mark`` by default)."""
    reshard = options.reshard_after_forward
    if reshard is not None and not isinstance(reshard, bool):
        if isinstance(reshard, int):
            raise NotImplementedError(
                f"reshard_after_forward={reshard} (an int: reshard to a smaller group of ranks after forward) is "
                "not built; pass True (free after forward), False (keep until backward) or None (FSDP2's default)")
        raise TypeError(f"reshard_after_forward={reshard!r} must be a bool, None or an int")
    shard_placement_fn, ignored = options.shard_placement_fn, options.ignored_params
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError(f"shard_placement_fn={shard_placement_fn!r} must be a callable (param) -> Shard or None")
    if ignored is not None and not all(isinstance(p, torch.Tensor) for p in ignored):
        raise TypeError("ignored_params must be a set of the module's parameters")
    _check_argument_types(
        sync_module_states=(options.sync_module_states, bool),
        prefetch=(options.prefetch, bool),
        gradient_reduction=(options.gradient_reduction, str),
        tp_axis=(options.tp_axis, str),
        ep_axis=(options.ep_axis, str),
    )
    collectives = options.collectives
    init_fn, plan_fn = options.init_fn, options.plan_fn
    if collectives is not None and not isinstance(collectives, Collectives):
        raise TypeError(f"collectives must be a shardwise.Collectives or None, got {type(collectives).__name__}")
    if init_fn is not None and not callable(init_fn):
        raise TypeError(f"init_fn={init_fn!r} must be a callable (module, device) or None")
    if plan_fn is not None and not callable(plan_fn):
        raise TypeError(f"plan_fn={plan_fn!r} must be a callable (fqn, param) -> {' or '.join(map(repr, PLAN_CHOICES))}")
    return plan_fn or experts_by_mark


def check_bucket_size(bucket_size: int | None) -> None:
    if bucket_size is not None and (isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1):
        raise ValueError(f"bucket_size={bucket_size!r} must be a positive number of elements")


def check_parameters(root: nn.Module, init_fn: Callable | None) -> None:
    """Refuse parameters shardwise cannot shard, and meta parameters with nothing to materialize them."""
    for name, p in root.named_parameters():
        if isinstance(p, DTensor):  # sharded by an earlier fully_shard call on a submodule
            continue
        if p.dtype not in _FLOATING:
            raise ValueError(
                f"parameter {name!r} has dtype {p.dtype}, which shardwise cannot shard; "
                f"supported parameter dtypes are {[str(d) for d in _FLOATING]}"
            )
        if p.dim() == 0:
            raise ValueError(
                f"parameter {name!r} is 0-dimensional; shardwise shards along dim 0, so store it with shape (1,)"
            )
    # Meta parameters without an init_fn stay on the meta device, sharded: model.to_empty(device=...) and the
    # model's own initialisation then fill the shards (FSDP2's flow).


# ------------------------------------------------------------------ plans
def build_plans(options: FullyShardOptions) -> tuple[ShardingPlan, ShardingPlan | None]:
    """The dense plan (over ``mesh``, built when ``None``) and the expert plan (with an ``expert_mesh``),
    their gradients scaled for ``gradient_reduction``."""
    tp_axis, ep_axis, gradient_reduction = options.tp_axis, options.ep_axis, options.gradient_reduction
    expert_mesh, expert_placements = options.expert_mesh, options.expert_placements
    mesh, placements = resolve_placements(options.mesh, options.placements, options.strategy,
                                          options.outer_dp_sharding_strategy, (tp_axis, ep_axis))
    names = mesh.mesh_dim_names or ()
    plan = ShardingPlan(mesh, placements, model_parallel_axes=[tp_axis] if tp_axis in names else [])
    expert_plan = _expert_plan(plan, placements, expert_mesh, expert_placements, ep_axis)
    if gradient_reduction not in ("mean", "sum"):
        raise ValueError(f"gradient_reduction={gradient_reduction!r} must be 'mean' or 'sum'")
    if gradient_reduction == "sum":  # e.g. per-token losses normalized after the reduction
        for p in (plan, expert_plan):
            if p is not None:
                p.grad_scale *= plan.dp_size
    return plan, expert_plan


# ------------------------------------------------------------------ placements, units, parameters
def resolve_placements(mesh, placements, strategy, outer_dp_sharding_strategy,
                       model_parallel_axes: tuple = ("tp",)) -> tuple[DeviceMesh, dict]:
    """The mesh (FSDP2's unnamed meshes named, the default one built) and each data-parallel axis's placements
    (``placements.resolve_axis_placements``)."""
    if mesh is not None:
        mesh = named_mesh(mesh)
    placements = resolve_axis_placements(None if mesh is None else mesh.mesh_dim_names, placements, strategy,
                                         outer_dp_sharding_strategy, model_parallel_axes)
    if mesh is None:
        if list(placements) != ["dp_shard"]:
            raise ValueError(f"placements name axes {list(placements)}; pass a mesh that has them")
        mesh = build_dp_mesh()
    return _fold_context_parallel(mesh, placements)


def _fold_context_parallel(mesh: DeviceMesh, placements: dict) -> tuple[DeviceMesh, dict]:
    """A mesh with a ``cp`` axis shards over ``dp_shard`` x ``cp`` as one axis; ``dp_shard``'s placements
    are that axis's."""
    folded = fold_context_parallel(mesh)
    if folded is mesh:
        return mesh, placements
    if "cp" in placements:
        raise ValueError(f"placements name the context-parallel axis 'cp' ({placements['cp']}); it is folded into "
                         "'dp_shard' and sharded with it: give 'dp_shard' the placements")
    inner = next(n for n in folded.mesh_dim_names if n not in mesh.mesh_dim_names)
    return folded, {inner if axis == "dp_shard" else axis: p for axis, p in placements.items()}


def resolve_units(root: nn.Module, unit_modules) -> list[nn.Module]:
    if unit_modules is None:
        return []
    if isinstance(unit_modules, type) or isinstance(unit_modules, nn.Module):
        unit_modules = [unit_modules]
    all_modules = list(root.modules())
    ids = {id(m) for m in all_modules}
    chosen: dict[int, nn.Module] = {}
    for spec in unit_modules:
        if isinstance(spec, type):
            if not issubclass(spec, nn.Module):
                raise TypeError(f"unit_modules entry {spec!r} is not an nn.Module class")
            found = [m for m in all_modules if isinstance(m, spec) and m is not root]
            if not found:
                raise ValueError(
                    f"unit_modules names {spec.__name__}, but {type(root).__name__} contains no "
                    f"{spec.__name__} module"
                )
        elif isinstance(spec, nn.Module):
            if id(spec) not in ids or spec is root:
                raise ValueError(f"unit_modules entry {type(spec).__name__} is not a submodule of the model")
            found = [spec]
        else:
            raise TypeError(f"unit_modules entry {spec!r} must be an nn.Module class or instance")
        for m in found:
            chosen[id(m)] = m
    return [m for m in all_modules if id(m) in chosen]  # module order


def _owners(roots: list[nn.Module], units: list[nn.Module], taken: set[int], ignored: set[int]) -> tuple[dict, dict]:
    """Map each (module, attr) holding a parameter to its owning unit module (``roots[0]``, this call's own
    unit, when shared). Modules in ``taken`` (units of earlier calls) and parameters in ``ignored`` are left out."""
    root = roots[0]
    unit_ids = {id(u) for u in units}
    holder_owner: dict[tuple[int, str], nn.Module] = {}
    holder_obj: dict[tuple[int, str], tuple[nn.Module, str, str]] = {}
    param_owners: dict[int, set[int]] = {}

    def visit(module: nn.Module, prefix: str, owner: nn.Module, stack: tuple) -> None:
        if id(module) in stack or id(module) in taken:
            return
        for attr, p in module._parameters.items():
            if p is None or id(p) in ignored:
                continue
            key = (id(module), attr)
            holder_obj.setdefault(key, (module, attr, f"{prefix}{attr}"))
            previous = holder_owner.get(key)
            holder_owner[key] = owner if previous is None or previous is owner else root
            param_owners.setdefault(id(p), set()).add(id(holder_owner[key]))
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.", child if id(child) in unit_ids else owner, stack + (id(module),))

    for i, r in enumerate(roots):
        visit(r, f"{i}." if len(roots) > 1 else "", root, ())
    for key, (module, attr, _) in holder_obj.items():
        p = module._parameters[attr]
        if len(param_owners[id(p)]) > 1:  # tied across units: the root gathers it for the whole step
            holder_owner[key] = root
    return holder_owner, holder_obj


def _expert_plan(plan, placements, expert_mesh, expert_placements, ep_axis) -> ShardingPlan | None:
    if expert_mesh is None:
        return None
    names = expert_mesh.mesh_dim_names or ()
    if ep_axis not in names:
        raise ValueError(f"expert_mesh axes {list(names)} have no expert-parallel axis ep_axis={ep_axis!r}")
    if expert_placements is None:
        missing = [n for n in names if n != ep_axis and n not in placements]
        if missing:
            raise ValueError(
                f"expert_mesh axes {missing} have no placements; pass expert_placements= for them"
            )
        expert_placements = {n: placements[n] for n in names if n != ep_axis}
    else:
        expert_placements = normalize_placements(expert_placements)
    expert = ShardingPlan(expert_mesh, expert_placements, model_parallel_axes=[ep_axis])
    # Every expert replica sees only its expert-data-parallel peers' tokens through the
    # all-to-all; averaging over them and scaling by edp/dp averages over the global batch.
    expert.grad_scale = expert.dp_size / plan.dp_size
    return expert


def _plan_choice(plan_fn: Callable, fqn: str, param: torch.Tensor) -> str:
    """``plan_fn(fqn, param)``, checked to be one of ``PLAN_CHOICES``."""
    choice = plan_fn(fqn, param)
    if not isinstance(choice, str) or choice not in PLAN_CHOICES:
        raise ValueError(f"plan_fn returned {choice!r} for parameter {fqn!r}; it must return one of {list(PLAN_CHOICES)}")
    return choice


def _place_model_parallel(
    ref: ParamRef, plan: ShardingPlan, expert_plan, tp_axis: str, ep_axis: str, plan_fn: Callable = experts_by_mark
) -> ShardingPlan:
    """Choose the plan a parameter is sharded by (``plan_fn``, with an expert plan) and record its
    model-parallel dimensions."""
    is_expert = expert_plan is not None and _plan_choice(plan_fn, ref.fqn, ref.param) == EXPERT
    target = expert_plan if is_expert else plan
    if target is expert_plan:
        ref.model_parallel_dims[ep_axis] = 0  # experts are stacked along dim 0
    if getattr(ref.param, "tensor_model_parallel", False):
        if tp_axis in target.model_parallel:
            dim = int(getattr(ref.param, "partition_dim", 0))
            ref.model_parallel_dims[tp_axis] = dim
        elif is_expert:
            ranks = _holders_tp_ranks(ref)
            if ranks != 1:  # a slice over one rank (Megatron's experts at expert TP 1) is the whole expert
                held = "of an unknown TP group (no tp_group on its module)" if ranks is None else f"over {ranks} ranks"
                raise ValueError(
                    f"parameter {ref.fqn!r} is an expert's tensor-parallel slice (tensor_model_parallel=True, "
                    f"{held}), but expert tensor parallelism (TP inside the expert mesh) is not built yet: keep "
                    "each expert whole on its expert-parallel rank (expert TP 1)"
                )
    return target


def _holders_tp_ranks(ref: ParamRef) -> int | None:
    """How many ranks the TP group of the modules holding ``ref`` has (their ``tp_group``; None is one
    rank, as shardwise's layers read it), or None when no holder says."""
    sizes = set()
    for module, _ in ref.holders:
        own = vars(module)
        if "tp_group" in own:
            group = own["tp_group"]
            sizes.add(1 if group is None else dist.get_world_size(group))
    return sizes.pop() if len(sizes) == 1 else None


def _split(refs: list[ParamRef], limit: int) -> list[list[ParamRef]]:
    """Consecutive runs of parameters with at most ``limit`` elements each (a bigger one alone)."""
    chunks, current, size = [], [], 0
    for ref in refs:
        n = ref.param.numel()
        if current and size + n > limit:
            chunks.append(current)
            current, size = [], 0
        current.append(ref)
        size += n
    if current:
        chunks.append(current)
    return chunks


def _sync_from_first_rank(param: torch.Tensor, group, device: torch.device) -> None:
    """Make a TP-replicated parameter identical across its TP group (rank 0's values)."""
    with torch.no_grad():
        value = param.detach().to(device)
        dist.broadcast(value, src=dist.get_global_rank(group, 0), group=group)
        param.copy_(value.to(param.device))


# ------------------------------------------------------------------ groups
class Ownership:
    """Which unit (module) owns each ``(module, attr)`` that holds a parameter: the innermost unit
    around it, this call's own unit (``root``, its first module) for what no unit holds and for parameters
    tied across units. Units of earlier calls (``taken``) and ``ignored`` parameters belong to no one here."""

    def __init__(self, roots: nn.Module | list[nn.Module], units: list[nn.Module], taken: set[int] = frozenset(),
                 ignored: set[int] = frozenset()):
        self.roots = list(roots) if isinstance(roots, (list, tuple)) else [roots]
        self.root, self.units = self.roots[0], units
        self.holder_owner, self.holder_obj = _owners(self.roots, units, set(taken), set(ignored))
        self.names = {}
        for i, r in enumerate(self.roots):
            prefix = f"{i}." if len(self.roots) > 1 else ""
            self.names.update({id(m): f"{prefix}{n}".rstrip(".") for n, m in r.named_modules()})

    def sizes(self) -> list[tuple[str, nn.Module, int]]:
        """``(name, module, parameter count)`` of each unit in order, then the root (for the offload choice)."""
        owners = self.units + [self.root]
        owned = {id(m): 0 for m in owners}
        for key, (holder, attr, _) in self.holder_obj.items():
            owned[id(self.holder_owner[key])] += holder._parameters[attr].numel()
        return [(self.names[id(m)], m, owned[id(m)]) for m in owners]

    def refs(self, owner: nn.Module) -> list[ParamRef]:
        """The parameters ``owner`` owns, each once, with every place that holds it."""
        refs: dict[int, ParamRef] = {}
        for key, (holder, attr, fqn) in self.holder_obj.items():
            if self.holder_owner[key] is not owner:
                continue
            p = holder._parameters[attr]
            if is_replaced(p, "fully_shard"):
                raise ValueError(
                    f"parameter {fqn!r} is tied to a parameter that an earlier fully_shard call already sharded "
                    "(in another unit): put the modules that share it in one call, fully_shard([a, b])")
            ref = refs.get(id(p))
            if ref is None:
                refs[id(p)] = ParamRef(fqn, p, [(holder, attr)])
            else:
                ref.holders.append((holder, attr))
        return list(refs.values())


@dataclass
class GroupBuilder:
    """Everything the groups of one owner are built from; :meth:`build_groups` builds them."""

    ownership: Ownership
    plan: ShardingPlan
    expert_plan: ShardingPlan | None
    policy: MixedPrecisionPolicy
    device: torch.device
    streams: StreamSet
    init_fn: Callable | None
    plan_fn: Callable
    tp_axis: str
    ep_axis: str
    bucket_size: int | None
    offloaded: set[int]
    pin_memory: bool
    collectives: Collectives | None = None
    shard_placement_fn: Callable | None = None
    sync_module_states: bool = False

    def build_groups(self, owner: nn.Module) -> list[ParamGroup]:
        """Materialize ``owner``'s meta parameters, then shard what it owns: one group per plan, dtype,
        requires_grad and sequence-parallel flag (the root's split into buckets of ``bucket_size``)."""
        if self.init_fn is not None and any(p.is_meta for p in owner.parameters()):
            self.init_fn(owner, self.device)
        return [self._group(owner, key, bucket) for key, bucket in self._buckets(owner).items()]

    def _buckets(self, owner: nn.Module) -> dict[tuple, list[ParamRef]]:
        tp_axis = self.tp_axis
        buckets: dict[tuple, list[ParamRef]] = {}
        for ref in self.ownership.refs(owner):
            if self.shard_placement_fn is not None:
                _check_shard_placement(ref, self.shard_placement_fn(ref.param))
            ref_plan = _place_model_parallel(ref, self.plan, self.expert_plan, tp_axis, self.ep_axis, self.plan_fn)
            if self.sync_module_states and not ref.param.is_meta:
                _broadcast_from_first_replica(ref.param, ref_plan, self.device)
            sequence_parallel = bool(getattr(ref.param, "sequence_parallel", False)) and tp_axis in ref_plan.model_parallel
            mark = gather_mark(ref.param)  # an FP8 gather: its own group (uint8 slots, its own scales)
            key = (id(ref_plan), ref.param.dtype, ref.param.requires_grad, sequence_parallel,
                   None if mark is None else mark.kind)
            buckets.setdefault(key, []).append(ref)
            if tp_axis in ref_plan.model_parallel and tp_axis not in ref.model_parallel_dims and not ref.param.is_meta:
                _sync_from_first_rank(ref.param, ref_plan.model_parallel[tp_axis].group, self.device)
        if owner is self.ownership.root and self.bucket_size is not None:  # split what no unit owns into buckets
            buckets = {
                key + (i,): chunk
                for key, bucket in buckets.items()
                for i, chunk in enumerate(_split(bucket, self.bucket_size))
            }
        return buckets

    def _group(self, owner: nn.Module, key: tuple, bucket: list[ParamRef]) -> ParamGroup:
        plan_id, dtype, rg, sequence_parallel, gather_kind, *_ = key
        expert_plan = self.expert_plan
        ref_plan = expert_plan if expert_plan is not None and plan_id == id(expert_plan) else self.plan
        kind = (("" if rg else ",frozen") + (",experts" if ref_plan is not self.plan else "")
                + (",fp8" if gather_kind else ""))
        label = f"{self.ownership.names.get(id(owner), '') or '<root>'}[{str(dtype).replace('torch.', '')}{kind}]"
        sum_axes = [ref_plan.model_parallel[self.tp_axis]] if sequence_parallel else []
        # Meta parameters are sharded on the meta device; model.to_empty() gives the shards storage later.
        on_meta = any(ref.param.is_meta for ref in bucket)
        group = ParamGroup(
            label, bucket, ref_plan, self.policy, torch.device("meta") if on_meta else self.device, self.streams,
            sum_over_axes=sum_axes, offload=id(owner) in self.offloaded, pin_memory=self.pin_memory,
            collectives=self.collectives, target_device=self.device,
        )
        group.install_sharded_params()  # the modules now hold DTensors; the full tensors can go
        return group


def unit_settings(options: FullyShardOptions) -> Callable[[], UnitSettings]:
    """A fresh ``UnitSettings`` per unit of this call, from its options."""
    # Graph-safe mode holds every gathered buffer at rest anyway: a reshard after forward would free nothing
    # and only make backward gather the same weights again.
    reshard = False if options.graph_safe else options.reshard_after_forward
    return lambda: UnitSettings(reshard_after_forward=reshard, policy=options.mixed_precision)


def build_units(
    roots: list[nn.Module], unit_modules: list[nn.Module], build_groups: Callable, settings: Callable[[], UnitSettings]
) -> tuple[list[Unit], Unit]:
    """The units of ``unit_modules`` (in that order) and this call's own unit (``roots``), built deepest first,
    so an outer unit (and this call's own, last) only sees what inner ones left."""
    names = {id(m): n for n, m in roots[0].named_modules()}
    depth = {id(m): n.count(".") + 1 for n, m in roots[0].named_modules()}
    built = {}
    for u in sorted(unit_modules, key=lambda m: -depth[id(m)]):
        unit_settings_ = settings()
        built[id(u)] = Unit(names[id(u)], u, build_groups(u), unit_settings_.reshard_after_forward, unit_settings_)
    units = [built[id(u)] for u in unit_modules]
    own = settings()
    return units, Unit("", roots, build_groups(roots[0]), own.reshard_after_forward, own)


def taken_modules(adopted: list) -> set[int]:
    """The modules of the units earlier calls made (``adopted`` states): no parameter of theirs is this call's."""
    return {id(m) for state in adopted for unit in state.all_units for m in unit.modules}


def adopt_units(root: nn.Module, adopted: list, new_units: list[Unit]) -> list[Unit]:
    """Every unit of the model this call's ``root`` now heads: the adopted states' (their root hooks removed)
    and this call's, in ``root``'s module order, each named (and its groups labelled) by its path from ``root``."""
    for state in adopted:
        for handle in state.hook_handles:
            handle.remove()
    units = [u for state in adopted for u in state.all_units] + new_units
    names, order = {}, {}
    for i, (name, m) in enumerate(root.named_modules()):
        names[id(m)], order[id(m)] = name, i
    for unit in units:
        unit.name = names.get(id(unit.module)) or unit.name
        for group in unit.groups:  # built when the unit was its own root: label it by its place in the model
            if group.name.startswith("<root>["):
                group.name = unit.name + group.name[len("<root>"):]
    return sorted(units, key=lambda u: order.get(id(u.module), len(order)))


def _check_shard_placement(ref: ParamRef, placement) -> None:
    """``shard_placement_fn``'s answer for one parameter: ``None`` or ``Shard(0)`` are built."""
    if placement is None or (isinstance(placement, Shard) and placement.dim in (0, -ref.param.dim())):
        return
    if isinstance(placement, Shard):
        raise NotImplementedError(
            f"shard_placement_fn returned {placement!r} for parameter {ref.fqn!r}: shardwise shards dim 0 only "
            "(Shard(0)); a Shard(dim > 0) layout is not built. Return None or Shard(0), or store the parameter "
            "with the split dimension first")
    raise NotImplementedError(
        f"shard_placement_fn returned {placement!r} for parameter {ref.fqn!r}: a per-parameter mesh is not built "
        "through shard_placement_fn; give experts their mesh with fully_shard(..., expert_mesh=..., plan_fn=...)")


def _broadcast_from_first_replica(param: torch.Tensor, plan: ShardingPlan, device: torch.device) -> None:
    """``sync_module_states=True``: every data-parallel rank takes the first rank's values of ``param``."""
    with torch.no_grad():
        value = param.detach().to(device)
        for axis in plan.axes.values():
            if axis.size > 1:
                dist.broadcast(value, src=dist.get_global_rank(axis.group, 0), group=axis.group)
        param.copy_(value.to(param.device))


def move_buffers(root: nn.Module, device: torch.device) -> None:
    """Move every (non-meta) buffer to the device the groups live on."""
    for m in root.modules():
        for key, buf in m._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:
                m._buffers[key] = buf.to(device)


def register_hooks(state: ShardedState) -> None:
    """The root's and each unit's forward hooks on each of their modules, and the load-state-dict hook that
    takes loaded values in; their handles are kept in ``state.hook_handles`` (an adopting call removes them)."""
    handles = state.hook_handles
    for module in state.root.modules:
        handles.append(module.register_forward_pre_hook(state.root_pre_forward, with_kwargs=True, prepend=True))
        handles.append(module.register_forward_hook(state.root_post_forward))
        handles.append(module.register_load_state_dict_post_hook(lambda m, keys: state.after_load_state_dict()))
    for unit in state.units:
        for module in unit.modules:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, unit=unit: state.unit_pre_forward(unit, m, a, k), with_kwargs=True, prepend=True))
            handles.append(module.register_forward_hook(
                lambda m, a, o, unit=unit: state.unit_post_forward(unit, m, a, o)))
