"""Optimizer glue: gradient clipping by the global norm over shards."""

from __future__ import annotations

import math
import weakref
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard  # FSDP2's dp shard beside a TP split of dim 0

from .device import device_for
from .model_ops import sharded_state
from .owner_layout import OWNER_SUM_GROUP
from .graph_safe import refuse_unless_eager

__all__ = ["clip_grad_norm_", "grad_norm", "takes_clip_factor"]


def _shard_groups(param: torch.Tensor) -> tuple:
    """Process groups of the mesh axes over which this parameter's gradient is split."""
    if not isinstance(param, DTensor):
        return ()
    owner_group = getattr(param, OWNER_SUM_GROUP, None)
    if owner_group is not None:  # whole on its owner's one-rank mesh, empty on the other ranks of this group
        return (owner_group,)
    mesh = param.device_mesh
    return tuple(
        mesh.get_group(i) for i, placement in enumerate(param.placements) if isinstance(placement, (Shard, _StridedShard))
    )


def _comm_device(parameters: list) -> torch.device | None:
    """Where the collectives of these DTensors' meshes run."""
    for p in parameters:
        if isinstance(p, DTensor):
            return device_for(p.device_mesh)
    return None


def grad_norm(parameters: Iterable[torch.Tensor], norm_type: float = 2.0, *, extra_groups: Sequence = ()) -> torch.Tensor:
    """The norm of all gradients as if they were unsharded (the same value on every rank).

    ``extra_groups``: process groups whose ranks hold *other* parameters of the model,
    outside the DTensors' meshes (a pipeline's stages: ``mesh["pp"].get_group()``);
    each rank's total is summed (max for ``inf``) over them too, so every stage clips
    by the whole model's norm. Every rank of those groups must call it.
    """
    norm_type = float(norm_type)
    parameters = list(parameters)
    extra_groups = _groups(extra_groups)
    by_groups: dict[tuple, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is None:
            if getattr(p, OWNER_SUM_GROUP, None) is not None:  # owned by another rank: it still joins the sum
                by_groups.setdefault((_shard_groups(p), p.device), [])
            continue
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        by_groups.setdefault((_shard_groups(p), grad.device), []).append(grad)  # offloaded ones on the host
    if not by_groups and not extra_groups:
        return torch.tensor(0.0)
    # Offloaded grads live on the host; NCCL sums only device tensors.
    comm_device = _comm_device(parameters) or (device_for(extra_groups[0]) if extra_groups else None)
    device = next(iter(by_groups.values()))[0].device if by_groups else comm_device
    comm_device = comm_device or device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (groups, grad_device), grads in by_groups.items():
        grads = [g for g in grads if g.numel()]
        if grads:
            norms = torch._foreach_norm(grads, norm_type)
            part = torch.stack([n.float() for n in norms])
            local = part.max() if math.isinf(norm_type) else part.pow(norm_type).sum()
        else:
            local = torch.zeros((), dtype=torch.float32, device=grad_device)
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        local = local.to(comm_device if groups else device)
        for group in groups:
            dist.all_reduce(local, op=op, group=group)
        local = local.to(device)
        total = torch.maximum(total, local) if math.isinf(norm_type) else total + local
    if extra_groups:
        total = total.to(comm_device)
        for group in extra_groups:
            dist.all_reduce(total, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
        total = total.to(device)
    return total if math.isinf(norm_type) else total.pow(1.0 / norm_type)


def _groups(extra_groups) -> list:
    """``extra_groups`` as a list of process groups, or ``ValueError`` naming what it got."""
    if isinstance(extra_groups, dist.ProcessGroup):
        extra_groups = [extra_groups]
    groups = list(extra_groups)
    wrong = [type(g).__name__ for g in groups if not isinstance(g, dist.ProcessGroup)]
    if wrong:
        raise ValueError(f"extra_groups must be process groups (e.g. mesh['pp'].get_group()), "
                         f"got {wrong}")
    return groups


_STEPPED_IN_BACKWARD = "_shardwise_backward_optimizer"  # set on parameters a BackwardOptimizer steps


def _number(name: str, value, positive: bool) -> float:
    """``value`` as a float, or ``ValueError`` naming the argument (bools, NaN and negatives refused)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, str) and value.lower() in ("inf", "infinity"):
        value = math.inf
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if not ok or value < 0 or (positive and value == 0):
        need = "a positive number (inf for the max norm)" if positive else "a non-negative number (inf: no limit)"
        raise ValueError(f"clip_grad_norm_: {name}={value!r} must be {need}")
    return float(value)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
    *, optimizer: torch.optim.Optimizer | None = None, extra_groups: Sequence = (),
) -> torch.Tensor:
    """Scale sharded gradients so their global norm is at most ``max_norm``; return the norm (unclipped).

    ``max_norm`` must be a non-negative number (``inf``: measure only) and ``norm_type`` a
    positive one; parameters stepped by a :class:`BackwardOptimizer` are refused, since their
    gradients were applied and freed during backward and nothing would be clipped.

    ``optimizer``: a fused torch optimizer (``fused=True``) that steps exactly these parameters.
    The gradients are then not scaled here: the factor goes to the optimizer's next ``step()``,
    whose kernel divides each gradient by ``optimizer.grad_scale`` as it reads it (and writes the
    clipped value back), which saves a read and a write of every gradient. Until that step,
    ``.grad`` holds the unclipped values.

    ``extra_groups``: see :func:`grad_norm` (pipeline stages: the norm spans every stage).
    """
    max_norm = _number("max_norm", max_norm, positive=False)
    norm_type = _number("norm_type", norm_type, positive=True)
    parameters = [p for p in parameters]
    if optimizer is not None:
        _check_foldable(optimizer, parameters)
    stepped = sum(1 for p in parameters if getattr(p, _STEPPED_IN_BACKWARD, False))
    if stepped:
        raise ValueError(
            f"clip_grad_norm_: {stepped} of the {len(parameters)} parameters are stepped by a BackwardOptimizer, "
            f"which applies and frees each gradient during backward: there is nothing left to clip (and the "
            f"global norm cannot be known before the steps); use a usual optimizer with clip_grad_norm_, or no "
            f"clipping")
    total = grad_norm(parameters, norm_type, extra_groups=extra_groups)
    if error_if_nonfinite and total.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError("clip_grad_norm_: error_if_nonfinite=True reads the norm on the host, which a CUDA graph "
                         "being captured cannot do; pass error_if_nonfinite=False (check the returned norm after "
                         "the replay)")
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of gradients is {total.item()}, which is not finite")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if optimizer is not None:
        _fold_into_next_step(optimizer, coef, parameters)
        return total
    grads = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in parameters if p.grad is not None]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        if g.numel():
            by_device.setdefault(g.device, []).append(g)
    for grad_device, same in by_device.items():
        torch._foreach_mul_(same, coef.to(grad_device))
    return total


_FOLDED = "_shardwise_folded_clip"  # on an optimizer whose next step carries a clipping factor: the grads it is for
_FOLD_HOOK = "_shardwise_fold_hook"  # on an optimizer whose post-hook takes the factor away after each step


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad._local_tensor if isinstance(grad, DTensor) else grad


def _grads_now(parameters: list) -> list[tuple]:
    """Which gradients these are: each object (weakly) and its data's version counter."""
    return [(weakref.ref(p.grad), _local(p.grad)._version) for p in parameters if p.grad is not None]


def _same_grads(seen: list[tuple], parameters: list) -> bool:
    now = [p.grad for p in parameters if p.grad is not None]
    return len(now) == len(seen) and all(ref() is g and _local(g)._version == version
                                         for (ref, version), g in zip(seen, now))


def takes_clip_factor(optimizer) -> bool:
    """Whether ``clip_grad_norm_(..., optimizer=optimizer)`` can hand it the clipping factor: a fused torch
    optimizer, whose step divides each gradient by ``optimizer.grad_scale``."""
    groups = getattr(optimizer, "param_groups", None)
    return (isinstance(groups, list) and getattr(optimizer, "_step_supports_amp_scaling", False)
            and all(group.get("fused") for group in groups))


def _check_foldable(optimizer: torch.optim.Optimizer, parameters: list) -> None:
    """Refuse an optimizer whose next step would not apply the clipping factor to exactly these gradients."""
    name = type(optimizer).__name__
    groups = optimizer.param_groups if takes_clip_factor(optimizer) else None
    if groups is None:
        raise ValueError(
            f"clip_grad_norm_: optimizer={name} must be a fused torch optimizer (e.g. AdamW(..., fused=True)), "
            f"whose step divides each gradient by optimizer.grad_scale; pass optimizer=None to scale the "
            f"gradients in place")
    pending = getattr(optimizer, _FOLDED, None)
    if pending is not None and _same_grads(pending, parameters):
        raise ValueError(
            f"clip_grad_norm_: optimizer={name} already carries a clipping factor for these gradients (clip_grad_norm_ "
            f"was called twice without optimizer.step() between): call step() first, or clip with optimizer=None")
    stepped = {id(p) for group in groups for p in group["params"] if p.grad is not None}
    clipped = {id(p) for p in parameters if p.grad is not None}
    if stepped != clipped:
        raise ValueError(
            f"clip_grad_norm_: optimizer={name} steps {len(stepped - clipped)} parameters with gradients that are "
            f"not in parameters, and parameters has {len(clipped - stepped)} with gradients it does not step; "
            f"the factor folded into its step must scale exactly the clipped gradients (or pass optimizer=None)")


def _fold_into_next_step(optimizer: torch.optim.Optimizer, coef: torch.Tensor, parameters: list) -> None:
    """Leave ``coef`` for the optimizer's next step as the divisor ``grad_scale`` (GradScaler's hook).

    A factor left by an earlier call for other gradients (a step skipped, say on a non-finite norm)
    is replaced. The step's post-hook (registered once per optimizer, never removed while hooks run)
    takes the factor away again, unless a GradScaler drives the step: it has multiplied its own
    scale in and removes the attribute itself.
    """
    optimizer.grad_scale = torch.reciprocal(coef).float()
    setattr(optimizer, _FOLDED, _grads_now(parameters))
    if not getattr(optimizer, _FOLD_HOOK, False):
        optimizer.register_step_post_hook(_clear_folded)
        setattr(optimizer, _FOLD_HOOK, True)


def _clear_folded(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer.__dict__.pop(_FOLDED, None) is not None and "found_inf" not in optimizer.__dict__:
        optimizer.__dict__.pop("grad_scale", None)


class BackwardOptimizer:
    """Run an optimizer per parameter group as soon as that group's gradients are final.

    The step of a group happens during backward, right after its reduction
    (on a GPU on the reduce stream, beside the backward of the units before
    it: ``shardwise.engine.backward_steps``), and its fp32 gradient shard is freed at
    once, so the whole model's
    gradients never exist together (4 bytes/param/N less at peak with fp32
    grads). The math is the same as one ``optimizer.step()`` after backward for
    optimizers that treat parameters independently (SGD, Adam, AdamW); it
    cannot be combined with clipping by the global gradient norm, which needs
    every gradient first. ``step()`` and ``zero_grad()`` are no-ops so a usual
    training loop runs unchanged; with ``no_sync`` the step happens at the last
    micro-batch.
    """

    def __init__(self, model: torch.nn.Module, optimizer_class, **kwargs):
        state = sharded_state(model)
        refuse_unless_eager(state.graph_safe, "BackwardOptimizer",
                            "its steps run inside backward, on a side stream or a host thread, and free each "
                            "gradient shard (not built for capture); step a fused, capturable optimizer after "
                            "backward instead")
        if state.backward_optimizers:
            raise ValueError("the model already has a BackwardOptimizer")
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        for group in state.groups:
            if group.requires_grad:
                optimizer = optimizer_class(group.sharded_params, **kwargs)
                state.backward_optimizers[id(group)] = optimizer
                self.optimizers[group.name] = optimizer
                for param in group.sharded_params:  # clip_grad_norm_ refuses them (nothing to clip)
                    setattr(param, _STEPPED_IN_BACKWARD, True)

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self, closure=None) -> None:
        """Nothing to do: every group stepped during backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: gradients are freed as soon as they are applied."""

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])
