"""Mixed-precision policy: which dtype each of the engine's buffers uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the engine's buffers.

    param_dtype: dtype of the model weights that forward and backward compute
        with (``None`` keeps each parameter's own dtype).
    main_params_dtype: dtype of the main weights the optimizer updates.
    main_grads_dtype: dtype gradients are accumulated in (and handed to the
        optimizer in).
    grad_comm_dtype: dtype gradients travel in during reduction
        (``None`` = ``main_grads_dtype``; bf16 halves the traffic).
    reduce_dtype: torch FSDP2's name for ``grad_comm_dtype`` (the dtype of the
        gradient reduce-scatter / all-reduce), so its policies carry over; give
        one of the two. Unlike torch, leaving both out reduces in
        ``main_grads_dtype`` (fp32), not in ``param_dtype``.
    output_dtype, cast_forward_inputs: torch FSDP2's other two fields, not built
        here (shardwise casts neither the inputs nor the outputs of forward):
        refused by name unless left out (or ``cast_forward_inputs=False``).
    """

    param_dtype: torch.dtype | None = None
    main_params_dtype: torch.dtype = torch.float32
    main_grads_dtype: torch.dtype = torch.float32
    grad_comm_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool | None = None

    def __post_init__(self):
        if self.output_dtype is not None:
            raise NotImplementedError(
                f"MixedPrecisionPolicy(output_dtype={self.output_dtype}) is not built: shardwise does not cast "
                "forward's outputs; cast them in the model (or the loss) instead")
        if self.cast_forward_inputs:
            raise NotImplementedError(
                "MixedPrecisionPolicy(cast_forward_inputs=True) is not built: shardwise does not cast forward's "
                "inputs to param_dtype (token ids need no cast); cast floating inputs yourself, or leave it out")
        if self.reduce_dtype is not None:
            if self.grad_comm_dtype is not None and self.grad_comm_dtype != self.reduce_dtype:
                raise ValueError(
                    f"MixedPrecisionPolicy(reduce_dtype={self.reduce_dtype}, grad_comm_dtype={self.grad_comm_dtype}): "
                    "two names for the gradient reduction's dtype that disagree; give one")
            object.__setattr__(self, "grad_comm_dtype", self.reduce_dtype)
        for field in ("param_dtype", "main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
            value = getattr(self, field)
            if value is None and field in ("param_dtype", "grad_comm_dtype"):
                continue
            if value not in _FLOATS:
                raise ValueError(
                    f"MixedPrecisionPolicy.{field}={value!r} is not a floating dtype "
                    f"the engine can shard; use one of {[str(d) for d in _FLOATS]}"
                )

    def compute_dtype(self, original: torch.dtype) -> torch.dtype:
        return self.param_dtype or original

    @property
    def comm_dtype(self) -> torch.dtype:
        return self.grad_comm_dtype or self.main_grads_dtype
