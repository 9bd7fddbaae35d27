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
    """

    param_dtype: torch.dtype | None = None
    main_params_dtype: torch.dtype = torch.float32
    main_grads_dtype: torch.dtype = torch.float32
    grad_comm_dtype: torch.dtype | None = None

    def __post_init__(self):
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
