"""Megatron-style tensor-parallel layers over a TP process group.

Column-parallel splits a weight's output rows (``partition_dim=0``), row-parallel
its input columns (``partition_dim=1``) and sums the partial outputs; the
vocab-parallel embedding splits the vocabulary rows. Sharded weights carry
``tensor_model_parallel=True`` and ``partition_dim``; the replicated bias of a
row-parallel layer carries ``tensor_model_parallel=False``.

The row functions (``scatter_rows_to_tp_region`` / ``gather_rows_from_tp_region``)
share out rows every TP rank holds alike (the MoE layer's tokens under expert
parallelism) and gather them back.

With ``group=None`` or a group of one rank the collectives vanish and the layers
are plain linears / embeddings. Initialization draws the *full* weight from the
default generator on every rank and keeps this rank's slice, so a model seeded
the same way is identical for any TP size.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

__all__ = [
    "Linear",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "gather_from_tp_region",
    "tp_rows",
    "scatter_rows_to_tp_region",
    "gather_rows_from_tp_region",
    "group_size",
    "group_rank",
]


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward (sum partial outputs); identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(group_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        part = grad.chunk(group_size(ctx.group), dim=-1)[group_rank(ctx.group)]
        return part.contiguous(), None


def _rows(n: int, tp: int, rank: int) -> slice:
    base, extra = divmod(n, tp)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


def tp_rows(n: int, group) -> slice:
    """This TP rank's share of ``n`` rows: near-equal consecutive pieces, the first ``n % tp`` one longer
    (every rank gets a piece, possibly empty, so the pieces line up with the ranks)."""
    return _rows(n, group_size(group), group_rank(group))


def _all_gather_rows(x: torch.Tensor, n: int, group) -> torch.Tensor:
    """Every TP rank's ``tp_rows(n)`` piece, in rank order (padded to one size on the wire)."""
    tp = group_size(group)
    width = -(-n // tp)
    padded = x.new_zeros((width,) + tuple(x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(tp)]
    dist.all_gather(parts, padded, group=group)
    pieces = [_rows(n, tp, r) for r in range(tp)]
    return torch.cat([part[: piece.stop - piece.start] for part, piece in zip(parts, pieces)])


class _ScatterRowsToTP(torch.autograd.Function):
    """Keep this rank's rows of a TP-replicated tensor forward; all-gather the rows' gradients backward
    (each TP rank computed the gradient of its own rows only)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[0]
        return x[tp_rows(ctx.n, group)].clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad.contiguous(), ctx.n, ctx.group), None


class _GatherRowsFromTP(torch.autograd.Function):
    """All-gather the TP ranks' rows forward (the result is TP-replicated); keep this rank's rows of the
    gradient backward (replicated too, so nothing is summed)."""

    @staticmethod
    def forward(ctx, x, n, group):
        ctx.group, ctx.n = group, n
        return _all_gather_rows(x.contiguous(), n, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[tp_rows(ctx.n, ctx.group)].contiguous(), None, None


def scatter_rows_to_tp_region(x, group):
    """This TP rank's :func:`tp_rows` of ``x`` (identical on every TP rank), dim 0."""
    return x if group_size(group) == 1 else _ScatterRowsToTP.apply(x, group)


def gather_rows_from_tp_region(x, n, group):
    """The ``n`` rows whose :func:`tp_rows` pieces the TP ranks hold, on every TP rank (the inverse)."""
    return x if group_size(group) == 1 else _GatherRowsFromTP.apply(x, n, group)


def copy_to_tp_region(x, group):
    return x if group_size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp_region(x, group):
    return x if group_size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_tp_region(x, group):
    return x if group_size(group) == 1 else _GatherFromTP.apply(x, group)


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {tp}")
    return n // tp


@torch.no_grad()
def _init_slice_(param: nn.Parameter, full_shape, dim: int, rank: int, std: float) -> None:
    """Draw the full weight (normal, ``std``) and copy this rank's slice into ``param``."""
    full = torch.empty(full_shape, device=param.device, dtype=torch.float32).normal_(0.0, std)
    param.copy_(full.chunk(full_shape[dim] // param.shape[dim], dim=dim)[rank])


def _mark(param: nn.Parameter, dim: int | None) -> nn.Parameter:
    param.tensor_model_parallel = dim is not None
    if dim is not None:
        param.partition_dim = dim
    return param


class Linear(nn.Module):
    """A replicated (never split) linear with the same init, for layers TP leaves whole."""

    def __init__(self, in_features, out_features, bias=False, init_std=0.02):
        super().__init__()
        self.init_std = init_std
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, 0.0, self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with W's output rows split over TP ranks."""

    def __init__(self, in_features, out_features, bias=False, group=None,
                 gather_output=False, init_std=0.02):
        super().__init__()
        self.group, self.gather_output, self.init_std = group, gather_output, init_std
        self.tp, self.rank = group_size(group), group_rank(group)
        self.in_features, self.out_features = in_features, out_features
        local = _split(out_features, self.tp, "out_features")
        self.weight = _mark(nn.Parameter(torch.empty(local, in_features)), 0)
        self.bias = _mark(nn.Parameter(torch.empty(local)), 0) if bias else None

    def reset_parameters(self) -> None:
        _init_slice_(self.weight, (self.out_features, self.in_features), 0, self.rank, self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        y = F.linear(copy_to_tp_region(x, self.group), self.weight, self.bias)
        return gather_from_tp_region(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``y = sum_ranks(x_r W_r^T) + b``: W's input columns split, output all-reduced."""

    def __init__(self, in_features, out_features, bias=False, group=None, init_std=0.02):
        super().__init__()
        self.group, self.init_std = group, init_std
        self.tp, self.rank = group_size(group), group_rank(group)
        self.in_features, self.out_features = in_features, out_features
        local = _split(in_features, self.tp, "in_features")
        self.weight = _mark(nn.Parameter(torch.empty(out_features, local)), 1)
        self.bias = _mark(nn.Parameter(torch.empty(out_features)), None) if bias else None

    def reset_parameters(self) -> None:
        _init_slice_(self.weight, (self.out_features, self.in_features), 1, self.rank, self.init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):  # x is already split on its last dim (the TP region)
        y = reduce_from_tp_region(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split; out-of-range ids look up zeros."""

    def __init__(self, num_embeddings, embedding_dim, group=None, init_std=0.02):
        super().__init__()
        self.group, self.init_std = group, init_std
        self.tp, self.rank = group_size(group), group_rank(group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        local = _split(num_embeddings, self.tp, "vocab_size")
        self.vocab_start, self.vocab_end = self.rank * local, (self.rank + 1) * local
        self.weight = _mark(nn.Parameter(torch.empty(local, embedding_dim)), 0)

    def reset_parameters(self) -> None:
        _init_slice_(self.weight, (self.num_embeddings, self.embedding_dim), 0, self.rank, self.init_std)

    def forward(self, ids):
        if self.tp == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.group)


def scaled_init_std(std: float, n_layers: int) -> float:
    """Std for projections that write into the residual stream (GPT-2 style)."""
    return std / math.sqrt(2 * n_layers)
