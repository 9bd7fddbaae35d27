"""The building steps of ``fully_shard``: own, group, build the units, attach.

``fully_shard`` (in ``fully_shard.py``) reads as the recipe; its arguments are
checked and resolved first (``arguments.py``), then, here: ``Ownership`` (which
unit owns each parameter), ``GroupBuilder`` (one unit's parameter groups,
materializing meta parameters just before), ``build_units`` deepest first,
``adopt_units`` (the units of earlier calls on submodules), buffers to the
device, and the hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from .collectives import StreamSet, broadcast_from_first_rank
from .fully_shard_options import FullyShardOptions
from .mesh import DENSE, EXPERT, EXPERT_CHOICES, ShardingPlan
from .param_group import ParamGroup, ParamRef
from .post_forward_shard import PostForwardShard, is_group_size
from .quantized_gather import gather_mark
from .gather_extensions import EXTENSIONS_KIND, has_extensions
from .replaced_params import is_replaced
from .resolution import plan_choice
from .owner_layout import OwnerBalancer, is_owned
from .owner_state import state_dict_hooks
from .shard_placement import shard_dim_of
from .spmd_mesh import spmd_param_of
from .step_controller import StepController
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
    ref: ParamRef, plan: ShardingPlan, expert_plan, tp_axis: str, ep_axis: str, plan_fn: Callable | None = None
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
    plan_fn: Callable | None  # None: the default (resolution.plan_choice)
    offloaded: set[int]
    balancer: OwnerBalancer = field(default_factory=OwnerBalancer)  # owners of Owned() matrices (owner_layout)

    def build_groups(self, owner: nn.Module) -> list[ParamGroup]:
        """Materialize ``owner``'s meta parameters, then shard what it owns: one ``ParamGroup`` per key of
        :meth:`_buckets` (docs/design.md's "group")."""
        if self.options.init_fn is not None and any(p.is_meta for p in owner.parameters()):
            self.options.init_fn(owner, self.device)
        return [self._group(owner, key, bucket) for key, bucket in self._buckets(owner).items()]

    def _placement_answer(self, ref: ParamRef):
        """``shard_placement_fn``'s answer for ``ref``: asked now, or for a parameter taken from a DTensor, the
        one asked with the DTensor when it was taken (``spmd_mesh``)."""
        spmd = spmd_param_of(ref.param)
        return self.options.shard_placement_fn(ref.param) if spmd is None else spmd.shard_placement

    def _shard_dim(self, ref: ParamRef, answer) -> int:
        """The dim ``answer`` shards ``ref`` on; a ``ShardPlacementResult`` of a parameter taken from a DTensor
        beside a TP submesh is read against the data-parallel mesh the caller gave."""
        spmd = spmd_param_of(ref.param)
        mesh = self.options.mesh if spmd is None or spmd.spmd.dp_mesh is None else spmd.spmd.dp_mesh
        return shard_dim_of(ref, answer, mesh)

    def _buckets(self, owner: nn.Module) -> dict[tuple, list[ParamRef]]:
        """The owner's parameter groups: its parameters by (plan, dtype, requires_grad, sequence-parallel mark,
        gather kind: FP8 or FSDP2's all-gather extensions), the definition docs/design.md's vocabulary gives."""
        tp_axis = self.options.tp_axis
        buckets: dict[tuple, list[ParamRef]] = {}
        for ref in self.ownership.refs(owner):
            if self.options.shard_placement_fn is not None:
                answer = self._placement_answer(ref)
                if is_owned(answer):  # whole on an owner rank, picked per group below
                    ref.owner = -1
                else:
                    ref.shard_dim = self._shard_dim(ref, answer)
            ref_plan = _place_model_parallel(ref, self.plan, self.expert_plan, tp_axis, self.options.ep_axis, self.plan_fn)
            extended = has_extensions(ref.param, ref.fqn)  # FSDP2's all-gather extensions: gathered through its hooks
            if self.options.sync_module_states and not ref.param.is_meta:
                if extended:
                    raise NotImplementedError(
                        f"sync_module_states=True with parameter {ref.fqn!r}, which defines FSDP2's all-gather "
                        "extensions (fsdp_pre_all_gather / fsdp_post_all_gather), is not built: load its values after "
                        "fully_shard")
                # sync_module_states=True: every data-parallel rank takes the first rank's values
                broadcast_from_first_rank(ref.param, [a.group for a in ref_plan.axes.values()], self.device)
            sequence_parallel = bool(getattr(ref.param, "sequence_parallel", False)) and tp_axis in ref_plan.model_parallel
            mark = gather_mark(ref.param)  # an FP8 gather: its own group (uint8 slots, its own scales)
            kind = EXTENSIONS_KIND if extended else None if mark is None else mark.kind
            key = (id(ref_plan), ref.param.dtype, ref.param.requires_grad, sequence_parallel, kind)
            buckets.setdefault(key, []).append(ref)
            if tp_axis in ref_plan.model_parallel and tp_axis not in ref.model_parallel_dims and not ref.param.is_meta:
                # a TP-replicated parameter: identical across its TP group (the first rank's values)
                broadcast_from_first_rank(ref.param, [ref_plan.model_parallel[tp_axis].group], self.device)
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
                + ("" if not gather_kind else ",extensions" if gather_kind == EXTENSIONS_KIND else ",fp8"))
        label = f"{self.ownership.names.get(id(owner), '') or '<root>'}[{str(dtype).replace('torch.', '')}{kind}]"
        sum_axes = [ref_plan.model_parallel[self.options.tp_axis]] if sequence_parallel else []
        owned = [ref for ref in bucket if ref.owner is not None]
        if owned:  # balanced over the whole call: the running totals carry from group to group
            _check_owned_options(owned[0].fqn, self.options, id(owner) in self.offloaded, gather_kind)
            ranks = ref_plan.opt_axes[0].size if ref_plan.opt_axes else 1
            for ref, owner in zip(owned, self.balancer.assign([r.param.shape for r in owned], ranks)):
                ref.owner = owner
        # Meta parameters are sharded on the meta device; model.to_empty() gives the shards storage later.
        on_meta = any(ref.param.is_meta for ref in bucket)
        group = ParamGroup(
            label, bucket, ref_plan, self.options.mixed_precision, torch.device("meta") if on_meta else self.device,
            self.streams, sum_over_axes=sum_axes, offload=id(owner) in self.offloaded, pin_memory=self.options.offload_policy is None or self.options.offload_policy.pin_memory,
            collectives=self.options.collectives, target_device=self.device,
        )
        group.install_sharded_params()  # the modules now hold DTensors; the full tensors can go
        return group


def _check_owned_options(fqn: str, options: FullyShardOptions, offloaded: bool, gather_kind) -> None:
    """Owned() matrices are built for the eager device step: the options that move weights otherwise are refused
    by name."""
    refused = [(offloaded, f"offload_policy={options.offload_policy!r} (the unit's main weights on the host)"),
               (options.graph_safe, "graph_safe=True"),
               (is_group_size(options.reshard_after_forward),
                f"reshard_after_forward={options.reshard_after_forward!r} (kept runs of torch.chunk rows)"),
               (gather_kind == EXTENSIONS_KIND, "FSDP2's all-gather extensions (fsdp_pre_all_gather)"),
               (gather_kind not in (None, EXTENSIONS_KIND),
                "an FP8 weight all-gather (convert_to_fp8(..., all_gather=True))")]
    for hit, what in refused:
        if hit:
            raise NotImplementedError(f"shard_placement_fn returned Owned() for parameter {fqn!r} with {what}: "
                                      "not built for owned matrices; return Shard(0) or None for it, or drop the option")


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


def move_buffers(root: nn.Module, device: torch.device) -> None:
    """Move every (non-meta) buffer to the device the groups live on."""
    for m in root.modules():
        for key, buf in m._buffers.items():
            if buf is not None and buf.device != device and not buf.is_meta:
                m._buffers[key] = buf.to(device)


def register_hooks(state: StepController) -> None:
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
        owned: dict[int, dict[str, object]] = {}  # holder -> {attribute: ShardedParam} of its owned matrices
        for ref, sp in zip(group.refs, group.params):
            for module, attr in ref.holders if sp.owner is not None else ():
                owned.setdefault(id(module), {})[attr] = sp
        for key, attrs in owned.items():  # after the pre-hooks above: the sharded parameters are in place
            handles += state_dict_hooks(holders[key], attrs)
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


def start_checks(state: StepController, adopted: list, described: nn.Module, differing, options: FullyShardOptions) -> None:
    """The checks that run later: weights not to be trusted until written, looked at by the first forward
    (``weight_origin``), and the optimizer-step checks (``step_checks``), which never warn about the ignored
    parameters (left unreduced on purpose)."""
    watch_weights(state, adopted, described, differing, options.check_module_states)
    for p in options.ignored_params or ():
        mark_ignored(p)
    watch_state(state)
