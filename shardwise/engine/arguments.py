"""``fully_shard``'s arguments, checked and resolved before anything is sharded.

In the order ``fully_shard`` runs them: the call's modules (one, or FSDP2's
list; units of earlier calls to adopt), the policies (torch's classes or
shardwise's), the option types, the plans (placements per axis, the dense and
expert ``ShardingPlan``), the units, the parameters. Every refusal names the
argument and its value; nothing here shards or communicates except the mesh
built for ``mesh=None``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy
from torch.distributed.tensor import DTensor

from .collectives import Collectives
from .fully_shard_options import FullyShardOptions
from .mesh import PLAN_CHOICES, ShardingPlan, default_fsdp2_mesh, fold_context_parallel, named_mesh
from .offload import OffloadPolicy
from .param_group import SHARDED_MARK
from .placements import normalize_placements
from .post_forward_shard import resolve_reshard_after_forward
from .spmd_mesh import read_spmd_mesh
from .tp_submesh import read_tp_submesh
from .precision import CASTABLE_DTYPES, MixedPrecisionPolicy, from_torch_policy
from .sharded_module import STATE_ATTR

__all__ = [
    "check_call",
    "check_fsdp2_mesh",
    "check_modules",
    "resolve_policy",
    "resolve_offload",
    "check_options",
    "build_plans",
    "check_bucket_size",
    "check_parameters",
]



# ------------------------------------------------------------------ checks
def check_call(module, unit_modules) -> list[nn.Module]:
    """The modules of this call (one, or FSDP2's list); what ``fully_shard`` refuses before looking at them."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if len(modules) > 1 and unit_modules is not None:
        raise ValueError("unit_modules= takes one module, not a list: call fully_shard on each unit instead")
    return modules


def fsdp2_face(placements, strategy, outer_dp_sharding_strategy) -> bool:
    """Whether the call reads its mesh as FSDP2 does (none of shardwise's placement arguments given): FSDP2's
    refusals then apply as FSDP2 makes them; ``placements`` / ``strategy`` (the Megatron face, the one-call
    form) say which axis does what themselves."""
    return placements is None and strategy is None and outer_dp_sharding_strategy is None


def check_fsdp2_mesh(mesh, dp_mesh_dims, face: bool) -> None:
    """FSDP2's refusal of a 2-D mesh without names (HSDP needs them), with its exception class and words."""
    if face and dp_mesh_dims is None and isinstance(mesh, DeviceMesh) and mesh.ndim == 2 \
            and mesh.mesh_dim_names is None:
        raise AssertionError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified (FSDP2's refusal): mesh "
            f"{tuple(mesh.shape)} has no names; pass init_device_mesh(..., {tuple(mesh.shape)}, mesh_dim_names="
            "('dp_replicate', 'dp_shard')) (replicate over the first axis, shard over the second)")


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
    inside = {id(sub) for m in modules for sub in m.modules()}
    for m in modules:
        for name, sub in m.named_modules():
            if isinstance(sub, FSDPModule) and not hasattr(sub, state_attr):
                where = f"submodule {name!r} ({type(sub).__name__})" if name else f"module {type(sub).__name__}"
                raise ValueError(
                    f"{where} is already sharded by torch.distributed.fsdp.fully_shard: one library shards a "
                    "model; build it again and call shardwise.fully_shard on its blocks and root (from shardwise "
                    "import fully_shard in every call)")
        if hasattr(m, state_attr):
            raise ValueError(f"module {type(m).__name__} is already sharded by shardwise.fully_shard (one unit "
                             "per module: call fully_shard once on it)")
        for name, sub in m.named_modules():
            state = sub.__dict__.get(state_attr)
            if state is None:
                continue
            # Each earlier call's state heads the units below its root (and whatever it adopted in turn): this
            # call adopts it whole when that root lies inside this call's modules, at any depth.
            if not all(id(x) in inside for x in state.root.modules):
                raise ValueError(
                    f"submodule {name!r} ({type(sub).__name__}) was already taken in by the fully_shard call on "
                    f"{state.root.module.__class__.__name__}, outside {type(m).__name__}: call fully_shard "
                    "bottom-up, the inner modules first")
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
    argument = "mp_policy" if mp_policy is not None else "mixed_precision"  # the one the caller passed
    raise TypeError(f"{argument}={policy!r} must be a MixedPrecisionPolicy (torch.distributed.fsdp's or "
                    f"shardwise's), got {type(policy).__name__}")


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
    """Refuse options of the wrong type; the ``plan_fn`` to use (``None``: the default,
    ``resolution.plan_choice`` reads it)."""
    reshard = options.reshard_after_forward
    if reshard is not None and not isinstance(reshard, int):  # an int's value is read with the plan
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
    return plan_fn


def check_bucket_size(bucket_size: int | None) -> None:
    if bucket_size is not None and (isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size < 1):
        raise ValueError(f"bucket_size={bucket_size!r} must be a positive number of elements")


def check_parameters(root: nn.Module, init_fn: Callable | None, face: bool = False,
                     ignored: frozenset | None = None) -> None:
    """Refuse parameters shardwise cannot shard, and meta parameters with nothing to materialize them; on
    FSDP2's face (``face``), a non-contiguous parameter this call shards, as FSDP2 refuses it."""
    for name, p in root.named_parameters():
        if isinstance(p, DTensor):  # sharded by an earlier fully_shard call on a submodule
            continue
        if face and not p.is_contiguous() and p not in (ignored or ()):
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters yet: parameter {name!r} {p.shape=} "
                f"{p.stride()=} (FSDP2's refusal); make it contiguous before fully_shard "
                f"(module.{name} = nn.Parameter(module.{name}.contiguous())), or list it in ignored_params")
        if p.dtype not in CASTABLE_DTYPES and p.requires_grad:
            raise ValueError(
                f"parameter {name!r} has dtype {p.dtype} and requires grad, which shardwise cannot shard; "
                f"trainable parameter dtypes are {[str(d) for d in CASTABLE_DTYPES]} (other dtypes: frozen only)"
            )
        if p.dim() == 0:
            raise ValueError(
                f"parameter {name!r} is 0-dimensional; shardwise shards along dim 0. Change {name} to a 1D tensor "
                "with numel equal to 1."
            )
    # Meta parameters without an init_fn stay on the meta device, sharded: model.to_empty(device=...) and the
    # model's own initialisation then fill the shards (FSDP2's flow).


# ------------------------------------------------------------------ plans
def build_plans(options: FullyShardOptions) -> tuple[ShardingPlan, ShardingPlan | None]:
    """The dense plan (over ``mesh``, built when ``None``) and the expert plan (with an ``expert_mesh``),
    their gradients scaled for ``gradient_reduction``."""
    tp_axis, ep_axis, gradient_reduction = options.tp_axis, options.ep_axis, options.gradient_reduction
    expert_mesh, expert_placements = options.expert_mesh, options.expert_placements
    mesh, placements, face = resolve_placements(options)
    names = mesh.mesh_dim_names or ()
    plan = ShardingPlan(mesh, placements, model_parallel_axes=[tp_axis] if tp_axis in names else [], face_mesh=face)
    expert_plan = _expert_plan(plan, placements, expert_mesh, expert_placements, ep_axis, tp_axis)
    if gradient_reduction not in ("mean", "sum"):
        raise ValueError(f"gradient_reduction={gradient_reduction!r} must be 'mean' or 'sum'")
    if gradient_reduction == "sum":  # e.g. per-token losses normalized after the reduction
        for p in (plan, expert_plan):
            if p is not None:
                p.grad_scale *= plan.dp_size
    return plan, expert_plan


# ------------------------------------------------------------------ placements, units, parameters
def resolve_placements(options: FullyShardOptions) -> tuple[DeviceMesh, dict, DeviceMesh | None]:
    """The mesh (FSDP2's unnamed meshes named, FSDP2's default one built), each data-parallel axis's placements
    (``FullyShardOptions.axis_placements``, which the rank-consistency check reads too) and the unnamed mesh the
    DTensors keep (``ShardingPlan.face_mesh``; ``None`` for a named one)."""
    given = options.mesh
    face = given if given is not None and given.mesh_dim_names is None else None
    mesh = None if given is None else named_mesh(given)
    placements = options.axis_placements(None if mesh is None else mesh.mesh_dim_names)
    if mesh is None:
        if list(placements) != ["dp_shard"]:
            raise ValueError(f"placements name axes {list(placements)}; pass a mesh that has them")
        face = default_fsdp2_mesh()
        mesh = named_mesh(face)
    folded, placements = _fold_context_parallel(mesh, placements)
    return folded, placements, face if folded is mesh else None


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


def resolve_spmd_mesh(modules, mesh, dp_mesh_dims, reshard_after_forward, placements, strategy,
                      outer_dp_sharding_strategy, expert_mesh, tp_axis: str, ignored_params) -> tuple:
    """``(spmd, mesh, placements, tp_axis)``: under ``dp_mesh_dims`` the full SPMD mesh read as the engine's mesh
    (``spmd_mesh``), or where this call's parameters are DTensors on a TP submesh beside ``mesh`` (the DP submesh)
    the two meshes concatenated, read alike (``tp_submesh``); its DTensor parameters are taken later by
    :func:`take_spmd_parameters`. Else the arguments as they came (``spmd`` ``None``)."""
    mesh_options = dict(placements=placements, strategy=strategy,
                        outer_dp_sharding_strategy=outer_dp_sharding_strategy, expert_mesh=expert_mesh)
    if dp_mesh_dims is not None:
        spmd = read_spmd_mesh(mesh, dp_mesh_dims, reshard_after_forward, **mesh_options)
    else:
        spmd = read_tp_submesh(mesh, _unsharded_params(modules, ignored_params), **mesh_options)
        if spmd is None:
            return None, mesh, placements, tp_axis
    return spmd, spmd.engine_mesh, spmd.placements, spmd.tp_axis or tp_axis


def _unsharded_params(modules: list[nn.Module], ignored_params) -> list[tuple[str, nn.Parameter]]:
    """The (fqn, parameter) of ``modules`` that this call shards: not taken by an earlier call, not ignored."""
    skip = {id(p) for p in ignored_params or ()}
    return [(fqn, p) for m in modules for fqn, p in m.named_parameters()
            if id(p) not in skip and not getattr(p, SHARDED_MARK, False)]


def take_spmd_parameters(spmd, modules: list[nn.Module], options: FullyShardOptions) -> None:
    """Under ``dp_mesh_dims`` (``spmd``, else nothing to do): the modules' DTensor parameters on the full SPMD
    mesh taken as the engine's TP slices, but for those an earlier call sharded and the ignored ones."""
    if spmd is None:
        return
    earlier = {id(p) for m in modules for p in m.parameters() if getattr(p, SHARDED_MARK, False)}
    spmd.take_parameters(modules, skip=earlier | {id(p) for p in options.ignored_params or ()},
                         shard_placement_fn=options.shard_placement_fn)


def resolve_reshard(options: FullyShardOptions, plan: ShardingPlan,
                    expert_plan: ShardingPlan | None) -> FullyShardOptions:
    """``options`` with FSDP2's reading of an int ``reshard_after_forward`` (``post_forward_shard``)."""
    reshard = resolve_reshard_after_forward(options.reshard_after_forward, plan, expert_plan)
    if reshard is options.reshard_after_forward:
        return options
    return dataclasses.replace(options, reshard_after_forward=reshard)
