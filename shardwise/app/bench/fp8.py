"""``shardwise bench --fp8``: each wrapper's model with torchao's FP8 linears, converted the same way.

Every wrapper gets the same linears in FP8 (``shardwise.engine.fp8.convert_to_fp8``:
all but the output head), before it wraps the model:

- ``shardwise``: gathers bf16 weights, the FP8 linears cast them; ``shardwise-fp8ag``: with
  tensorwise, the weights gathered as FP8 bytes (ZeRO-3; opt-in, as in ``convert_to_fp8``);
- ``fsdp2``: FSDP2 gathers bf16 weights, the FP8 linears cast them;
  ``fsdp2-fp8ag``: torchao's FP8 all-gather for FSDP2 (``enable_fsdp_float8_all_gather``:
  the weights wrapped as torchao asks, their scales precomputed after each optimizer step
  with ``precompute_float8_dynamic_scale_for_fsdp``, as torchtitan does);
- ``ddp`` and ``none`` (the FP8 ceiling): the FP8 linears cast their weights.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
from torch import nn

__all__ = ["FP8_MODES", "FP8_WRAPPERS", "unavailable_reason", "prepare"]

FP8_MODES = ("off", "tensorwise", "rowwise")
FP8_WRAPPERS = ("shardwise-fp8ag", "fsdp2-fp8ag")  # wrappers that exist only to compare FP8 gathers
_NO_FP8 = ("megatron-fsdp",)
ZERO3 = "optim_grads_params"


def unavailable_reason(name: str, fp8: str) -> str | None:
    """Why wrapper ``name`` does not run in FP8 mode ``fp8`` (``None`` when it does)."""
    if fp8 == "off":
        return "an FP8 comparison: needs --fp8 tensorwise" if name in FP8_WRAPPERS else None
    if name in _NO_FP8:
        return "no FP8 variant in the benchmark"
    if name in FP8_WRAPPERS and fp8 != "tensorwise":
        return "compares FP8 weight all-gathers, which are tensorwise only: needs --fp8 tensorwise"
    return None


def prepare(name: str, model: nn.Module, fp8: str, strategy: str = ZERO3,
            offload: float = 0.0) -> Callable[[], None] | None:
    """Convert ``model`` in place for wrapper ``name``; returns what runs after each optimizer step, if anything."""
    import shardwise

    if fp8 == "off":
        return None
    shardwise_gather = name == "shardwise-fp8ag" and fp8 == "tensorwise" and strategy == ZERO3 and not offload
    shardwise.convert_to_fp8(model, fp8, all_gather=shardwise_gather)
    if name != "fsdp2-fp8ag":
        return None
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor, precompute_float8_dynamic_scale_for_fsdp

    for module in model.modules():
        if isinstance(module, Float8Linear):
            module.config = dataclasses.replace(module.config, enable_fsdp_float8_all_gather=True)
            module.weight = nn.Parameter(
                WeightWithDynamicFloat8CastTensor(module.weight.data, module.linear_mm_config,
                                                  module.config.cast_config_weight.target_dtype),
                requires_grad=module.weight.requires_grad)
    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)


def after_each_step(optimizer: torch.optim.Optimizer, fn: Callable[[], None] | None) -> None:
    """Run ``fn`` after every ``optimizer.step()``."""
    if fn is not None:
        optimizer.register_step_post_hook(lambda opt, args, kwargs: fn())
