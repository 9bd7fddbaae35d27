"""The building steps of ``fully_shard``: own, group, build the units, attach.

``fully_shard`` (in ``fully_shard.py``) reads as the recipe; its arguments are
checked and resolved first (``arguments.py``), then, here: ``Ownership`` (which
unit owns each parameter), ``GroupBuilder`` (one unit's parameter groups,
materializing meta parameters just before), ``build_units`` deepest first,
``adopt_units`` (the units of earlier calls on submodules), buffers to the
device, and the hooks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .collectives import StreamSet
from .fully_shard_options import FullyShardOptions
from .mesh import DENSE, EXPERT, EXPERT_CHOICES, ShardingPlan, experts_by_mark
from .param_group import ParamGroup, ParamRef
from .post_forward_shard import PostForwardShard, is_group_size
from .quantized_gather import gather_mark
from .replaced_params import is_replaced
from .resolution import plan_choice
from .shard_placement import shard_dim_of
from .spmd_mesh import spmd_param_of
from .sharded_state import ShardedState
from .step_checks import mark_ignored, watch_state
from .unit import Unit, UnitSettings
from .weight_origin import watch_weights

__all__ = [
    "Ownership",
    "GroupBuilder",
    "unit_settings",
    "build_units",
    "taken_modules",
    "adopt_units",
    "move_buffers",
    "register_hooks",
]


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


def _place_model_parallel(
    ref: ParamRef, plan: ShardingPlan, expert_plan, tp_axis: str, ep_axis: str, plan_fn: Callable = experts_by_mark
) -> ShardingPlan:
    """Choose the plan a parameter is sharded by (``plan_fn``, with an expert plan) and record its
    model-parallel dimensions."""
    choice = plan_choice(plan_fn, ref.fqn, ref.param) if expert_plan is not None else DENSE
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
    """Everything the groups of one owner are built from (``options``: the call's, read by field name);
    :meth:`build_groups` builds them."""

    ownership: Ownership
    plan: ShardingPlan
    expert_plan: ShardingPlan | None
    options: FullyShardOptions
    device: torch.device
    streams: StreamSet
    plan_fn: Callable
    offloaded: set[int]

    def build_groups(self, owner: nn.Module) -> list[ParamGroup]:
        """Materialize ``owner``'s meta parameters, then shard what it owns: one group per plan, dtype,
        requires_grad and sequence-parallel flag (the root's split into buckets of ``bucket_size``)."""
        if self.options.init_fn is not None and any(p.is_meta for p in owner.parameters()):
            self.options.init_fn(owner, self.device)
        return [self._group(owner, key, bucket) for key, bucket in self._buckets(owner).items()]

    def _shard_dim(self, ref: ParamRef) -> int:
        """``shard_placement_fn``'s dim for ``ref``: asked now, or for a parameter taken from a DTensor, asked
        with the DTensor when it was taken (``spmd_mesh``), its ``ShardPlacementResult`` read against the
        data-parallel mesh the caller gave beside a TP submesh."""
        spmd = spmd_param_of(ref.param)
        if spmd is None:
            return shard_dim_of(ref, self.options.shard_placement_fn(ref.param), self.options.mesh)
        mesh = self.options.mesh if spmd.spmd.dp_mesh is None else spmd.spmd.dp_mesh
        return shard_dim_of(ref, spmd.shard_placement, mesh)

    def _buckets(self, owner: nn.Module) -> dict[tuple, list[ParamRef]]:
        tp_axis = self.options.tp_axis
        buckets: dict[tuple, list[ParamRef]] = {}
        for ref in self.ownership.refs(owner):
            if self.options.shard_placement_fn is not None:
                ref.shard_dim = self._shard_dim(ref)
            ref_plan = _place_model_parallel(ref, self.plan, self.expert_plan, tp_axis, self.options.ep_axis, self.plan_fn)
            if self.options.sync_module_states and not ref.param.is_meta:
                _broadcast_from_first_replica(ref.param, ref_plan, self.device)
            sequence_parallel = bool(getattr(ref.param, "sequence_parallel", False)) and tp_axis in ref_plan.model_parallel
            mark = gather_mark(ref.param)  # an FP8 gather: its own group (uint8 slots, its own scales)
            key = (id(ref_plan), ref.param.dtype, ref.param.requires_grad, sequence_parallel,
                   None if mark is None else mark.kind)
            buckets.setdefault(key, []).append(ref)
            if tp_axis in ref_plan.model_parallel and tp_axis not in ref.model_parallel_dims and not ref.param.is_meta:
                _sync_from_first_rank(ref.param, ref_plan.model_parallel[tp_axis].group, self.device)
        if owner is self.ownership.root and self.options.bucket_size is not None:  # split what no unit owns into buckets
            buckets = {
                key + (i,): chunk
                for key, bucket in buckets.items()
                for i, chunk in enumerate(_split(bucket, self.options.bucket_size))
            }
        return buckets

    def _group(self, owner: nn.Module, key: tuple, bucket: list[ParamRef]) -> ParamGroup:
        plan_id, dtype, rg, sequence_parallel, gather_kind, *_ = key
        expert_plan = self.expert_plan
        ref_plan = expert_plan if expert_plan is not None and plan_id == id(expert_plan) else self.plan
        kind = (("" if rg else ",frozen") + (",experts" if ref_plan is not self.plan else "")
                + (",fp8" if gather_kind else ""))
        label = f"{self.ownership.names.get(id(owner), '') or '<root>'}[{str(dtype).replace('torch.', '')}{kind}]"
        sum_axes = [ref_plan.model_parallel[self.options.tp_axis]] if sequence_parallel else []
        # Meta parameters are sharded on the meta device; model.to_empty() gives the shards storage later.
        on_meta = any(ref.param.is_meta for ref in bucket)
        group = ParamGroup(
            label, bucket, ref_plan, self.options.mixed_precision, torch.device("meta") if on_meta else self.device,
            self.streams, sum_over_axes=sum_axes, offload=id(owner) in self.offloaded, pin_memory=self.options.offload_policy is None or self.options.offload_policy.pin_memory,
            collectives=self.options.collectives, target_device=self.device,
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


def adopt_units(roots: nn.Module | list[nn.Module], adopted: list, new_units: list[Unit]) -> list[Unit]:
    """Every unit of the model this call's ``roots`` now head: the adopted states' (their hooks removed; a state
    that adopted others in its turn hands over all of them) and this call's, in module order, each named (and
    its groups labelled) by its path from the first root (a list call's modules: ``0.``, ``1.``, ...)."""
    roots = list(roots) if isinstance(roots, (list, tuple)) else [roots]
    for state in adopted:
        for handle in state.hook_handles:
            handle.remove()
    units = [u for state in adopted for u in state.all_units] + new_units
    names, order = {}, {}
    for i, root in enumerate(roots):
        prefix = f"{i}." if len(roots) > 1 else ""
        for name, m in root.named_modules():
            if id(m) not in names:
                names[id(m)], order[id(m)] = f"{prefix}{name}".rstrip("."), len(order)
    for unit in units:
        unit.name = names.get(id(unit.module)) or unit.name
        for group in unit.groups:  # labelled by its place when built: relabel it by its place in the model
            group.name = unit.name + group.name[group.name.index("["):] if "[" in group.name else group.name
    return sorted(units, key=lambda u: order.get(id(u.module), len(order)))


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
    """The root's and each unit's forward hooks on each of their modules; the load-state-dict hooks (before: the
    unit's modules hold the sharded parameters again, as FSDP2's, so a load after a forward with no backward
    writes the main weights; after: loaded values taken in); and on every module holding a parameter the
    state-dict hooks that register the sharded parameters first (a unit that keeps its gathered weights after
    forward holds those until then). Their handles are kept in ``state.hook_handles`` (an adopting call removes
    them)."""
    handles = state.hook_handles
    for unit in state.all_units:
        handles += [m.register_load_state_dict_pre_hook(lambda *_, unit=unit: unit.reshard()) for m in unit.modules]
    for module in state.root.modules:
        handles.append(module.register_forward_pre_hook(state.root_pre_forward, with_kwargs=True, prepend=True))
        handles.append(module.register_forward_hook(state.root_post_forward))
        handles.append(module.register_load_state_dict_post_hook(lambda m, keys: state.after_load_state_dict()))
    for group in state.groups:  # FSDP2's: a state dict is saved and loaded through the sharded parameters
        holders = {id(module): module for ref in group.refs for module, _ in ref.holders}
        for module in holders.values():
            handles.append(module.register_state_dict_pre_hook(lambda *_, group=group: group.use_sharded()))
            handles.append(module._register_load_state_dict_pre_hook(lambda *_, group=group: group.use_sharded()))
    for unit in state.units:
        for module in unit.modules:
            handles.append(module.register_forward_pre_hook(
                lambda m, a, k, unit=unit: state.unit_pre_forward(unit, m, a, k), with_kwargs=True, prepend=True))
            handles.append(module.register_forward_hook(
                lambda m, a, o, unit=unit: state.unit_post_forward(unit, m, a, o)))


def attach_post_forward_shards(units: list[Unit], plan: ShardingPlan, options: FullyShardOptions) -> None:
    """Under ``reshard_after_forward=k`` (an int), each unit keeps its weights over ``k`` ranks between forward
    and backward (graph-safe mode keeps them gathered anyway)."""
    if is_group_size(options.reshard_after_forward) and not options.graph_safe:
        for unit in units:
            unit.post_forward = PostForwardShard(unit.groups, plan, options.reshard_after_forward)


def start_checks(state: ShardedState, adopted: list, described: nn.Module, differing, options: FullyShardOptions) -> None:
    """The checks that run later: weights not to be trusted until written, looked at by the first forward
    (``weight_origin``), and the optimizer-step checks (``step_checks``), which never warn about the ignored
    parameters (left unreduced on purpose)."""
    watch_weights(state, adopted, described, differing, options.check_module_states)
    for p in options.ignored_params or ():
        mark_ignored(p)
    watch_state(state)
