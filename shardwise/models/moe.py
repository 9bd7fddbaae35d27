"""Mixture of experts: top-k router, SwiGLU experts, optional expert parallelism.

Each token goes to its ``top_k`` highest-probability experts; their outputs are
summed with the renormalized router probabilities. No capacity limit: no token
is dropped. The Switch-Transformer load-balancing loss

    aux = num_experts * sum_i f_i * P_i,
    f_i = share of the N*top_k assignments that went to expert i (no gradient),
    P_i = mean router probability of expert i over the N tokens,

is left on ``MoE.aux_loss`` after every forward (1.0 when perfectly balanced).

Expert parallelism: with an ``ep_group`` of size ``ep``, EP rank r holds experts
``[r * E/ep, (r+1) * E/ep)``. Routed tokens travel to the rank owning their
expert and back with ``all_to_all_single`` (an autograd function: the backward
is the reverse exchange). Expert weights are stacked per rank under
``.experts.`` and carry ``allreduce=False`` (Megatron's mark for parameters whose
gradients are reduced over the expert-data-parallel group only).

Tensor parallelism with expert parallelism (experts whole on each EP rank,
Megatron's ``expert_tensor_parallel_size=1``): the attention and dense layers
around the MoE are tensor-parallel, so every rank of a ``tp_group`` holds the
same tokens. Dispatched as they are, each token would reach its experts once per
TP rank and their gradients would count it that many times. So the router runs
on all tokens (it is TP-replicated, its gradient stays identical on the TP
ranks), then each TP rank dispatches only its share of the tokens
(``tp_rows``), and the combined outputs are all-gathered over the TP group
again: what Megatron's sequence parallelism does around its MoE layers. The
EP group may be any ranks (in Megatron's layout it is the TP group); each
token still reaches its experts exactly once. With one EP rank the experts
are TP-replicated instead and every TP rank runs them on all its tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .tensor_parallel import (
    _init_slice_,
    gather_rows_from_tp_region,
    group_rank,
    group_size,
    scaled_init_std,
    scatter_rows_to_tp_region,
    tp_rows,
)

__all__ = ["MoE", "Experts", "load_balancing_loss"]


def load_balancing_loss(probs: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
    """Switch-style balance loss from router ``probs [N, E]`` and chosen ``expert_idx [N, k]``."""
    num_experts = probs.shape[-1]
    counts = torch.bincount(expert_idx.flatten(), minlength=num_experts)
    f = counts.float() / expert_idx.numel()
    return num_experts * (f * probs.mean(0)).sum()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits),) + x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(grad, in_splits, out_splits, ctx.group), None, None, None


class Experts(nn.Module):
    """This rank's experts as stacked SwiGLU weights ``[local_experts, ...]``."""

    def __init__(self, config: GPTConfig, num_experts: int, ep_rank: int, ep: int):
        super().__init__()
        self.num_experts, self.ep_rank, self.local = num_experts, ep_rank, num_experts // ep
        self.dim, self.hidden = config.dim, config.moe_ffn_hidden
        self.std, self.out_std = config.init_std, scaled_init_std(config.init_std, config.n_layers)
        self.w1 = nn.Parameter(torch.empty(self.local, self.hidden, self.dim))  # gate
        self.w3 = nn.Parameter(torch.empty(self.local, self.hidden, self.dim))  # up
        self.w2 = nn.Parameter(torch.empty(self.local, self.dim, self.hidden))  # down
        for p in (self.w1, self.w3, self.w2):
            p.allreduce = False

    def reset_parameters(self) -> None:
        e, h, d = self.num_experts, self.hidden, self.dim
        _init_slice_(self.w1, (e, h, d), 0, self.ep_rank, self.std)
        _init_slice_(self.w3, (e, h, d), 0, self.ep_rank, self.std)
        _init_slice_(self.w2, (e, d, h), 0, self.ep_rank, self.out_std)

    def forward(self, x, counts: list[int]):
        """``x`` holds tokens grouped by local expert, ``counts[i]`` rows for expert i."""
        outs = []
        for i, chunk in enumerate(x.split(counts)):
            h = F.silu(chunk @ self.w1[i].t()) * (chunk @ self.w3[i].t())
            outs.append(h @ self.w2[i].t())
        return torch.cat(outs)


class MoE(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ep_group, self.ep = config.ep_group, group_size(config.ep_group)
        self.tp_group = config.tp_group
        # TP peers hold the same tokens; under EP each dispatches its share (see the module docstring)
        self.split_tokens = self.ep > 1 and group_size(self.tp_group) > 1
        self.num_experts, self.top_k = config.moe_num_experts, config.moe_top_k
        if self.num_experts % self.ep:
            raise ValueError(f"moe_num_experts={self.num_experts} is not divisible by the EP size {self.ep}")
        self.init_std = config.init_std
        self.router = nn.Parameter(torch.empty(self.num_experts, config.dim))  # replicated
        self.experts = Experts(config, self.num_experts, group_rank(config.ep_group), self.ep)
        self.aux_loss = None

    def reset_parameters(self) -> None:
        nn.init.normal_(self.router, 0.0, self.init_std)

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs = F.linear(tokens, self.router).float().softmax(-1)
        weights, idx = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        self.aux_loss = load_balancing_loss(probs, idx)
        if self.split_tokens:
            n = tokens.shape[0]
            idx = idx[tp_rows(n, self.tp_group)]
            tokens = scatter_rows_to_tp_region(tokens, self.tp_group)
            weights = scatter_rows_to_tp_region(weights, self.tp_group)

        flat = idx.flatten()  # assignment j = token j // top_k, expert flat[j]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        out = self._run_experts(tokens[order // self.top_k], counts)
        out = out * weights.flatten()[order, None].to(out.dtype)
        out = torch.zeros_like(tokens).index_add_(0, order // self.top_k, out)
        if self.split_tokens:
            out = gather_rows_from_tp_region(out, n, self.tp_group)
        return out.view(shape)

    def _run_experts(self, routed, counts):
        if self.ep == 1:
            return self.experts(routed, counts.tolist())
        local = self.num_experts // self.ep
        # how many rows each rank sends me, per local expert: [ep, local]
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        recv_counts = recv_counts.view(self.ep, local)
        send_splits = counts.view(self.ep, local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = _AllToAll.apply(routed, recv_splits, send_splits, self.ep_group)
        # received is source-major; the experts want expert-major
        src, expert = torch.meshgrid(torch.arange(self.ep), torch.arange(local), indexing="ij")
        key = (expert * self.ep + src).flatten().to(counts.device)
        key = key.repeat_interleave(recv_counts.flatten())
        regroup = key.argsort(stable=True)
        out = self.experts(received[regroup], recv_counts.sum(0).tolist())
        out = out[regroup.argsort()]
        return _AllToAll.apply(out, send_splits, recv_splits, self.ep_group)
