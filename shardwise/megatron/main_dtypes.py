"""The engine's dtypes from Megatron's configs, with Megatron-FSDP's meaning for each release.

Megatron-Core 0.19 (and shardwise's config) name them in the DDP config, where
``None`` is Megatron-LM's ``auto`` (``--megatron-fsdp-main-params-dtype auto``):

- ``megatron_fsdp_main_params_dtype=None``: no main-weight buffer; the compute
  weights are the main weights (their dtype: ``bf16``/``fp16`` from the model
  config, else the model's own).
- ``megatron_fsdp_main_grads_dtype=None``: gradients are accumulated in the
  compute dtype (Megatron-LM's default: bf16 gradients for a bf16 model;
  ``grad_reduce_in_fp32`` is not read by Megatron-FSDP 0.19).
- ``megatron_fsdp_grad_comm_dtype=None``: reduced in the main grads' dtype.

Megatron-Core 0.16 has none of these fields; its Megatron-FSDP keeps fp32 main
weights when ``preserve_fp32_weights`` (else the compute weights) and fp32
gradients when ``grad_reduce_in_fp32`` (else the compute dtype). A config object
without ``megatron_fsdp_main_grads_dtype`` is read that way.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn as nn

from ..engine.precision import MixedPrecisionPolicy

__all__ = ["mixed_precision_for", "is_016_ddp_config"]


def _dtype(value, field: str) -> Optional[torch.dtype]:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and isinstance(getattr(torch, value.replace("torch.", ""), None), torch.dtype):
        return getattr(torch, value.replace("torch.", ""))
    raise ValueError(f"{field}={value!r} is not a torch dtype")


def is_016_ddp_config(raw_ddp: Any) -> bool:
    """Whether ``raw_ddp`` is a Megatron-Core 0.16 DDP config (no Megatron-FSDP dtype fields)."""
    return raw_ddp is not None and not hasattr(raw_ddp, "megatron_fsdp_main_grads_dtype")


def _model_dtype(module: nn.Module, field: str) -> torch.dtype:
    """The one floating dtype of the model's parameters (what ``auto`` follows without bf16/fp16)."""
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(
            f"{field}=None ('auto': the model's parameter dtype) but the parameters have dtypes "
            f"{sorted(str(d) for d in dtypes)}; give the dtype (e.g. torch.float32)")
    return dtypes.pop()


def mixed_precision_for(cfg, ddp, raw_ddp: Any, module: nn.Module) -> MixedPrecisionPolicy:
    """The engine's policy: compute dtype from ``cfg`` (bf16/fp16), main weights, main grads and
    wire dtype from ``ddp`` (the mirror) read as the release of ``raw_ddp`` means them."""
    param_dtype = torch.bfloat16 if cfg.bf16 else torch.float16 if cfg.fp16 else None

    def compute(field: str) -> torch.dtype:
        return param_dtype or _model_dtype(module, field)

    if is_016_ddp_config(raw_ddp):
        main_params = torch.float32 if ddp.preserve_fp32_weights else compute("preserve_fp32_weights")
        main_grads = torch.float32 if ddp.grad_reduce_in_fp32 else compute("grad_reduce_in_fp32")
        comm = None
    else:
        main_params = _dtype(ddp.megatron_fsdp_main_params_dtype, "megatron_fsdp_main_params_dtype") \
            or compute("megatron_fsdp_main_params_dtype")
        main_grads = _dtype(ddp.megatron_fsdp_main_grads_dtype, "megatron_fsdp_main_grads_dtype") \
            or compute("megatron_fsdp_main_grads_dtype")
        comm = _dtype(ddp.megatron_fsdp_grad_comm_dtype, "megatron_fsdp_grad_comm_dtype")
    # Megatron-FSDP keeps a model-weight buffer in the compute dtype beside the main weights: so does the
    # face (cast once per optimizer step; on one GPU forward then reads that shard itself, no cast per micro-batch)
    return MixedPrecisionPolicy(param_dtype=param_dtype, main_params_dtype=main_params,
                                main_grads_dtype=main_grads, grad_comm_dtype=comm, keep_compute_weights=True)
