"""The Megatron face under context parallelism (4 gloo processes).

The groups are Megatron-Core's own (``parallel_state.initialize_model_parallel(context_parallel_size=2)``
on gloo, then its ``ProcessGroupCollection.use_mpu_process_groups()``): ``dp_cp`` is every rank of a
TP rank, and the wrappers shard over it. The model is shardwise's reference GPT built with
``cp_group = parallel_state.get_context_parallel_group()``: each rank trains its zig-zag slice of its
data rank's rows. Every rank also trains the unsplit GPT on the whole global batch in this process;
losses (fp32, rtol 1e-5) and every full tensor must agree (``tests.helpers.parity``). Some targets are
ignored (-100), so the CP ranks of a data rank count different tokens and a mean of per-rank means
would be off: the losses must be whole-sequence token means (the GPT's) or per-token sums
(``calculate_per_token_loss``). (Every data rank counts the same tokens: a mean over data ranks is
what the wrappers' gradient average is, with or without CP.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

import shardwise
from shardwise.megatron import (
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    FullyShardedDataParallelV1,
    FullyShardedDataParallelV2,
    TransformerConfig,
)
from shardwise.models import GPT, GPTConfig
from shardwise.models.context_parallel import zigzag_split

from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import assert_close_states, compare, megatron_hooks, state_of, train_both

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 3, 4, 16, 64


def _gpt_config(**overrides) -> GPTConfig:
    fields = dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=SEQ)
    fields.update(overrides)
    return GPTConfig(**fields)


def _seeded(config: GPTConfig):
    def build():
        torch.manual_seed(0)
        return GPT(config)

    return build


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic progressions mod VOCAB; two targets of every row ignored, both in its last chunk (of
    ``2 cp``), so every data rank counts the same tokens but CP rank 0 (chunks 0 and 3) fewer than rank 1."""
    g = torch.Generator().manual_seed(800 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    data = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    targets = data[:, 1:].clone()
    targets[:, [SEQ - 3, SEQ - 1]] = -100
    return data[:, :-1], targets


def _ddp(version: int, strategy: str) -> DistributedDataParallelConfig:
    return DistributedDataParallelConfig(use_megatron_fsdp=True, megatron_fsdp_version=version,
                                         data_parallel_sharding_strategy=strategy)


def _cp_loss(wrapped, tokens, targets):
    """The GPT's loss (the whole rows' token mean) on this CP rank's zig-zag slice of the rows."""
    group = wrapped.sharded_model.config.cp_group
    return wrapped(zigzag_split(tokens, group), zigzag_split(targets, group))


def _reference_loss(model, tokens, targets):
    return model(tokens, targets)


def _sgd(model):
    # SGD, not Adam, as tests/engine/test_context_parallel_fsdp.py: CP sums K/V gradients and token losses in
    # another order than one process, and Adam divides each element by its own scale, turning fp32 rounding on
    # a near-zero gradient element into a whole step; with SGD the weights move by the gradients themselves
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _check_sharding(wrapped, pg, tp: int) -> None:
    plan = wrapped.sharded_state.plan
    names = plan.mesh.mesh_dim_names
    assert names == (("dp_shard", "tp") if tp > 1 else ("dp_shard",)), names
    # the data-parallel axis is Megatron's dp_cp group itself: data x context ranks
    assert plan.mesh.get_group("dp_shard") is pg.dp_cp and plan.dp_size == dist.get_world_size(pg.dp_cp)
    weight = wrapped.sharded_model.layers[0].attention.wq.weight
    assert isinstance(weight, DTensor) and weight.shape == (32, 32)
    assert weight.placements[names.index("dp_shard")] == Shard(0)


def _train_case(pg, version: int, strategy: str, tp: int) -> None:
    def wrap(model):
        config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                   tensor_model_parallel_size=tp, context_parallel_size=2)
        wrapped = FullyShardedDataParallel(config, _ddp(version, strategy), model, device=device(),
                                           pg_collection=pg)
        assert isinstance(wrapped, FullyShardedDataParallelV1 if version == 1 else FullyShardedDataParallelV2)
        _check_sharding(wrapped, pg, tp)
        return wrapped

    cp_model = _gpt_config(cp_group=pg.cp, tp_group=pg.tp if tp > 1 else None)
    sharded, reference = train_both(
        _seeded(cp_model), wrap, _sgd, _batch, STEPS, loss=_cp_loss, data_rank=dist.get_rank(pg.dp),
        data_ranks=dist.get_world_size(pg.dp), hooks=megatron_hooks(), loss_group=pg.dp_cp,
        full_state=lambda wrapped: shardwise.full_state_dict(wrapped.sharded_model), reference=_seeded(_gpt_config()),
        reference_backward=lambda model, *rows: _backward(_reference_loss(model, *rows)),
    )
    compare(sharded, reference, trained_by=0.1)


def _backward(loss):
    loss.backward()
    return loss


def _per_token_case(pg) -> None:
    """``calculate_per_token_loss=True``, Megatron's way: each rank's loss is the sum over its own tokens,
    gradients are summed over ``dp_cp`` and then scaled by one over the tokens of all ``dp_cp`` ranks
    (``finalize_model_grads``' ``scale_gradients``). Uneven counts over CP ranks are exact."""
    dev = device()
    model = _seeded(_gpt_config(cp_group=pg.cp))()
    single = _seeded(_gpt_config())().to(dev)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, context_parallel_size=2,
                               calculate_per_token_loss=True)
    wrapped = FullyShardedDataParallel(config, _ddp(1, "optim_grads"), model, device=dev, pg_collection=pg)
    tokens, targets = (t.to(dev) for t in _batch(0))
    dp, dp_rank = dist.get_world_size(pg.dp), dist.get_rank(pg.dp)
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    mine, my_targets = zigzag_split(tokens[rows], pg.cp), zigzag_split(targets[rows], pg.cp)
    logits = wrapped(mine)
    loss = F.cross_entropy(logits.flatten(0, 1), my_targets.flatten(), reduction="sum")
    loss.backward()
    count = (my_targets != -100).sum().float()
    counts = [torch.zeros_like(count) for _ in range(dist.get_world_size(pg.cp))]
    dist.all_gather(counts, count, group=pg.cp)
    assert len({c.item() for c in counts}) > 1, "the CP ranks should count different tokens"
    dist.all_reduce(count, group=pg.dp_cp)
    wrapped.finish_grad_sync()
    wrapped.scale_gradients(1.0 / count.item())
    torch.optim.SGD(wrapped.parameters(), lr=1.0).step()
    single(tokens, targets).backward()
    with torch.no_grad():
        for p in single.parameters():
            p -= p.grad
    assert_close_states(shardwise.full_state_dict(wrapped.sharded_model), state_of(single))


def _refusals(pg) -> None:
    dev = device()
    cp2 = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, context_parallel_size=2)
    # a model that does not split its attention over CP: each rank's slice would train as whole rows
    with pytest.raises(NotImplementedError, match=r"context_parallel_size=2: the model's attention must be split "
                                                  r"over pg_collection.cp .* declares no context-parallel split"):
        FullyShardedDataParallel(cp2, _ddp(1, "optim_grads_params"), GPT(_gpt_config()), device=dev,
                                 pg_collection=pg)
    # split over another group than the collection's
    with pytest.raises(NotImplementedError, match=r"but it splits over \[0, 1, 2, 3\]"):
        FullyShardedDataParallel(cp2, _ddp(2, "optim_grads_params"), GPT(_gpt_config(cp_group=pg.dp_cp)),
                                 device=dev, pg_collection=pg)
    # the config says no CP, the groups say CP 2
    with pytest.raises(ValueError, match=r"context_parallel_size=1 needs pg_collection.cp with 1 ranks, got 2 ranks"):
        FullyShardedDataParallel(TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4),
                                 _ddp(1, "optim_grads_params"), GPT(_gpt_config(cp_group=pg.cp)), device=dev,
                                 pg_collection=pg)


def _with_megatron_groups(tp: int, cases) -> bool:
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection as MegatronGroups

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=2)
    try:
        pg = MegatronGroups.use_mpu_process_groups()
        assert pg.cp is parallel_state.get_context_parallel_group()
        rank = dist.get_rank()
        # Megatron's tp-cp-dp order: CP groups are ranks tp apart, dp_cp every rank of one TP rank
        assert dist.get_process_group_ranks(pg.cp) == [rank % tp + tp * i + (rank // (2 * tp)) * 2 * tp
                                                       for i in range(2)]
        assert dist.get_world_size(pg.dp_cp) == 4 // tp
        for case in cases:
            try:
                if case == "refusals":
                    _refusals(pg)
                elif case == "per_token":
                    _per_token_case(pg)
                else:
                    _train_case(pg, *case, tp=tp)
            except Exception as error:
                raise AssertionError(f"{case}: {error}") from error
    finally:
        parallel_state.destroy_model_parallel()
    return True


@pytest.mark.slow
@pytest.mark.parametrize("case", [(1, "optim_grads_params"), (1, "optim"), (2, "optim_grads_params"), "per_token",
                                  "refusals"])
def test_cp2_dp2_with_megatrons_groups(case):
    """V1 ZeRO-3 and ZeRO-1 (start_param_sync gathers the updated shards), V2 ZeRO-3 against one process;
    calculate_per_token_loss; the refusals. One case per initialize_model_parallel (its gloo groups are
    the slow part on CPU)."""
    assert run_distributed(_with_megatron_groups, 4, 1, [case]) == [True] * 4


@pytest.mark.slow
@pytest.mark.parametrize("case", [(1, "optim_grads_params"), (1, "optim")])
def test_cp2_tp2_with_megatrons_groups_matches_one_process(case):
    assert run_distributed(_with_megatron_groups, 4, 2, [case]) == [True] * 4
