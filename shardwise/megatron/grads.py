"""Where Megatron's layers and optimizer reach a chunk's gradients, and the check on them.

- ``megatron_fsdp_use_decoupled_grad`` (Megatron-LM sets it from
  ``--use-precision-aware-optimizer``): Megatron's optimizer then reads
  ``param.decoupled_grad`` (in the main grads' own dtype) instead of ``.grad``;
  :func:`hand_out_decoupled_grads` makes the engine put them there.
- ``gradient_accumulation_fusion``: Megatron's linear layers (local and
  Transformer Engine) write their weight gradient into ``weight.get_main_grad()``
  when the weight carries ``__fsdp_param__``, and give autograd no gradient for it;
  :func:`give_compute_params_main_grad` gives the gathered compute weights that
  method, backed by their ``.grad``, so the engine reduces what the kernel wrote.
- ``check_for_nan_in_grad``: :func:`check_grads_finite` after the reduction.
"""

from __future__ import annotations

import types
from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..engine.model_ops import add_grad_alias, compute_parameters, hand_out_unused_grads, set_grad_attribute

__all__ = ["hand_out_decoupled_grads", "give_compute_params_main_grad", "check_grads_finite", "grads_of",
           "wire_megatron_grads"]

DECOUPLED_GRAD = "decoupled_grad"
# Megatron's layers take their Megatron-FSDP wgrad path for a weight with this attribute.
FSDP_PARAM_ATTR = "__fsdp_param__"


def hand_out_decoupled_grads(module: nn.Module) -> None:
    """The finished main grads go to ``param.decoupled_grad``, uncast, and ``.grad`` stays ``None``."""
    set_grad_attribute(module, DECOUPLED_GRAD)


def _main_grad(param: nn.Parameter) -> torch.Tensor:
    """The buffer a fused wgrad kernel writes (or adds) this micro-batch's weight gradient into:
    ``param.grad`` itself, zeros until something wrote it, which the engine reduces as any gradient."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    return param.grad


def give_compute_params_main_grad(module: nn.Module) -> None:
    """Let Megatron's fused wgrad accumulation write into the gathered compute weights' ``.grad``.

    The weights forward computes with get ``__fsdp_param__`` and ``get_main_grad()``;
    they carry no ``grad_added_to_main_grad``, so the layer hands autograd ``None`` for
    them (no dummy gradient). ``main_grad``, which the layer keeps pointing at the
    buffer, is dropped with ``.grad`` once the engine has read it.
    """
    for param in compute_parameters(module):
        setattr(param, FSDP_PARAM_ATTR, True)
        param.get_main_grad = types.MethodType(_main_grad, param)
    add_grad_alias(module, "main_grad")


def grads_of(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, gradient)`` of every parameter that has one, ``.grad`` or ``.decoupled_grad``."""
    found = []
    for name, param in module.named_parameters():
        grad = param.grad if param.grad is not None else getattr(param, DECOUPLED_GRAD, None)
        if grad is not None:
            found.append((name, grad))
    return found


def check_grads_finite(module: nn.Module, groups: Iterable[Optional[dist.ProcessGroup]], who: str) -> None:
    """Raise ``RuntimeError`` naming the parameters whose reduced gradient holds NaN or Inf.

    Each rank looks at its own shards; the verdict is combined over ``groups``
    (the chunk's data-parallel and tensor-parallel groups) so that every rank of
    the stage raises, not only the one holding the bad shard.
    """
    named = grads_of(module)
    locals_ = [g.to_local() if isinstance(g, DTensor) else g for _, g in named]
    if locals_:
        finite = torch.stack([t.isfinite().all() if t.numel() else torch.ones((), dtype=torch.bool, device=t.device)
                              for t in locals_])
    else:
        finite = torch.ones(0, dtype=torch.bool)
    bad_here = [name for (name, _), ok in zip(named, finite.tolist()) if not ok]
    flag = torch.tensor([float(bool(bad_here))], device=finite.device if finite.numel() else "cpu")
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() > 0:
        where = f"in {bad_here[:8]} on this rank" if bad_here else "on another rank of this chunk"
        raise RuntimeError(
            f"{who}: check_for_nan_in_grad=True and a reduced gradient holds NaN or Inf ({where}); "
            "Megatron-LM's --no-check-for-nan-in-loss-and-grad turns the check off"
        )


def wire_megatron_grads(module: nn.Module, config, ddp_config) -> None:
    """After sharding: decoupled grads and fused wgrad accumulation, as the (raw) configs ask; and every
    parameter's gradient handed out, zeros where unused (Megatron's optimizer reads each parameter's slot of
    its gradient buffer, not FSDP2's ``None``)."""
    hand_out_unused_grads(module)
    if getattr(ddp_config, "megatron_fsdp_use_decoupled_grad", False):
        hand_out_decoupled_grads(module)
    if getattr(config, "gradient_accumulation_fusion", False):
        give_compute_params_main_grad(module)
