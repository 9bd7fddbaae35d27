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

from .collectives import Collectives, StreamSet
from .fully_shard_options import FullyShardOptions
from .param_group import ParamGroup, ParamRef
from .sharded_state import ShardedState
from .mesh import DENSE, EXPERT, EXPERT_CHOICES, PLAN_CHOICES, ShardingPlan, build_dp_mesh, experts_by_mark, fold_context_parallel
from .offload import OffloadPolicy
from .placements import normalize_placements, strategy_placements
from .precision import MixedPrecisionPolicy
from .quantized_gather import gather_mark
from .unit import Unit

__all__ = [
    "check_module",
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
def check_module(module: nn.Module, mixed_precision: MixedPrecisionPolicy | None, state_attr: str) -> MixedPrecisionPolicy:
    """Refuse a non-module, a module (or submodule) already sharded (it holds ``state_attr``), a wrong
    policy; the policy to use."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    sharded = [(name, m) for name, m in module.named_modules() if hasattr(m, state_attr)]
    if sharded and sharded[0][0] == "":
        raise ValueError(f"module ({type(module).__name__}) is already sharded by shardwise.fully_shard")
    if sharded:  # FSDP2's idiom, fully_shard on each layer and then on the root: here one call does both
        classes = list(dict.fromkeys(_unsharded_class(m).__name__ for _, m in sharded))
        raise ValueError(
            f"submodule {sharded[0][0]!r} ({_unsharded_class(sharded[0][1]).__name__}) is already sharded by "
            f"shardwise.fully_shard: shardwise shards a model in one call, its layers as units. Instead of "
            f"fully_shard on each layer and then on the model, call fully_shard(model, unit_modules=["
            f"{', '.join(classes)}]) once, on the model before any layer was sharded")
    policy = mixed_precision or MixedPrecisionPolicy()
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"mixed_precision must be a MixedPrecisionPolicy, got {type(policy).__name__}")
    return policy


def _unsharded_class(module: nn.Module) -> type:
    """The module's own class (``fully_shard`` makes it a ``Sharded<Class>`` subclass)."""
    mro = type(module).__mro__
    names = [c.__name__ for c in mro]
    return mro[names.index("ShardedModule") + 1] if "ShardedModule" in names[1:] else mro[0]


def _check_argument_types(**arguments) -> None:
    """Refuse values of the wrong type (``reshard_after_forward="no"`` is truthy)."""
    for name, (value, kind) in arguments.items():
        if not isinstance(value, kind):
            raise TypeError(f"{name}={value!r} must be a {kind.__name__}")


def check_options(options: FullyShardOptions) -> Callable:
    """Refuse options of the wrong type; the ``plan_fn`` to use (``experts_by_mark`` by default)."""
    _check_argument_types(
        reshard_after_forward=(options.reshard_after_forward, bool),
        prefetch=(options.prefetch, bool),
        gradient_reduction=(options.gradient_reduction, str),
        tp_axis=(options.tp_axis, str),
        ep_axis=(options.ep_axis, str),
    )
    offload_policy, collectives = options.offload_policy, options.collectives
    init_fn, plan_fn = options.init_fn, options.plan_fn
    if offload_policy is not None and not isinstance(offload_policy, OffloadPolicy):
        torch_meaning = {"CPUOffloadPolicy": ": torch's CPUOffloadPolicy() is shardwise.OffloadPolicy(fraction=1.0)",
                         "OffloadPolicy": ": torch's OffloadPolicy() (no offload) is offload_policy=None"}
        raise TypeError(f"offload_policy must be a shardwise.OffloadPolicy or None, got {type(offload_policy).__name__}"
                        f"{torch_meaning.get(type(offload_policy).__name__, '')}")
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
        if p.dtype not in _FLOATING:
            raise ValueError(
                f"parameter {name!r} has dtype {p.dtype}, which shardwise cannot shard; "
                f"supported parameter dtypes are {[str(d) for d in _FLOATING]}"
            )
        if p.dim() == 0:
            raise ValueError(
                f"parameter {name!r} is 0-dimensional; shardwise shards along dim 0, so store it with shape (1,)"
            )
    meta = [n for n, p in root.named_parameters() if p.is_meta]
    if meta and init_fn is None:
        raise ValueError(
            f"parameters {meta[:4]}{'...' if len(meta) > 4 else ''} are on the meta device; "
            "pass init_fn=shardwise.MetaInitializer(model) (or shardwise.engine.materialize.materialize_owned_meta_modules) "
            "to materialize them unit by unit"
        )


# ------------------------------------------------------------------ plans
def build_plans(options: FullyShardOptions) -> tuple[ShardingPlan, ShardingPlan | None]:
    """The dense plan (over ``mesh``, built when ``None``) and the expert plan (with an ``expert_mesh``),
    their gradients scaled for ``gradient_reduction``."""
    tp_axis, ep_axis, gradient_reduction = options.tp_axis, options.ep_axis, options.gradient_reduction
    expert_mesh, expert_placements = options.expert_mesh, options.expert_placements
    mesh, placements = resolve_placements(options.mesh, options.placements, options.strategy,
                                          options.outer_dp_sharding_strategy)
    names = mesh.mesh_dim_names or ()
    plan = ShardingPlan(mesh, placements, model_parallel_axes=[tp_axis] if tp_axis in names else [])
    expert_plan = _expert_plan(plan, placements, expert_mesh, expert_placements, ep_axis, tp_axis)
    if gradient_reduction not in ("mean", "sum"):
        raise ValueError(f"gradient_reduction={gradient_reduction!r} must be 'mean' or 'sum'")
    if gradient_reduction == "sum":  # e.g. per-token losses normalized after the reduction
        for p in (plan, expert_plan):
            if p is not None:
                p.grad_scale *= plan.dp_size
    return plan, expert_plan


# ------------------------------------------------------------------ placements, units, parameters
def resolve_placements(mesh, placements, strategy, outer_dp_sharding_strategy) -> tuple[DeviceMesh, dict]:
    if placements is not None and (strategy is not None or outer_dp_sharding_strategy is not None):
        raise ValueError("pass either placements=... or strategy=/outer_dp_sharding_strategy=, not both")
    if placements is None:
        outer = outer_dp_sharding_strategy
        if mesh is None and outer is not None:
            raise ValueError(
                f"outer_dp_sharding_strategy={outer!r} needs a 2-D mesh with axes ('dp_outer', 'dp_shard'); "
                "pass mesh=shardwise.build_dp_mesh(outer=N)"
            )
        names = mesh.mesh_dim_names if mesh is not None else None
        if outer is None and names is not None and len(names) == 1:
            placements = strategy_placements(strategy if strategy is not None else 3, inner_axis=names[0])
        else:
            placements = strategy_placements(strategy if strategy is not None else 3, outer)
    elif isinstance(placements, (str, int)):
        placements = strategy_placements(placements, inner_axis=mesh.mesh_dim_names[-1] if mesh else "dp_shard")
    elif isinstance(placements, Mapping):
        placements = normalize_placements(placements)
    else:
        raise TypeError(f"placements={placements!r} must be a strategy name or a dict of axis -> AxisPlacements")
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


def _owners(root: nn.Module, units: list[nn.Module]) -> tuple[dict, dict]:
    """Map each (module, attr) holding a parameter to its owning unit module (root when shared)."""
    unit_ids = {id(u) for u in units}
    holder_owner: dict[tuple[int, str], nn.Module] = {}
    holder_obj: dict[tuple[int, str], tuple[nn.Module, str, str]] = {}
    param_owners: dict[int, set[int]] = {}

    def visit(module: nn.Module, prefix: str, owner: nn.Module, stack: tuple) -> None:
        if id(module) in stack:
            return
        for attr, p in module._parameters.items():
            if p is None:
                continue
            key = (id(module), attr)
            holder_obj.setdefault(key, (module, attr, f"{prefix}{attr}"))
            previous = holder_owner.get(key)
            holder_owner[key] = owner if previous is None or previous is owner else root
            param_owners.setdefault(id(p), set()).add(id(holder_owner[key]))
        for name, child in module.named_children():
            visit(child, f"{prefix}{name}.", child if id(child) in unit_ids else owner, stack + (id(module),))

    visit(root, "", root, ())
    for key, (module, attr, _) in holder_obj.items():
        p = module._parameters[attr]
        if len(param_owners[id(p)]) > 1:  # tied across units: the root gathers it for the whole step
            holder_owner[key] = root
    return holder_owner, holder_obj


def _expert_plan(plan, placements, expert_mesh, expert_placements, ep_axis, tp_axis="tp") -> ShardingPlan | None:
    """The expert plan; a ``tp_axis`` on the expert mesh is expert tensor parallelism (its own group)."""
    if expert_mesh is None:
        return None
    names = expert_mesh.mesh_dim_names or ()
    if ep_axis not in names:
        raise ValueError(f"expert_mesh axes {list(names)} have no expert-parallel axis ep_axis={ep_axis!r}")
    model_parallel = [ep_axis] + ([tp_axis] if tp_axis in names else [])
    if expert_placements is None:
        missing = [n for n in names if n not in model_parallel and n not in placements]
        if missing:
            raise ValueError(
                f"expert_mesh axes {missing} have no placements; pass expert_placements= for them"
            )
        expert_placements = {n: placements[n] for n in names if n not in model_parallel}
    else:
        expert_placements = normalize_placements(expert_placements)
    expert = ShardingPlan(expert_mesh, expert_placements, model_parallel_axes=model_parallel)
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
    choice = _plan_choice(plan_fn, ref.fqn, ref.param) if expert_plan is not None else DENSE
    is_expert = choice in EXPERT_CHOICES
    target = expert_plan if is_expert else plan
    if choice == EXPERT:
        ref.model_parallel_dims[ep_axis] = 0  # experts are stacked along dim 0
    elif is_expert:
        ref.local_axes.append(ep_axis)  # this EP rank's own tensor: its DTensor spans its expert-dp ranks only
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
                    f"{held}), but the expert mesh has no tensor-parallel axis {tp_axis!r}: expert tensor "
                    "parallelism without one is not built yet; give expert_mesh a "
                    f"{tp_axis!r} axis over the experts' TP group, or keep each expert whole on its "
                    "expert-parallel rank (expert TP 1)"
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
    around it, the root for what no unit holds and for parameters tied across units."""

    def __init__(self, root: nn.Module, units: list[nn.Module]):
        self.root, self.units = root, units
        self.holder_owner, self.holder_obj = _owners(root, units)
        self.names = {id(m): n for n, m in root.named_modules()}

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
            if p.is_meta:
                raise ValueError(f"init_fn left parameter {fqn!r} on the meta device")
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
            ref_plan = _place_model_parallel(ref, self.plan, self.expert_plan, tp_axis, self.ep_axis, self.plan_fn)
            sequence_parallel = bool(getattr(ref.param, "sequence_parallel", False)) and tp_axis in ref_plan.model_parallel
            mark = gather_mark(ref.param)  # an FP8 gather: its own group (uint8 slots, its own scales)
            key = (id(ref_plan), ref.param.dtype, ref.param.requires_grad, sequence_parallel,
                   None if mark is None else mark.kind)
            buckets.setdefault(key, []).append(ref)
            if tp_axis in ref_plan.model_parallel and tp_axis not in ref.model_parallel_dims:
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
        group = ParamGroup(
            label, bucket, ref_plan, self.policy, self.device, self.streams, sum_over_axes=sum_axes,
            offload=id(owner) in self.offloaded, pin_memory=self.pin_memory, collectives=self.collectives,
        )
        group.install_sharded_params()  # the modules now hold DTensors; the full tensors can go
        return group


def build_units(
    root: nn.Module, unit_modules: list[nn.Module], build_groups: Callable, reshard_after_forward: bool
) -> tuple[list[Unit], Unit]:
    """The units (in ``unit_modules`` order) and the root unit, built deepest first, so an outer unit
    (and the root, last) only sees what inner ones left."""
    names = {id(m): n for n, m in root.named_modules()}
    depth = {id(m): n.count(".") + 1 for n, m in root.named_modules()}
    built = {}
    for u in sorted(unit_modules, key=lambda m: -depth[id(m)]):
        built[id(u)] = Unit(names[id(u)], u, build_groups(u), reshard_after_forward)
    units = [built[id(u)] for u in unit_modules]
    return units, Unit("", root, build_groups(root), reshard_after_forward=False)


def move_buffers(root: nn.Module, device: torch.device) -> None:
    """Move every (non-meta) buffer to the device the groups live on."""
    for m in root.modules():
        for key, buf in m._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:
                m._buffers[key] = buf.to(device)


def register_hooks(module: nn.Module, state: ShardedState, units: list[Unit]) -> None:
    """The root's and each unit's forward hooks, and the load-state-dict hook that marks the weights modified."""
    module.register_forward_pre_hook(state.root_pre_forward, with_kwargs=True, prepend=True)
    module.register_forward_hook(state.root_post_forward)
    for unit in units:
        unit.module.register_forward_pre_hook(
            lambda m, a, k, unit=unit: state.unit_pre_forward(unit, m, a, k), with_kwargs=True, prepend=True
        )
        unit.module.register_forward_hook(lambda m, a, o, unit=unit: state.unit_post_forward(unit, m, a, o))
    module.register_load_state_dict_post_hook(lambda m, keys: state.mark_weights_modified())
