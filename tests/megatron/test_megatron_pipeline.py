"""V1 chunks under pipeline parallelism, driven as Megatron's pipelined schedules drive them (4 gloo processes).

PP2 x DP2 from Megatron's own ``parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)``
and ``ProcessGroupCollection.use_mpu_process_groups()``, with Megatron-Core's ``TransformerConfig`` and
``DistributedDataParallelConfig``. Each rank wraps its stage's chunk (with virtual stages, one wrapper per
chunk) of a small LM split by layers; the chunks carry the stage attributes Megatron's
``finalize_model_grads`` reads from a GPTModel (``pre_process``, ``post_process``,
``share_embeddings_and_output_weights``). Megatron's schedules allocate their p2p buffers on the current
CUDA device, so the schedule runs by hand: activations and gradients go over the ``pp`` group with
``send``/``recv``, and the chunks are called as Megatron's schedules call them when Megatron-LM sets
``no_sync_func`` and ``grad_sync_func`` (its default with ``--overlap-grad-reduce``): every backward under
``no_sync``, except the first stage's last one without virtual stages; ``start_grad_sync`` after a chunk's
last backward where that backward did not sync; then Megatron-Core's own ``finalize_model_grads(chunks)``
(with tied embeddings, which it cannot finish for sharded chunks, the fix V1's warning names).
Clipping by the norm over both stages (``clip_grad_norm_(..., extra_groups=[pp])``); every loss, norm and
full parameter agrees with one process training the whole model on the whole batch (fp32, rtol 1e-5).
The run on GPUs with Megatron's GPTModel and schedules: ``scripts/megatron_lm_step.py --pp 2``.
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig as RealDDPConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.process_groups_config import ProcessGroupCollection as RealProcessGroups
from megatron.core.transformer import TransformerConfig as RealTransformerConfig

import shardwise
from shardwise.megatron import FullyShardedDataParallelV1, FullyShardedDataParallelV2, TransformerConfig
from shardwise.megatron.process_groups import ProcessGroupCollection
from shardwise.megatron.v1 import _check_pipeline_size, _warn_if_tied_across_stages

from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import assert_close_states, micro_batch_losses, state_of, train_clipped
from tests.helpers.tiny_model import Block, TinyConfig

CONFIG = TinyConfig(layers=4, reuse_last_block=False)
PP, GLOBAL_BATCH, MICRO_BATCHES, STEPS = 2, 8, 2, 3
MAX_NORM = 0.5  # below every step's gradient norm here, so clipping bites (asserted)


class StageLM(nn.Module):
    """A small LM; a stage is a copy with the other stages' parts set to None (the whole model's names)."""

    def __init__(self, c: TinyConfig, tied: bool = False):
        super().__init__()
        self.pre_process = self.post_process = True
        self.share_embeddings_and_output_weights = tied
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleDict({str(i): Block(c) for i in range(c.layers)})
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def shared_embedding_or_output_weight(self):
        return self.embed.weight if self.pre_process else self.head.weight

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def stage_of(model: StageLM, index: int, count: int) -> StageLM:
    """Virtual stage ``index`` of ``count``: its share of the blocks, the embedding first, norm and head last."""
    part = copy.deepcopy(model)
    per = len(model.blocks) // count
    for name in list(part.blocks):
        if not index * per <= int(name) < (index + 1) * per:
            del part.blocks[name]
    part.pre_process, part.post_process = index == 0, index == count - 1
    if not part.pre_process:
        part.embed = None
    if not part.post_process:
        part.norm = part.head = None
    if part.share_embeddings_and_output_weights and part.post_process and not part.pre_process:
        part.head.weight.shared = part.head.weight.shared_embedding = True  # as Megatron's LanguageModule marks it
    return part


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Learnable sequences (arithmetic progressions mod the vocabulary): tokens and next tokens."""
    g = torch.Generator().manual_seed(900 + step)
    start = torch.randint(0, CONFIG.vocab, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    data = (start + stride * torch.arange(CONFIG.seq + 1)) % CONFIG.vocab
    return data[:, :-1], data[:, 1:]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def _real_configs(strategy: str):
    config = RealTransformerConfig(num_layers=CONFIG.layers, hidden_size=CONFIG.dim, num_attention_heads=CONFIG.heads,
                                   pipeline_model_parallel_size=PP, pipeline_dtype=torch.float32)
    ddp = RealDDPConfig(use_megatron_fsdp=True, use_distributed_optimizer=True, overlap_grad_reduce=True,
                        data_parallel_sharding_strategy=strategy)
    return config, ddp


def _run_schedule(chunks, stages, count, pp, tokens, targets):
    """One step's forwards and backwards, micro-batch by micro-batch (GPipe order), as Megatron's schedules
    call the chunks given ``no_sync_func`` and ``grad_sync_func``; returns the last stage's micro-batch losses."""
    pp_rank, world = dist.get_rank(pp), dist.get_world_size(pp)
    peer = {+1: dist.get_global_rank(pp, (pp_rank + 1) % world), -1: dist.get_global_rank(pp, (pp_rank - 1) % world)}
    shape = (tokens.shape[0] // MICRO_BATCHES, tokens.shape[1], CONFIG.dim)
    no_sync = contextlib.ExitStack()  # Megatron's multi_no_sync: every chunk's no_sync at once
    for chunk in chunks:
        no_sync.enter_context(chunk.no_sync())
    sends, saved, losses = [], [], []
    for m in range(MICRO_BATCHES):  # forwards
        rows = slice(m * shape[0], (m + 1) * shape[0])
        for v, (chunk, s) in enumerate(zip(chunks, stages)):
            if s == 0:
                x = tokens[rows]
            else:
                x = torch.empty(shape, device=tokens.device)
                dist.recv(x, peer[-1], group=pp)
                x.requires_grad_()
            y = chunk(x)
            if s == count - 1:
                y = lm_loss(y, targets[rows]) / MICRO_BATCHES  # Megatron's forward_step divides by the count
                losses.append(y.detach())
            else:
                sends.append(dist.isend(y.detach(), peer[+1], group=pp))
            saved.append((v, x, y))
    synced = set()
    for m in range(MICRO_BATCHES):  # backwards: each micro-batch through the stages in reverse
        for v, x, y in reversed(saved[m * len(chunks):(m + 1) * len(chunks)]):
            last = m == MICRO_BATCHES - 1
            if last and len(chunks) == 1 and stages[v] == 0:  # the first stage's last backward syncs
                no_sync.close()
                synced.add(v)
            if stages[v] == count - 1:
                y.backward()
            else:
                grad = torch.empty_like(y)
                dist.recv(grad, peer[+1], group=pp)
                y.backward(grad)
            if stages[v] > 0:
                sends.append(dist.isend(x.grad, peer[-1], group=pp))
    no_sync.close()
    for v, chunk in enumerate(chunks):  # grad_sync_func after the chunk's last backward, where it did not sync
        if v not in synced:
            chunk.start_grad_sync(chunk.parameters())
    for work in sends:
        work.wait()
    return losses


def _finalize(chunks, tied: bool) -> None:
    """Megatron-Core's own ``finalize_model_grads``; with tied embeddings, which it cannot finish for
    sharded chunks (the warning), the fix the warning names: its DP sync, then the tied weight's local
    gradient shard all-reduced over the embedding group."""
    if not tied:
        finalize_model_grads(chunks)  # finish_grad_sync on every chunk, then the PP syncs
        return
    for chunk in chunks:
        chunk.finish_grad_sync()
    group = parallel_state.get_embedding_group()
    weight = chunks[0].sharded_model.shared_embedding_or_output_weight()
    dist.all_reduce(weight.grad.to_local(), group=group)  # both ends shard the weight alike


def _clip(params, pp) -> float:
    """Clip by the norm over both stages, the duplicate of a tied weight counted once (as Megatron does)."""
    counted = [p for p in params if not getattr(p, "shared", False)]
    norm = shardwise.clip_grad_norm_(counted, MAX_NORM, extra_groups=[pp])
    coefficient = torch.clamp(MAX_NORM / (norm + 1e-6), max=1.0)
    for p in params:
        if getattr(p, "shared", False) and p.grad is not None:
            p.grad.to_local().mul_(coefficient)
    return norm.item()


def _train_pipeline(strategy: str, virtual: int, tied: bool = False):
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP)
    try:
        pg = RealProcessGroups.use_mpu_process_groups()
        config, ddp = _real_configs(strategy)
        dev, pp = device(), pg.pp
        count, pp_rank = PP * virtual, dist.get_rank(pp)
        stages = [pp_rank + v * PP for v in range(virtual)]
        torch.manual_seed(0)
        whole = StageLM(CONFIG, tied)
        # one wrapper per chunk; Megatron-LM disables bucketing for the chunks after the first
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            chunks = [FullyShardedDataParallelV1(config, ddp, stage_of(whole, s, count).to(dev),
                                                 disable_bucketing=v > 0, device=dev, pg_collection=pg)
                      for v, s in enumerate(stages)]
        assert any("share_embeddings_and_output_weights=True" in str(w.message) for w in said) == tied
        params = [p for chunk in chunks for p in chunk.parameters()]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-6)
        dp_rank, dp = dist.get_rank(pg.dp_cp), dist.get_world_size(pg.dp_cp)
        rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
        holds_last = count - 1 in stages
        losses, norms, own = [], [], []
        for step in range(STEPS):
            tokens, targets = (t[rows].to(dev) for t in batch(step))
            for chunk in chunks:
                chunk.zero_grad_buffer()
            micro = _run_schedule(chunks, stages, count, pp, tokens, targets)
            _finalize(chunks, tied)
            norms.append(_clip(params, pp))
            opt.step()
            for chunk in chunks:
                chunk.start_param_sync()
            opt.zero_grad()
            own.append([loss.item() * MICRO_BATCHES for loss in micro])  # each micro-batch's mean loss
            total = torch.stack(micro).sum() if holds_last else torch.zeros((), device=dev)
            dist.all_reduce(total)  # the last stage's ranks hold the losses: their mean over data ranks
            losses.append(total.item() / dp)
        state = {}
        for chunk in chunks:
            state.update(shardwise.full_state_dict(chunk.sharded_model))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, state)
        own = (rows, own) if holds_last else None  # this rank's rows and its losses, before any reduction
        return losses, norms, {k: v for s in gathered for k, v in s.items()}, own
    finally:
        parallel_state.destroy_model_parallel()


def _train_reference(tied: bool = False, rows: slice | None = None):
    """The whole model on the whole batch; with ``rows``, also the micro-batch losses of those rows,
    by the model as it is before each step (what a last stage holding them must compute)."""
    torch.manual_seed(0)
    model = StageLM(CONFIG, tied).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)
    own = []

    def batches():  # train_clipped takes the next batch after the previous step
        for step in range(STEPS):
            tokens, targets = (t.to(device()) for t in batch(step))
            if rows is not None:
                own.append(micro_batch_losses(model, lm_loss, tokens[rows], targets[rows], MICRO_BATCHES))
            yield tokens, targets

    losses, norms = train_clipped(model, opt, batches(), lm_loss, MAX_NORM)
    return losses, norms, state_of(model), own


def _parity(strategy: str, virtual: int, tied: bool = False) -> int:
    """Parity with one process; returns how many of its own micro-batch losses this rank checked."""
    losses, norms, state, own = _train_pipeline(strategy, virtual, tied)
    ref_losses, ref_norms, ref_state, ref_own = _train_reference(tied, own[0] if own else None)
    if own is not None:  # this rank's own losses, before the all-reduce: its rows, not just the right mean
        torch.testing.assert_close(torch.tensor(own[1], dtype=torch.float64),
                                   torch.tensor(ref_own, dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(norms, dtype=torch.float64),
                               torch.tensor(ref_norms, dtype=torch.float64), rtol=1e-5, atol=0)
    assert min(ref_norms) > MAX_NORM, ref_norms  # clipping changed every step
    assert losses[-1] < losses[0] - 0.05, losses  # not two untrained models agreeing
    assert_close_states(state, ref_state, rtol=1e-5)
    return 0 if own is None else sum(len(step) for step in own[1])


@pytest.mark.slow
@pytest.mark.parametrize("strategy,virtual,tied", [
    ("optim", 1, False),  # ZeRO-1: the first stage reduces in its last backward, the second in start_grad_sync
    ("optim_grads_params", 1, False),  # ZeRO-3: reduce-scattered every micro-batch, the window closed once
    ("optim_grads_params", 2, False),  # virtual stages: two wrappers per rank, every chunk through start_grad_sync
    ("optim", 1, True),  # tied embeddings: warned about; the named fix trains as one process
])
def test_pp2_dp2_chunks_train_as_one_process(strategy, virtual, tied):
    checked = run_distributed(_parity, 4, strategy, virtual, tied)
    # every rank holding the last stage (the two data ranks of pp rank 1) checked all its micro-batch losses
    assert sum(checked) == 4 // PP * STEPS * MICRO_BATCHES, checked


# ------------------------------------------------------------------ what is refused or said
def _refusals() -> list[str]:
    """V1 with a config that disagrees with the pp group, V2 with PP: the messages."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=PP)
    try:
        pg = RealProcessGroups.use_mpu_process_groups()
        messages = []
        config, ddp = _real_configs("optim_grads_params")
        ddp.megatron_fsdp_version = 2
        whole = StageLM(CONFIG)
        for cls, pp_size in ((FullyShardedDataParallelV1, 1), (FullyShardedDataParallelV2, PP),
                             (FullyShardedDataParallelV2, 1)):
            config.pipeline_model_parallel_size = pp_size
            with pytest.raises(ValueError) as err:
                cls(config, ddp, stage_of(whole, dist.get_rank(pg.pp), PP), device=device(), pg_collection=pg)
            messages.append(str(err.value))
        return messages
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.slow
def test_pipeline_size_disagreeing_with_the_pp_group_and_v2_refuse_by_name():
    for v1_config, v2_config, v2_group in run_distributed(_refusals, 4):
        assert "pipeline_model_parallel_size=1 needs pg_collection.pp with 1 ranks, got 2 ranks" in v1_config
        assert re.search(r"does not support pipeline_model_parallel_size=2\b", v2_config), v2_config
        assert "pg_collection.pp of size 1, got 2" in v2_group, v2_group


def test_pipeline_size_needs_the_pp_group():
    with pytest.raises(ValueError, match=re.escape("pipeline_model_parallel_size=2 needs pg_collection.pp with "
                                                   "2 ranks, got missing")):
        _check_pipeline_size(TransformerConfig(pipeline_model_parallel_size=2), ProcessGroupCollection())
    _check_pipeline_size(TransformerConfig(), ProcessGroupCollection())  # no pp group, no pipeline: fine


def test_tied_embeddings_across_stages_are_said():
    # Megatron-Core's finalize_model_grads assigns the tied weight's local shard as .grad (0.16.1-0.19.2)
    first = stage_of(StageLM(CONFIG), 0, 2)
    first.share_embeddings_and_output_weights = True
    with pytest.warns(UserWarning, match=r"share_embeddings_and_output_weights=True with "
                                         r"pipeline_model_parallel_size=2: .*--untie-embeddings-and-output-weights"):
        _warn_if_tied_across_stages(first, 2)
    wrapped = type("Float16Module", (nn.Module,), {})()
    wrapped.module = first
    with pytest.warns(UserWarning, match="share_embeddings_and_output_weights=True"):
        _warn_if_tied_across_stages(wrapped, 2)  # found down the .module chain, as Megatron finds it
    middle = stage_of(StageLM(CONFIG), 1, 4)
    middle.share_embeddings_and_output_weights = True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_if_tied_across_stages(middle, 4)  # holds neither end
        _warn_if_tied_across_stages(first, 1)  # no pipeline
