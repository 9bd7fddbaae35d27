"""Context parallelism in the model: zig-zag chunks, attention and the GPT's loss under CP.

Attention under CP must equal attention over the whole sequence element-wise,
forward and backward (fp32, 1e-6: a few fp32 epsilons of O(1) outputs; the
gathered keys sum in another order); the GPT's loss must be the token mean over
whole sequences even when the ranks hold different numbers of counted tokens.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardwise.models import GPT, GPTConfig
from shardwise.models.context_parallel import (
    attend_gathered,
    context_parallel_attention,
    zigzag_positions,
    zigzag_split,
    zigzag_unsplit,
)

from tests.helpers.distributed import run_distributed

FP32_ATTENTION_TOL = 1e-6


def test_zigzag_chunks_cover_each_position_once_and_balance_causal_work():
    seq, cp = 32, 4
    positions = [zigzag_positions(seq // cp, r, cp) for r in range(cp)]
    assert torch.equal(torch.cat(positions).sort().values, torch.arange(seq))
    assert positions[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]  # chunks 0 and 7 of 8
    work = [int((p + 1).sum()) for p in positions]  # keys each rank's queries see under a causal mask
    assert len(set(work)) == 1, work
    x = torch.arange(2 * seq).view(2, seq)
    parts = [x[:, pos] for pos in positions]
    assert torch.equal(zigzag_unsplit(parts), x)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_each_rank_attending_the_gathered_keys_equals_unsplit_causal_attention(cp):
    """Every rank's chunks against the whole sequence's K/V, one process: forward and backward."""
    seq, g = 24 * cp, torch.Generator().manual_seed(cp)
    q, k, v = torch.randn(2, 4, seq, 8, generator=g), torch.randn(2, 2, seq, 8, generator=g), torch.randn(
        2, 2, seq, 8, generator=g)
    upstream = torch.randn(2, 4, seq, 8, generator=g)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)
    (expected * upstream).sum().backward()

    def rank_slice(t, rank):  # what zigzag_split gives rank `rank` of `cp`
        chunks = t.chunk(2 * cp, dim=2)
        return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=2)

    kv = [t.clone().requires_grad_() for t in (k, v)]
    gathered = [t * 1 for t in kv]  # what the gather hands attend_gathered: the whole sequence, in order
    queries = [rank_slice(q, r).requires_grad_() for r in range(cp)]
    outs = [attend_gathered(queries[r], *gathered, r, cp, causal=True, enable_gqa=True) for r in range(cp)]
    sum((o * rank_slice(upstream, r)).sum() for r, o in enumerate(outs)).backward()
    tol = dict(rtol=FP32_ATTENTION_TOL, atol=FP32_ATTENTION_TOL)
    torch.testing.assert_close(zigzag_unsplit([o.detach() for o in outs], dim=2), expected.detach(), **tol)
    torch.testing.assert_close(zigzag_unsplit([x.grad for x in queries], dim=2), full[0].grad, **tol)
    for name, mine, ref in zip("kv", kv, full[1:]):
        torch.testing.assert_close(mine.grad, ref.grad, **tol, msg=lambda m: f"d{name}: {m}")


def _gather_parts(x: torch.Tensor) -> list[torch.Tensor]:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return parts


def _attention_matches_unsplit():
    group, seq = dist.group.WORLD, 64
    g = torch.Generator().manual_seed(7)
    for causal in (True, False):
        q = torch.randn(2, 4, seq, 8, generator=g)
        k, v = torch.randn(2, 2, seq, 8, generator=g), torch.randn(2, 2, seq, 8, generator=g)  # GQA: 2 kv heads
        upstream = torch.randn(2, 4, seq, 8, generator=g)
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*full, is_causal=causal, enable_gqa=True)
        (expected * upstream).sum().backward()

        local = [zigzag_split(t, group, dim=2).requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*local, group, causal=causal, enable_gqa=True)
        (out * zigzag_split(upstream, group, dim=2)).sum().backward()
        tol = dict(rtol=FP32_ATTENTION_TOL, atol=FP32_ATTENTION_TOL)
        torch.testing.assert_close(zigzag_unsplit(_gather_parts(out.detach()), dim=2), expected.detach(), **tol)
        for name, mine, ref in zip("qkv", local, full):
            torch.testing.assert_close(zigzag_unsplit(_gather_parts(mine.grad), dim=2), ref.grad, **tol,
                                       msg=lambda m: f"causal={causal} d{name}: {m}")
    return True


def _config(**overrides) -> GPTConfig:
    base = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64)
    base.update(overrides)
    return GPTConfig(**base)


def _gpt_loss_is_the_whole_sequence_token_mean(recompute: bool):
    group, seq, cp = dist.group.WORLD, 64, dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 64, (2, seq + 1), generator=g)
    inputs, targets = tokens[:, :-1], tokens[:, 1:].clone()
    targets[:, :20] = -100  # ignored: 16 of rank 0's tokens (chunk 0), 4 of rank 1's (chunk 1)
    torch.manual_seed(0)
    reference = GPT(_config())
    ref_loss = reference(inputs, targets)
    ref_loss.backward()
    torch.manual_seed(0)
    model = GPT(_config(cp_group=group, activation_checkpointing=recompute)).train()
    loss = model(zigzag_split(inputs, group), zigzag_split(targets, group))
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    # each CP rank's gradients are cp times its share: their mean over the CP ranks is the one loss's gradient
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        torch.testing.assert_close(grad / cp, ref.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
    with torch.no_grad():
        logits = model(zigzag_split(inputs, group))
    torch.testing.assert_close(logits, zigzag_split(reference(inputs), group).detach(), rtol=1e-5, atol=1e-6)
    return True


def test_cp2_attention_equals_unsplit_attention_causal_and_full():
    assert run_distributed(_attention_matches_unsplit, 2) == [True, True]


@pytest.mark.parametrize("recompute", [False, True])
def test_cp2_gpt_loss_and_gradients_equal_the_unsplit_model(recompute):
    assert run_distributed(_gpt_loss_is_the_whole_sequence_token_mean, 2, recompute) == [True, True]


def _refusals():
    with pytest.raises(NotImplementedError, match="layer_pattern='AE'.*attention layers"):
        GPT(_config(layer_pattern="AE", cp_group=dist.group.WORLD))
    model = GPT(_config(cp_group=dist.group.WORLD))
    with pytest.raises(ValueError, match="sequence length 80 > max_seq_len=64"):
        model(torch.zeros(1, 40, dtype=torch.long))
    with pytest.raises(ValueError, match="must be divisible by 2 \\* cp = 4"):
        zigzag_split(torch.zeros(1, 30), dist.group.WORLD)
    return True


def test_cp_refuses_moe_layers_and_too_long_sequences():
    assert run_distributed(_refusals, 2) == [True, True]
