"""``--fp8`` for ``shardwise train`` and ``shardwise bench``: the checks and the conversion, in one place.

``--fp8 tensorwise|rowwise`` converts the model's linears to torchao's
``Float8Linear`` before ``fully_shard`` (``shardwise.engine.fp8``), except the modules
``--fp8-skip`` names (default: the output head); with tensorwise the weights
also travel as FP8 bytes (``--no-fp8-all-gather`` keeps the bf16 gather).
FP8 matmuls only pay when compiled, so ``--fp8`` turns ``--compile`` on
unless ``--no-compile`` (or a backend) is given.
"""

from __future__ import annotations

from typing import Optional

import torch.nn as nn

from ..engine.fp8 import DEFAULT_SKIP, RECIPES, Fp8Conversion, convert_to_fp8, require_torchao, skip_modules

__all__ = ["FP8_MODES", "DEFAULT_SKIP_TEXT", "check_fp8", "convert_model", "skip_names", "cpu_note"]

FP8_MODES = ("",) + RECIPES  # "" = bf16 linears
DEFAULT_SKIP_TEXT = ",".join(DEFAULT_SKIP)
ZERO3 = "optim_grads_params"


def skip_names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def check_fp8(recipe: str, all_gather: bool, precision: str, strategy: str, outer_strategy: str,
              offload: bool) -> Optional[tuple[str, object, str]]:
    """``(field, value, why)`` for the first bad FP8 setting (torchao missing included), else ``None``."""
    if not recipe:
        return None
    if recipe not in RECIPES:
        return "fp8", recipe, f"use one of {', '.join(RECIPES)} (or leave it out for bf16 linears)"
    try:
        require_torchao()
    except ImportError as e:
        return "fp8", recipe, str(e)
    if precision != "bf16":
        return "fp8", recipe, ("needs --precision bf16 (the FP8 linears take bf16 inputs and give bf16 outputs; "
                               "the presets 1b and 8b set it, the default tiny preset computes in fp32)")
    if recipe == "tensorwise" and all_gather:
        why = None
        if strategy != ZERO3:
            why = f"needs --strategy {ZERO3} (parameters sharded like the main weights), not {strategy}"
        elif outer_strategy == "optim":
            why = "is built for HSDP (--outer-strategy no_shard), not HFSDP"
        elif offload:
            why = "is not built for offloaded main weights (--offload)"
        if why:
            return "fp8_all_gather", "", f"{why}; add --no-fp8-all-gather to gather bf16 weights"
    return None


def cpu_note(recipe: str, compile_backend: str, device_type: str) -> str:
    """The line a run with ``--fp8`` on the CPU starts with ("" otherwise): it works, for testing, but slowly."""
    if not recipe or device_type != "cpu":
        return ""
    compiled = (f"each layer is compiled ({compile_backend}) at the first step, which takes minutes; "
                if compile_backend else "")
    return (f"--fp8 {recipe} on the CPU: the FP8 matmuls are emulated (no FP8 hardware), so {compiled}expect a "
            f"small fraction of --precision bf16's tokens/s. FP8 pays on GPUs with FP8 tensor cores (H100, H200)")


def convert_model(model: nn.Module, recipe: str, skip: str, all_gather: bool) -> Optional[Fp8Conversion]:
    """Convert ``model`` in place (before ``fully_shard``); ``None`` for bf16 linears."""
    if not recipe:
        return None
    return convert_to_fp8(model, recipe, filter_fn=skip_modules(*skip_names(skip)),
                          all_gather=all_gather and recipe == "tensorwise")
