"""Tensor and expert parallelism on 2 gloo processes (4 for TP with EP) equal the single-rank model."""

import pytest
import torch
import torch.distributed as dist

from shardwise.models import (
    GPT,
    ColumnParallelLinear,
    GPTConfig,
    MoE,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_weights,
)

from tests.helpers.distributed import run_distributed

WORLD = 2


def _assert_sharded_grad(tp_param, full_param, rank, name=""):
    """``tp_param``'s data and grad are this rank's slice of ``full_param``'s (or all of it)."""
    if getattr(tp_param, "tensor_model_parallel", False):
        dim = tp_param.partition_dim
        data = full_param.detach().chunk(WORLD, dim)[rank]
        grad = full_param.grad.chunk(WORLD, dim)[rank]
    else:
        data, grad = full_param.detach(), full_param.grad
    torch.testing.assert_close(tp_param.detach(), data, rtol=0, atol=0, msg=f"{name} weight")
    torch.testing.assert_close(tp_param.grad, grad, rtol=1e-5, atol=1e-6, msg=f"{name} grad")


def _tp_linears():
    rank, group = dist.get_rank(), dist.group.WORLD
    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(0))
    for make in (
        lambda g: ColumnParallelLinear(8, 12, bias=True, group=g, gather_output=True),
        lambda g: torch.nn.Sequential(ColumnParallelLinear(8, 12, group=g),
                                      RowParallelLinear(12, 10, bias=True, group=g)),
    ):
        outs, mods = [], []
        for g in (None, group):
            torch.manual_seed(7)
            mod = make(g)
            init_weights(mod)
            xi = x.clone().requires_grad_()
            out = mod(xi)
            (out * torch.arange(out.numel()).view_as(out)).sum().backward()
            outs.append((out, xi.grad))
            mods.append(mod)
        torch.testing.assert_close(outs[1][0], outs[0][0])
        torch.testing.assert_close(outs[1][1], outs[0][1])  # input grads (copy-to-TP all-reduce)
        for (name, p_tp), p_full in zip(mods[1].named_parameters(), mods[0].parameters(), strict=True):
            _assert_sharded_grad(p_tp, p_full, rank, name)
    row = mods[1][1]
    assert row.weight.partition_dim == 1 and row.weight.tensor_model_parallel
    assert row.bias.tensor_model_parallel is False and row.bias.shape == (10,)

    ids = torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(1))
    embs = []
    for g in (None, group):
        torch.manual_seed(3)
        emb = VocabParallelEmbedding(16, 4, group=g)
        init_weights(emb)
        out = emb(ids)
        (out * torch.arange(out.numel()).view_as(out)).sum().backward()
        embs.append((emb, out))
    torch.testing.assert_close(embs[1][1], embs[0][1])
    _assert_sharded_grad(embs[1][0].weight, embs[0][0].weight, rank, "embedding")
    return True


def test_tp2_linears_and_embedding_match_tp1():
    assert run_distributed(_tp_linears, WORLD) == [True, True]


def _tp_gpt(tie):
    rank = dist.get_rank()
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    models, results = [], []
    for group in (None, dist.group.WORLD):
        config = GPTConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=48,
                           max_seq_len=16, layer_pattern="AEM", moe_num_experts=4, mamba_head_dim=16,
                           tie_embeddings=tie, tp_group=group)
        torch.manual_seed(11)
        model = GPT(config)
        logits = model(tokens)
        loss = model(tokens, targets)
        loss.backward()
        models.append(model)
        results.append((logits, loss))
    torch.testing.assert_close(results[1][0], results[0][0])
    torch.testing.assert_close(results[1][1], results[0][1])
    assert models[1].layers[0].attention.wq.weight.shape[0] == 32 // WORLD
    full = dict(models[0].named_parameters())
    for name, p in models[1].named_parameters():
        _assert_sharded_grad(p, full[name], rank, name)
    return True


def test_tp2_gpt_matches_tp1():
    assert run_distributed(_tp_gpt, WORLD, False) == [True, True]
    assert run_distributed(_tp_gpt, WORLD, True) == [True, True]


def _unsplit_moe(config: dict, xs: list, ws: list):
    """The reference: one MoE (seed 5) over every rank's tokens, backward of the weighted sum.
    Returns the module (its grads set), the input (its grad set) and the detached output."""
    torch.manual_seed(5)
    ref = MoE(GPTConfig(**config))
    init_weights(ref)
    x_all = torch.cat(xs).requires_grad_()
    out_all = ref(x_all)
    (out_all * torch.cat(ws)).sum().backward()
    return ref, x_all, out_all.detach()


def _ep_moe():
    rank = dist.get_rank()
    config = dict(dim=8, n_layers=1, n_heads=2, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden=12)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(WORLD)]
    xs = [torch.randn(3, 5, 8, generator=g) for g in gens]  # every rank's tokens differ
    ws = [torch.randn(3, 5, 8, generator=g) for g in gens]

    ref, x_all, out_all = _unsplit_moe(config, xs, ws)

    torch.manual_seed(5)
    ep = MoE(GPTConfig(**config, ep_group=dist.group.WORLD))
    init_weights(ep)
    assert ep.experts.w1.shape[0] == 2 and ep.experts.w1.allreduce is False
    x = xs[rank].clone().requires_grad_()
    out = ep(x)
    (out * ws[rank]).sum().backward()

    torch.testing.assert_close(out, out_all.detach().chunk(WORLD)[rank])
    torch.testing.assert_close(x.grad, x_all.grad.chunk(WORLD)[rank])
    router_grad = ep.router.grad.clone()
    dist.all_reduce(router_grad)  # each rank saw only its tokens
    torch.testing.assert_close(router_grad, ref.router.grad)
    for name in ("w1", "w2", "w3"):
        mine, full = getattr(ep.experts, name), getattr(ref.experts, name)
        torch.testing.assert_close(mine.detach(), full.detach().chunk(WORLD)[rank], rtol=0, atol=0)
        torch.testing.assert_close(mine.grad, full.grad.chunk(WORLD)[rank], msg=name)
    return True


def test_ep2_moe_matches_ep1():
    assert run_distributed(_ep_moe, WORLD) == [True, True]


def _ep_gpt():
    rank = dist.get_rank()
    tokens = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(0))
    losses = []
    for group, batch in ((None, tokens), (dist.group.WORLD, tokens.chunk(WORLD)[rank])):
        config = GPTConfig(vocab_size=64, dim=16, n_layers=2, n_heads=2, max_seq_len=16, layer_pattern="E",
                           moe_num_experts=4, moe_aux_loss_coef=0.0, ep_group=group)
        torch.manual_seed(3)
        losses.append(GPT(config)(batch, batch.roll(1, dims=1)).detach())
    dist.all_reduce(losses[1])
    torch.testing.assert_close(losses[1] / WORLD, losses[0])
    return True


def test_ep2_gpt_loss_matches_ep1():
    assert run_distributed(_ep_gpt, WORLD) == [True, True]


def _tp_ep_moe(layout):
    """4 ranks: TP groups [0, 1], [2, 3] (two data ranks); EP groups the TP groups (Megatron's layout with
    expert TP 1) or across them. Each data rank's tokens reach their experts once, whatever the EP ranks."""
    rank = dist.get_rank()
    groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1), (2, 3), (0, 2), (1, 3))}
    tp_group = groups[(0, 1) if rank < 2 else (2, 3)]
    ep_group = tp_group if layout == "aligned" else groups[(0, 2) if rank % 2 == 0 else (1, 3)]
    config = dict(dim=8, n_layers=1, n_heads=2, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden=12)
    gens = [torch.Generator().manual_seed(200 + d) for d in range(2)]
    xs = [torch.randn(3, 5, 8, generator=g) for g in gens]  # 15 tokens: TP shares of 8 and 7
    ws = [torch.randn(3, 5, 8, generator=g) for g in gens]
    data = rank // 2

    ref, x_all, out_all = _unsplit_moe(config, xs, ws)

    torch.manual_seed(5)
    moe = MoE(GPTConfig(**config, tp_group=tp_group, ep_group=ep_group))
    init_weights(moe)
    assert moe.split_tokens and moe.experts.w1.shape[0] == 2
    x = xs[data].clone().requires_grad_()
    out = moe(x)
    (out * ws[data]).sum().backward()

    torch.testing.assert_close(out, out_all.detach().chunk(2)[data])  # every TP rank has all its tokens' outputs
    torch.testing.assert_close(x.grad, x_all.grad.chunk(2)[data])
    router_grad = moe.router.grad.clone()
    dist.all_reduce(router_grad)  # TP peers hold the same (replicated) router gradient
    torch.testing.assert_close(router_grad / 2, ref.router.grad)
    local = moe.experts.local
    for name in ("w1", "w2", "w3"):
        mine, full = getattr(moe.experts, name), getattr(ref.experts, name)
        torch.testing.assert_close(mine.detach(), full.detach()[moe.experts.ep_rank * local:][:local], rtol=0, atol=0)
        summed = torch.zeros_like(full.grad)  # each expert's gradient summed over the ranks holding it
        summed[moe.experts.ep_rank * local:][:local] = mine.grad
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, full.grad, msg=name)  # a token counted twice would double it
    return True


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["aligned", "across"])
def test_tp2_ep2_moe_dispatches_each_token_once(layout):
    assert run_distributed(_tp_ep_moe, 4, layout) == [True] * 4
