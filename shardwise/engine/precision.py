"""Mixed-precision policy: which dtype each of the engine's buffers uses.

shardwise's own ``MixedPrecisionPolicy`` names every buffer; torch FSDP2's
``MixedPrecisionPolicy`` (``torch.distributed.fsdp``) is accepted as it is by
``fully_shard(mp_policy=...)`` and read with torch's meaning
(:func:`from_torch_policy`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.utils import _apply_to_tensors  # FSDP2's own walk of forward inputs and outputs

__all__ = ["MixedPrecisionPolicy", "from_torch_policy", "cast_floating", "CASTABLE_DTYPES"]

# Parameter dtypes a policy casts (and gradients exist for); others (integers, FP8) are kept as they are.
CASTABLE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the engine's buffers.

    param_dtype: dtype of the model weights that forward and backward compute
        with (``None`` keeps each parameter's own dtype).
    main_params_dtype: dtype of the main weights the optimizer updates
        (``None``, the default, keeps each parameter's own dtype, as FSDP2 does:
        a bf16 parameter stays bf16; ``torch.float32`` keeps fp32 main weights
        for low-precision parameters).
    main_grads_dtype: dtype gradients are accumulated in (and handed to the
        optimizer in); ``None`` is the main weights' dtype.
    grad_comm_dtype: dtype gradients travel in during reduction
        (``None`` = the main grads' dtype; bf16 halves the traffic).
    reduce_dtype: torch FSDP2's name for ``grad_comm_dtype``; give one of the
        two. (torch's own policy class, whose ``reduce_dtype=None`` means
        ``param_dtype``, is read with that meaning by ``fully_shard``.)
    output_dtype: forward's floating outputs of every unit are cast to it
        (``None``: left as computed).
    cast_forward_inputs: every unit casts the floating tensors among its
        forward's inputs to ``param_dtype`` (token ids are left alone).
    keep_compute_weights: keep the ``param_dtype`` weight shard at rest and cast it from the main
        weights once after each update, instead of casting right before every gather (Megatron-FSDP's
        layout: ``param_dtype`` bytes per parameter more at rest, divided by the shard size). Where
        the parameters' shard axes have one rank (one GPU) the gathered weights are then that shard
        itself: no cast, copy or allocation per micro-batch. ``False`` (FSDP2's way) keeps only the
        main weights at rest.
    """

    param_dtype: torch.dtype | None = None
    main_params_dtype: torch.dtype | None = None
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = False
    keep_compute_weights: bool = False

    def __post_init__(self):
        if self.reduce_dtype is not None:
            if self.grad_comm_dtype is not None and self.grad_comm_dtype != self.reduce_dtype:
                raise ValueError(
                    f"MixedPrecisionPolicy(reduce_dtype={self.reduce_dtype}, grad_comm_dtype={self.grad_comm_dtype}): "
                    "two names for the gradient reduction's dtype that disagree; give one")
            object.__setattr__(self, "grad_comm_dtype", self.reduce_dtype)
        for field in ("param_dtype", "main_params_dtype", "main_grads_dtype", "grad_comm_dtype", "output_dtype"):
            value = getattr(self, field)
            if value is not None and value not in _FLOATS:
                raise ValueError(
                    f"MixedPrecisionPolicy.{field}={value!r} is not a floating dtype "
                    f"the engine can shard; use one of {[str(d) for d in _FLOATS]}"
                )
        for field in ("cast_forward_inputs", "keep_compute_weights"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"MixedPrecisionPolicy.{field}={getattr(self, field)!r} must be a bool")

    def compute_dtype(self, original: torch.dtype) -> torch.dtype:
        return self.param_dtype or original

    def main_dtype(self, original: torch.dtype) -> torch.dtype:
        """The main weights' dtype for a parameter of dtype ``original``."""
        return self.main_params_dtype or original

    def main_grad_dtype(self, original: torch.dtype) -> torch.dtype:
        return self.main_grads_dtype or self.main_dtype(original)

    def comm_dtype(self, original: torch.dtype) -> torch.dtype:
        return self.grad_comm_dtype or self.main_grad_dtype(original)

    def cast_inputs(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """``(args, kwargs)`` with floating tensors cast to ``param_dtype`` when the policy says so."""
        if not self.cast_forward_inputs or self.param_dtype is None:
            return args, kwargs
        return cast_floating((args, kwargs), self.param_dtype)

    def cast_output(self, output: Any) -> Any:
        return output if self.output_dtype is None else cast_floating(output, self.output_dtype)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (others untouched).

    The containers walked are FSDP2's (its ``cast_forward_inputs`` and ``output_dtype`` use the same walk):
    dataclasses (rebuilt with ``dataclasses.replace``), dicts, namedtuples, lists, tuples and sets; a tensor in
    any other object is left as it is, as FSDP2 leaves it.
    """
    def cast(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    return _apply_to_tensors(cast, tree)


def from_torch_policy(policy: Any) -> MixedPrecisionPolicy:
    """torch FSDP2's ``MixedPrecisionPolicy`` as the engine's, with torch's meaning.

    FSDP2 keeps each sharded parameter (so the optimizer's weights and grads)
    in its own dtype, computes in ``param_dtype`` and reduces in
    ``reduce_dtype``, which ``None`` makes ``param_dtype``.
    """
    param_dtype = policy.param_dtype
    return MixedPrecisionPolicy(
        param_dtype=param_dtype,
        grad_comm_dtype=policy.reduce_dtype or param_dtype,
        output_dtype=policy.output_dtype,
        cast_forward_inputs=bool(policy.cast_forward_inputs),
    )
