"""Quantized weight gathers: a group's weights travel as FP8 bytes, and forward reads those bytes.

A parameter marked with :data:`GATHER_ATTR` (``param.shardwise_gather =
Fp8Tensorwise(wrap)``; ``shardwise.engine.fp8`` marks the weights of torchao's
``Float8Linear``) is gathered in its own group. Once per optimizer step (the
first gather after the main weights changed) the group takes each parameter's
largest magnitude over its fp32 main-weight piece, one all-reduce (MAX) of
those amaxes over the axes that shard the main weights gives every rank the
whole parameter's, and the scales follow (``e4m3 max / amax``, as a
tensorwise cast of the whole weight computes them). Each gather casts this
rank's main piece with its parameter's scale into a uint8 buffer with the same
slots as the compute-dtype one, and gathers those bytes (half of bf16's). The
unsharded parameters the modules see wrap the gathered slots and the shared
scale (``wrap``: torchao's ``Float8TrainingTensor``), so the linear uses them
without casting again. The tensors stay the same objects step after step
(their storage is regathered, their scale updated in place), as compiled
units need.

The engine knows nothing of torchao: ``wrap(data, scale, dtype)`` comes with
the mark. Gradients are untouched (bf16 from the matmul, reduced as usual);
the DTensor parameters are the fp32 main weights.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .distributed_buffer import DistributedBuffer, Levels

__all__ = ["GATHER_ATTR", "Fp8Tensorwise", "QuantizedGather", "gather_mark", "tensorwise_scales", "cast_to_e4m3"]

GATHER_ATTR = "shardwise_gather"
"""The parameter attribute that asks for a quantized gather (an :class:`Fp8Tensorwise`)."""

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
AMAX_FLOOR = 1e-12  # an all-zero weight gets a finite scale (torchao's floor too)


class Fp8Tensorwise:
    """Gather this weight as e4m3 bytes with one scale for the whole (global) tensor.

    ``wrap(data, scale, dtype)`` turns the gathered e4m3 weight (shaped like
    the parameter), its 0-d fp32 scale and the compute dtype into what forward
    reads.
    """

    kind = "fp8_tensorwise"

    def __init__(self, wrap: Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]):
        if not callable(wrap):
            raise TypeError(f"Fp8Tensorwise(wrap={wrap!r}): wrap must be callable")
        self.wrap = wrap

    def __repr__(self) -> str:
        return "Fp8Tensorwise()"


def gather_mark(param: torch.Tensor) -> Fp8Tensorwise | None:
    mark = getattr(param, GATHER_ATTR, None)
    if mark is not None and not isinstance(mark, Fp8Tensorwise):
        raise TypeError(f"parameter attribute {GATHER_ATTR}={mark!r} is not a shardwise.engine.quantized_gather.Fp8Tensorwise")
    return mark


def tensorwise_scales(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scales from fp32 amaxes: ``e4m3 max / max(amax, floor)``, divided in fp64 (as torchao does, so
    eager and compiled casts agree)."""
    return (E4M3_MAX / torch.clamp(amax.to(torch.float64), min=AMAX_FLOOR)).to(torch.float32)


def cast_to_e4m3(values: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (e4m3) = ``values`` x ``scale`` in fp32, saturated to e4m3's range."""
    out.copy_((values.to(torch.float32) * scale).clamp_(-E4M3_MAX, E4M3_MAX))


class QuantizedGather:
    """One group's FP8 gather: the shared scales, the cast into uint8 slots, the tensors forward reads."""

    wire_dtype = torch.uint8

    def __init__(self, levels: Levels, marks: Sequence[Fp8Tensorwise], compute_dtype: torch.dtype):
        self.levels = levels
        self.marks = list(marks)
        self.compute_dtype = compute_dtype
        self.axes = [a for a in levels.axes if a.size > 1]  # the axes that shard the main weights
        self.scales = torch.ones(len(self.marks), dtype=torch.float32, device=levels.device)
        self.stale = True  # the main weights changed since the scales were taken
        self._nonempty: tuple | None = None

    def update_scales(self, main: DistributedBuffer) -> None:
        """Every parameter's global amax (one all-reduce over the group's axes), then its scale."""
        pieces = main.locals()
        amax = torch.zeros(len(pieces), dtype=torch.float32, device=self.levels.device)
        if self._nonempty is None:  # an empty piece (a rank past the last rows) contributes 0
            full = [i for i, t in enumerate(pieces) if t.numel()]
            self._nonempty = (full, torch.tensor(full, dtype=torch.long, device=amax.device))
        full, index = self._nonempty
        if full:
            norms = torch._foreach_norm([pieces[i] for i in full], ord=float("inf"))
            amax[index] = torch.stack(norms).to(torch.float32)
        if self.axes:
            self.levels.collectives.all_reduce_max(amax, self.axes)
        self.scales.copy_(tensorwise_scales(amax))
        self.stale = False

    def quantize(self, main: DistributedBuffer, out: DistributedBuffer) -> None:
        """Cast ``main``'s slots into ``out``'s (uint8, the same slot sizes), each with its parameter's
        scale, saturated: a multiply, a clamp and a cast per parameter. (A per-element scale spread
        over the whole buffer by ``repeat_interleave`` cost 6 ms per 0.9B layer on an H200: CUDA runs
        that op one thread per slot.) Padding casts too (zeros in the main buffer); nothing reads it."""
        for source, target, scale in zip(main.views(), out.views(), self.scales):
            cast_to_e4m3(source, scale, target.view(E4M3))

    def source(self, main: DistributedBuffer, unsharded: DistributedBuffer, staged: list) -> DistributedBuffer:
        """What the gather into ``unsharded`` reads: the cast main pieces (scales first if stale)."""
        if self.stale:
            self.update_scales(main)
        levels = self.levels
        if levels.same_layout(0, main.level):  # one rank per axis: cast straight into the gathered slots
            self.quantize(main, unsharded)
            return DistributedBuffer(levels, main.level, None, views=unsharded.views())
        out = levels.staged(main.level, self.wire_dtype, staged)
        self.quantize(main, out)
        return out

    def compute_tensor(self, unsharded: DistributedBuffer, i: int) -> torch.Tensor:
        """Parameter ``i`` as forward reads it: its gathered e4m3 rows with its shared scale."""
        data = unsharded.local(i).view(E4M3)
        return self.marks[i].wrap(data, self.scales[i], self.compute_dtype)
