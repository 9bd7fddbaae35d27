"""Context parallelism: each rank of a CP group holds a slice of every sequence.

Load balance (zig-zag): a sequence of ``T`` tokens is cut into ``2 * cp`` equal
chunks and CP rank ``i`` holds chunks ``i`` and ``2 * cp - 1 - i``, so under a
causal mask every rank has the same amount of attention work (an early chunk
sees few keys, its partner many).

Attention exchange (all-gather of K/V): every rank gathers the whole
sequence's keys and values, put in sequence order as they arrive (one copy),
and each query chunk attends to the keys before it (a prefix view) with the causal
mask aligned to its lower right (:func:`attend_gathered`), which flash attention
takes as a flag: no mask is built and masked blocks are skipped. Backward reduce-scatters the K/V gradients: each rank's keys
were read by every rank's queries. This is the simplest exchange that is
exact for zig-zag causal attention, and the one Megatron-Core (``a2a`` /
``allgather`` CP comm types) and torchtitan offer besides the ring; a ring
(pass K/V chunk by chunk, overlapping the next chunk's transfer with this
chunk's attention, never holding the whole sequence's K/V) scales better on
GPUs and is left for later. GQA gathers only the ``n_kv_heads`` heads.

The loss under CP is the token mean over the whole sequence:
:func:`global_token_mean` sums each rank's token losses and counts over the CP
group (the counts differ when targets are ignored), not a mean of chunk means.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .tensor_parallel import group_rank, group_size

__all__ = [
    "zigzag_chunks",
    "zigzag_positions",
    "zigzag_split",
    "zigzag_unsplit",
    "gather_sequence",
    "context_parallel_attention",
    "attend_gathered",
    "global_token_mean",
]


def zigzag_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of ``2 * cp``) CP rank ``rank`` holds."""
    return rank, 2 * cp - 1 - rank


def _check_split(seq_len: int, cp: int) -> int:
    if seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2 * cp = {2 * cp} "
            f"(context parallelism cuts each sequence into 2 * cp equal chunks)"
        )
    return seq_len // (2 * cp)


def zigzag_positions(local_len: int, rank: int, cp: int, device=None) -> torch.Tensor:
    """Global positions of the ``local_len`` tokens a CP rank holds (its two chunks, in order)."""
    if local_len % 2:
        raise ValueError(f"a CP rank's sequence length {local_len} must be even (two equal chunks)")
    chunk = local_len // 2
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in zigzag_chunks(rank, cp)])


def zigzag_split(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This CP rank's slice of full sequences ``x`` (its two zig-zag chunks along ``dim``)."""
    cp = group_size(group)
    if cp == 1:
        return x
    _check_split(x.shape[dim], cp)
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[c] for c in zigzag_chunks(group_rank(group), cp)], dim=dim)


def zigzag_unsplit(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequences from every CP rank's slice (``parts[i]`` from rank ``i``): the inverse of
    :func:`zigzag_split`."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        a, b = zigzag_chunks(rank, cp)
        chunks[a], chunks[b] = first, second
    return torch.cat(chunks, dim=dim)


def _rank_slices(x: torch.Tensor, cp: int, dim: int) -> list[torch.Tensor]:
    """Each CP rank's zig-zag slice of the whole sequence ``x`` (contiguous, rank order)."""
    chunks = x.chunk(2 * cp, dim=dim)
    return [torch.cat([chunks[c] for c in zigzag_chunks(rank, cp)], dim=dim) for rank in range(cp)]


class _GatherSequence(torch.autograd.Function):
    """All-gather of every rank's zig-zag slice along ``dim``, put in sequence order, forward; reduce-scatter
    (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(group_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return zigzag_unsplit(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        cp, rank = group_size(ctx.group), group_rank(ctx.group)
        if dist.get_backend(ctx.group) == "nccl":
            pieces = _rank_slices(grad, cp, ctx.dim)
            out = torch.empty_like(pieces[rank])
            dist.reduce_scatter(out, pieces, group=ctx.group)
        else:  # gloo has no reduce-scatter: sum everything, keep this rank's slice
            total = grad.contiguous().clone()
            dist.all_reduce(total, group=ctx.group)
            chunks = total.chunk(2 * cp, dim=ctx.dim)
            out = torch.cat([chunks[c] for c in zigzag_chunks(rank, cp)], dim=ctx.dim)
        return out, None, None


def gather_sequence(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The whole sequence, in sequence order, from every CP rank's zig-zag slice ``x`` along ``dim``
    (autograd-correct: the inverse of :func:`zigzag_split` across the group)."""
    return x if group_size(group) == 1 else _GatherSequence.apply(x, group, dim)


def context_parallel_attention(q, k, v, group, *, causal: bool = True, dropout_p: float = 0.0,
                               enable_gqa: bool = False) -> torch.Tensor:
    """SDPA of this CP rank's queries against the whole sequence's keys and values.

    ``q``, ``k``, ``v`` are ``[batch, heads, local_seq, head_dim]`` holding this rank's zig-zag chunks;
    the keys and values are all-gathered into sequence order and attended by :func:`attend_gathered`.
    """
    cp, rank = group_size(group), group_rank(group)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal,
                                              enable_gqa=enable_gqa)
    keys, values = gather_sequence(k, group, 2), gather_sequence(v, group, 2)
    return attend_gathered(q, keys, values, rank, cp, causal=causal, dropout_p=dropout_p, enable_gqa=enable_gqa)


def attend_gathered(q, keys, values, rank: int, cp: int, *, causal: bool, dropout_p: float = 0.0,
                    enable_gqa: bool = False) -> torch.Tensor:
    """CP rank ``rank``'s attention, given the whole sequence's keys and values in sequence order.

    Causal: each of the rank's two query chunks (chunk ``c``, positions ``c*L .. (c+1)*L``) attends to
    the keys of chunks ``0 .. c`` with the causal mask aligned to the lower right (query ``c*L + i`` sees
    keys ``<= c*L + i``), torch's :func:`~torch.nn.attention.bias.causal_lower_right`. Flash and
    memory-efficient SDPA take that mask as a flag, so the masked-out blocks are skipped and no mask is
    built: a rank does ``1 / cp`` of the unsplit sequence's attention work. Full attention (``causal=False``)
    is one SDPA over all keys.
    """
    if not causal:
        return F.scaled_dot_product_attention(q, keys, values, dropout_p=dropout_p, enable_gqa=enable_gqa)
    chunk = q.shape[2] // 2
    outs = []
    for queries, c in zip(q.split(chunk, dim=2), zigzag_chunks(rank, cp)):
        seen = (c + 1) * chunk
        k_seen, v_seen = keys.narrow(2, 0, seen), values.narrow(2, 0, seen)  # views: the keys before the chunk
        if c == 0:  # a square block: plain causal
            outs.append(F.scaled_dot_product_attention(queries, k_seen, v_seen, dropout_p=dropout_p,
                                                       is_causal=True, enable_gqa=enable_gqa))
        else:
            # imported here: torch.nn.attention.bias imports torch._dynamo, seconds of every process's start
            from torch.nn.attention.bias import causal_lower_right

            mask = causal_lower_right(chunk, seen)
            outs.append(F.scaled_dot_product_attention(queries, k_seen, v_seen, attn_mask=mask,
                                                       dropout_p=dropout_p, enable_gqa=enable_gqa))
    return torch.cat(outs, dim=2)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) forward and backward: every rank holds the same total, and the gradient a rank's
    term receives is the sum of every rank's upstream gradient (each rank backpropagates the same loss)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def global_token_mean(loss_sum: torch.Tensor, count: torch.Tensor, group) -> torch.Tensor:
    """The token mean over the whole sequences: every CP rank's ``loss_sum`` over every rank's ``count``.

    Each CP rank returns the same value and backpropagates it; its gradient is then ``cp`` times this
    rank's share, so averaging gradients over the CP ranks (as data parallelism averages over its
    ranks) gives exactly the gradient of the one loss.
    """
    if group_size(group) == 1:
        return loss_sum / count
    total = count.detach().clone()
    dist.all_reduce(total, group=group)
    return _SumOverGroup.apply(loss_sum, group) / total
