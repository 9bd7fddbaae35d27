"""A pipeline of shardwise GPT stages on a (pp, [dp_outer,] dp_shard[, tp]) mesh, and its one-process reference.

Stages come from ``shardwise.models.pipeline_stage`` (an equal share of a seeded
GPT's layers under the whole model's parameter names, so the stages' state
dicts together are the GPT's and a pipeline checkpoint loads into an unsplit
GPT). With ``tp`` > 1 the GPT is built tensor-parallel (its layers split their
weights over the TP group; logits are gathered), and a seeded TP model equals
the seeded TP=1 one.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

import shardwise
from shardwise.models import GPT, GPTConfig, TransformerLayer, pipeline_stage
from shardwise.engine.pipeline import ShardedPipelineStage, build_schedule, pipeline_groups
from tests.helpers.distributed import device
from tests.helpers.parity import micro_batch_losses, state_of

SEQ = 16


def gpt_config(**overrides) -> GPTConfig:
    base = dict(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=SEQ)
    base.update(overrides)
    return GPTConfig(**base)


def seeded_gpt(config: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def gpt_batch(step: int, size: int, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, vocab, (size, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# ------------------------------------------------------------------ a pipeline of GPT stages on a mesh
MICRO_BATCHES = 4
GLOBAL_BATCH = 8
LR, WEIGHT_DECAY = 2e-3, 0.1
VIRTUAL = {"interleaved": 2, "looped_bfs": 2, "zbv": 2, "interleaved_zb": 2}  # stages per rank; the others hold one


class Pipeline:
    """This rank's part of a pipeline of :class:`GPTStage` on a ``(pp, [dp_outer,] dp_shard[, tp])`` mesh.

    ``outer`` > 0 adds ``dp_outer`` (each stage HSDP over ``(dp_outer, dp_shard)``), ``tp`` > 1 the
    innermost ``tp`` axis (the GPT built tensor-parallel, each stage sharded on ``(dp_shard, tp)``).
    ``parts`` are this rank's stage modules, ``params`` their parameters, ``opts`` an AdamW for each part.
    """

    def __init__(self, schedule: str, pp: int, strategy="optim_grads_params", *, outer: int = 0, tp: int = 1,
                 config: GPTConfig | None = None, seed: int = 0, collectives=None):
        world, dev = dist.get_world_size(), device()
        dp = world // (pp * tp)
        names, shape = ["pp"], [pp]
        if outer:
            names.append("dp_outer"), shape.append(outer)
        names.append("dp_shard"), shape.append(dp // (outer or 1))
        if tp > 1:
            names.append("tp"), shape.append(tp)
        self.mesh = init_device_mesh(dev.type, tuple(shape), mesh_dim_names=tuple(names))
        dp_axes = tuple(n for n in names if n != "pp")
        self.dp, self.dp_rank = dp, 0
        for axis in ("dp_outer", "dp_shard"):
            if axis in names:
                self.dp_rank = self.dp_rank * self.mesh[axis].size() + self.mesh[axis].get_local_rank()
        self.tp = tp
        self.pp_group, pp_rank, _ = pipeline_groups(self.mesh)
        virtual = VIRTUAL.get(schedule, 1)
        count = pp * virtual
        config = config or gpt_config()
        if tp > 1:
            config = copy.copy(config)
            config.tp_group = self.mesh["tp"].get_group()
        whole = seeded_gpt(config, seed).to(dev)
        if schedule == "zbv":  # V-shaped: rank r holds stages r and 2 pp - 1 - r
            self.indices = [pp_rank, count - 1 - pp_rank]
        else:
            self.indices = [pp_rank + v * pp for v in range(virtual)]
        extra = {"outer_dp_sharding_strategy": "no_shard"} if outer else {}
        self.parts = [shardwise.fully_shard(pipeline_stage(whole, i, count), self.mesh[dp_axes], strategy=strategy,
                                            unit_modules=[TransformerLayer], collectives=collectives, **extra)
                      for i in self.indices]
        self.stages = [ShardedPipelineStage(part, i, count, group=self.pp_group)
                       for part, i in zip(self.parts, self.indices)]
        self.schedule = build_schedule(schedule, self.stages, MICRO_BATCHES, lm_loss)
        self.params = [p for part in self.parts for p in part.parameters()]
        # one optimizer per stage, as a pipeline checkpoint wants them (AdamW is per parameter: the same steps)
        self.opts = [torch.optim.AdamW(part.parameters(), lr=LR, weight_decay=WEIGHT_DECAY) for part in self.parts]
        self.first = any(s.is_first for s in self.stages)
        self.last = any(s.is_last for s in self.stages)
        self.rows = slice(self.dp_rank * GLOBAL_BATCH // dp, (self.dp_rank + 1) * GLOBAL_BATCH // dp)
        self.own_losses: list[float] = []  # the last step's micro-batch losses on this rank, before any reduction

    def step(self, step: int, max_norm: float) -> tuple[float, float]:
        """One step on this rank's rows of global batch ``step``: (mean loss over the batch, grad norm)."""
        dev = device()
        tokens, targets = (t[self.rows].to(dev) for t in gpt_batch(step, GLOBAL_BATCH))
        losses = []
        self.schedule.step(*((tokens,) if self.first else ()), target=targets if self.last else None,
                           losses=losses if self.last else None)
        norm = shardwise.clip_grad_norm_(self.params, max_norm, extra_groups=[self.pp_group]).item()
        for opt in self.opts:
            opt.step()
            opt.zero_grad()
        self.own_losses = [loss.item() for loss in losses]
        total = torch.stack(losses).mean().detach() if self.last else torch.zeros((), device=dev)
        dist.all_reduce(total)  # every last-stage rank (dp x tp of them) holds its rows' mean
        return total.item() / (self.dp * self.tp), norm

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's full state dict (every stage's, gathered on every rank)."""
        state = {}
        for part in self.parts:
            state.update(shardwise.full_state_dict(part))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, state)
        return {k: v for s in gathered for k, v in s.items()}


class Reference:
    """The unsplit TP=1 GPT of the same seed on one process, trained on the whole global batch."""

    def __init__(self, config: GPTConfig | None = None, seed: int = 0):
        self.model = seeded_gpt(config or gpt_config(), seed).to(device())
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def step(self, step: int, max_norm: float) -> tuple[float, float]:
        tokens, targets = (t.to(device()) for t in gpt_batch(step, GLOBAL_BATCH))
        loss = lm_loss(self.model(tokens), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        self.opt.step()
        self.opt.zero_grad()
        return loss.item(), norm

    def micro_losses(self, step: int, rows: slice) -> list[float]:
        """The micro-batch losses of ``rows`` of batch ``step`` by the model as it is now (before ``step``)."""
        tokens, targets = (t[rows].to(device()) for t in gpt_batch(step, GLOBAL_BATCH))
        return micro_batch_losses(self.model, lm_loss, tokens, targets, MICRO_BATCHES)

    def state(self) -> dict[str, torch.Tensor]:
        return state_of(self.model)
