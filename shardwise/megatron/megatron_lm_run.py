"""What the face can check at wrap time about the Megatron-LM run it sits in.

Megatron-LM (``pretrain_gpt.py`` and the other training scripts) parses its command line before it
builds the model, into ``megatron.training.global_vars``. When that module is loaded, the face reads
the flags there and refuses, at wrap time, a run that would otherwise fail later, at its first
checkpoint. Nothing is imported: a plain Megatron-Core user has no such module, and then only the
later check (at the first save or load) applies.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

from .options import UnsupportedMegatronOption

__all__ = ["megatron_lm_args", "check_megatron_lm_run", "SWIGLU_FSDP_DTENSOR"]

SWIGLU_FSDP_DTENSOR = (
    "TransformerConfig.gated_linear_unit=True (--swiglu) with Megatron-LM's --ckpt-format fsdp_dtensor "
    "checkpoints is not supported by shardwise: checkpointing.py's handle_swiglu_in_state_dict splits "
    "each linear_fc1 into _w/_v halves by reading Megatron-FSDP's parameter attributes "
    "megatron_fsdp_slice and megatron_fsdp_dist_index, which shardwise's parameters do not have. "
    "Instead: train the SwiGLU model without Megatron-LM's --save/--load (checkpoint with "
    "torch.distributed.checkpoint on the chunk's state_dict()), or run it on Megatron-FSDP itself "
    "(without use_in_megatron())."
)


def megatron_lm_args() -> Optional[Any]:
    """Megatron-LM's parsed arguments when a Megatron-LM training script has parsed them, else ``None``."""
    global_vars = sys.modules.get("megatron.training.global_vars")
    return getattr(global_vars, "_GLOBAL_ARGS", None) if global_vars is not None else None


def check_megatron_lm_run(config: Any) -> None:
    """Refuse, at wrap time, what the Megatron-LM run's flags ask for and the face cannot do."""
    args = megatron_lm_args()
    if args is None:
        return
    checkpoints = getattr(args, "save", None) or getattr(args, "load", None)
    if (getattr(config, "gated_linear_unit", False) and getattr(args, "ckpt_format", None) == "fsdp_dtensor"
            and checkpoints):
        raise UnsupportedMegatronOption(SWIGLU_FSDP_DTENSOR)
