"""Pipeline x FSDP: torch's schedules over stages ``fully_shard`` wrapped train as one process does.

Each rank holds one stage (two, interleaved) of a small transformer split by
layers, sharded over its data-parallel sub-mesh; a reference trains the whole
model on the whole global batch in the same process. Every parameter's full
tensor (gathered per stage, then across stages) and every loss must agree, with
clipping by the norm over all stages.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.distributed.device_mesh import init_device_mesh

import shardwise
from shardwise.engine.model_ops import sharded_state
from shardwise.engine.pipeline import ShardedPipelineStage, build_schedule, pipeline_groups
from tests.helpers.counting import CountingCollectives
from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import assert_close_states, micro_batch_losses, state_of, train_clipped
from tests.helpers.tiny_model import Block, TinyConfig, batch

CONFIG = TinyConfig(layers=4)
MICRO_BATCHES = 4
GLOBAL_BATCH = 8
MAX_NORM = 0.5  # below the gradients' norm in every step here, so clipping bites (asserted)


class PipeLM(nn.Module):
    """Embedding, blocks, norm and head; a stage is a copy with the other parts set to None,
    so its parameters keep the whole model's names. The last block runs twice (a unit called
    twice in one forward, with several micro-batches' forwards in flight)."""

    def __init__(self, c: TinyConfig):
        super().__init__()
        self.reuse_last_block = c.reuse_last_block
        self.checkpointing = c.checkpointing
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleDict({str(i): Block(c) for i in range(c.layers)})
        self.norm = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = self._run(block, x)
        if self.head is not None:
            if self.reuse_last_block:
                x = self._run(list(self.blocks.values())[-1], x)
            x = self.head(self.norm(x))
        return x


    def _run(self, block, x):
        if self.checkpointing == "none":
            return block(x)
        return checkpoint(block, x, use_reentrant=self.checkpointing == "reentrant")


def stage_module(model: PipeLM, index: int, count: int) -> PipeLM:
    """Stage ``index`` of ``count``: an equal share of the blocks, the embedding first, norm and head last."""
    part = copy.deepcopy(model)
    per = len(model.blocks) // count
    keep = {str(i) for i in range(index * per, (index + 1) * per)}
    for name in list(part.blocks):
        if name not in keep:
            del part.blocks[name]
    if index != 0:
        part.embed = None
    if index != count - 1:
        part.norm = part.head = None
    return part


def lm_loss(logits, targets):
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def _train_pipeline(schedule_name: str, pp: int, strategy, steps: int, collectives=None, save_to=None, outer=None,
                    config: TinyConfig = CONFIG):
    """Train the pipeline ``steps`` steps; return (losses, norms, full state, per-step collective counts, own):
    ``own`` is None on a rank without the last stage, else (its rows of the global batch, each step's
    micro-batch losses as the schedule computed them, before any reduction).

    ``save_to``: a folder for a DCP checkpoint of every stage's state dict under the whole model's names;
    ``outer``: a (pp, dp_outer, dp_shard) mesh with ``outer`` replicas, each stage HSDP over the last two."""
    world, dev = dist.get_world_size(), device()
    dp = world // pp
    if outer is None:
        mesh = init_device_mesh(dev.type, (pp, dp), mesh_dim_names=("pp", "dp_shard"))
        dp_mesh, extra, dp_rank = mesh["dp_shard"], {}, mesh["dp_shard"].get_local_rank()
    else:
        mesh = init_device_mesh(dev.type, (pp, outer, dp // outer), mesh_dim_names=("pp", "dp_outer", "dp_shard"))
        dp_mesh, extra = mesh["dp_outer", "dp_shard"], {"outer_dp_sharding_strategy": "no_shard"}
        dp_rank = mesh["dp_outer"].get_local_rank() * (dp // outer) + mesh["dp_shard"].get_local_rank()
    pp_group, pp_rank, _ = pipeline_groups(mesh)
    virtual = 2 if schedule_name in ("interleaved", "looped_bfs") else 1
    num_stages = pp * virtual
    torch.manual_seed(0)
    whole = PipeLM(config)
    indices = [pp_rank + v * pp for v in range(virtual)]
    parts = [shardwise.fully_shard(stage_module(whole, i, num_stages).to(dev), dp_mesh, strategy=strategy,
                                   unit_modules=[Block], collectives=collectives, **extra) for i in indices]
    stages = [ShardedPipelineStage(part, i, num_stages, group=pp_group) for part, i in zip(parts, indices)]
    schedule = build_schedule(schedule_name, stages, MICRO_BATCHES, lm_loss)
    params = [p for part in parts for p in part.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    losses, norms, counts, own = [], [], [], []
    for step in range(steps):
        tokens, targets = (t[rows].to(dev) for t in batch(step, GLOBAL_BATCH, config))
        if collectives is not None:
            collectives.calls.clear()
        micro_losses = []
        schedule.step(*((tokens,) if first else ()), target=targets if last else None,
                      losses=micro_losses if last else None)
        if collectives is not None:
            counts.append(dict(collectives.calls))
        norms.append(shardwise.clip_grad_norm_(params, MAX_NORM, extra_groups=[pp_group]).item())
        opt.step()
        opt.zero_grad()
        own.append([loss.item() for loss in micro_losses])
        total = torch.stack(micro_losses).mean().detach() if last else torch.zeros((), device=dev)
        dist.all_reduce(total)  # the last stage's ranks hold the losses: their mean over data ranks
        losses.append(total.item() / dp)
    if save_to is not None:
        dcp.save({k: v for part in parts for k, v in part.state_dict().items()}, checkpoint_id=save_to)
    state = {}
    for part in parts:
        state.update(shardwise.full_state_dict(part))
    gathered = [None] * world
    dist.all_gather_object(gathered, state)
    whole_state = {k: v for s in gathered for k, v in s.items()}
    return losses, norms, whole_state, counts, ((rows, own) if last else None)


def _train_reference(steps: int, config: TinyConfig = CONFIG, rows: slice | None = None):
    """The whole model on the whole batch; with ``rows``, also the micro-batch losses of those rows,
    by the model as it is before each step (what a last stage holding them must compute)."""
    torch.manual_seed(0)
    model = PipeLM(config).to(device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    own = []

    def batches():  # train_clipped takes the next batch after the previous step
        for step in range(steps):
            tokens, targets = (t.to(device()) for t in batch(step, GLOBAL_BATCH, config))
            if rows is not None:
                own.append(micro_batch_losses(model, lm_loss, tokens[rows], targets[rows], MICRO_BATCHES))
            yield tokens, targets

    losses, norms = train_clipped(model, opt, batches(), lm_loss, MAX_NORM)
    return losses, norms, state_of(model), own


def _parity(schedule_name, pp, strategy, steps=3, outer=None, checkpointing="none"):
    """Parity with one process; returns how many of its own micro-batch losses this rank checked."""
    config = TinyConfig(layers=CONFIG.layers, checkpointing=checkpointing)
    losses, norms, state, _, own = _train_pipeline(schedule_name, pp, strategy, steps, outer=outer, config=config)
    ref_losses, ref_norms, ref_state, ref_own = _train_reference(steps, config, own[0] if own else None)
    if own is not None:  # this rank's own losses, before the all-reduce: its rows, not just the right mean
        torch.testing.assert_close(torch.tensor(own[1], dtype=torch.float64),
                                   torch.tensor(ref_own, dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(losses, dtype=torch.float64),
                               torch.tensor(ref_losses, dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(norms, dtype=torch.float64),
                               torch.tensor(ref_norms, dtype=torch.float64), rtol=1e-5, atol=0)
    assert min(ref_norms) > MAX_NORM, ref_norms  # clipping changed every step
    assert_close_states(state, ref_state, rtol=1e-5)
    return 0 if own is None else sum(len(step) for step in own[1])


def _run_parity(world: int, schedule_name: str, pp: int, strategy, steps: int = 3, **kwargs) -> None:
    checked = run_distributed(_parity, world, schedule_name, pp, strategy, steps, **kwargs)
    # every rank holding the last stage checked all its micro-batch losses; the others held none
    assert sum(checked) == world // pp * steps * MICRO_BATCHES, checked


@pytest.mark.parametrize("schedule_name,strategy", [
    ("gpipe", "optim_grads_params"),
    ("1f1b", "optim"),
    ("interleaved", "optim_grads_params"),
    ("looped_bfs", "optim_grads"),
])
def test_pp2_dp2_trains_as_one_process(schedule_name, strategy):
    _run_parity(4, schedule_name, 2, strategy)


@pytest.mark.parametrize("schedule_name", ["1f1b", "interleaved"])
def test_pp2_dp1_trains_as_one_process(schedule_name):
    _run_parity(2, schedule_name, 2, "optim_grads_params")


def test_pp2_hsdp_2x1_trains_as_one_process():
    # a (pp, dp_outer, dp_shard) = (2, 2, 1) mesh: each stage's replicas all-reduced once per step
    _run_parity(4, "1f1b", 2, "optim_grads_params", outer=2)


def test_activation_checkpointing_inside_stages():
    # non-reentrant only: torch's shape inference runs autograd.grad, which reentrant checkpointing refuses
    _run_parity(2, "gpipe", 2, "optim_grads_params", checkpointing="non_reentrant")


def _reductions_per_step(strategy):
    _, _, _, counts, _ = _train_pipeline("1f1b", 2, strategy, 3, collectives=CountingCollectives())
    return counts


def _trainable_groups():
    world, dev = dist.get_world_size(), device()
    mesh = init_device_mesh(dev.type, (2, world // 2), mesh_dim_names=("pp", "dp_shard"))
    part = shardwise.fully_shard(stage_module(PipeLM(CONFIG), mesh["pp"].get_local_rank(), 2), mesh["dp_shard"],
                                 strategy="no_shard", unit_modules=[Block])
    return sum(1 for g in sharded_state(part).groups if g.requires_grad)


@pytest.mark.slow
def test_a_stage_reduces_its_gradients_once_per_step():
    # no_shard keeps gradients Partial until finalized: one all-reduce per trainable group and step,
    # whatever the number of micro-batches (4 here); optim (ZeRO-1) one reduce-scatter instead.
    groups = run_distributed(_trainable_groups, 4)
    for rank, counts in enumerate(run_distributed(_reductions_per_step, 4, "no_shard")):
        for step in counts:
            assert step == {"all_reduce": groups[rank]}, (rank, counts)
    for rank, counts in enumerate(run_distributed(_reductions_per_step, 4, "optim")):
        for step in counts[1:]:  # from the second step on: the refresh gathers of the updated shards
            assert step.get("reduce_scatter") == groups[rank] and "all_reduce" not in step, (rank, counts)


def test_unsupported_schedules_and_bad_arguments_are_refused_early():
    with pytest.raises(ValueError, match="schedule='dualpipev' is not supported; choose one of"):
        build_schedule("dualpipev", [], 4, lm_loss)
    with pytest.raises(ValueError, match="stages must be a non-empty list of ShardedPipelineStage, got none"):
        build_schedule("1f1b", [], 4, lm_loss)
    with pytest.raises(ValueError, match="submodule=Linear is not wrapped by shardwise.fully_shard"):
        ShardedPipelineStage(nn.Linear(2, 2), 0, 2)
    with pytest.raises(ValueError, match="extra_groups must be process groups"):
        shardwise.clip_grad_norm_([], 1.0, extra_groups=["pp"])


def _save_pp2_dp2_then_load_at_dp4_and_one_process(path):
    _, _, saved, _, _ = _train_pipeline("1f1b", 2, "optim_grads_params", 2, save_to=path)
    torch.manual_seed(1)  # other initial values: everything compared below comes from the checkpoint
    model = shardwise.fully_shard(PipeLM(CONFIG).to(device()), shardwise.build_dp_mesh(), unit_modules=[Block])
    state = model.state_dict()
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state)
    loaded = shardwise.full_state_dict(model)
    assert set(loaded) == set(saved)
    for key, value in saved.items():
        assert torch.equal(loaded[key], value), key
    if dist.get_rank() == 0:  # one process, plain tensors, no process group involved
        plain = {k: torch.zeros_like(v) for k, v in state_of(PipeLM(CONFIG)).items()}
        dcp.load(plain, checkpoint_id=path, no_dist=True)
        for key, value in saved.items():
            assert torch.equal(plain[key], value), key


@pytest.mark.slow
def test_a_pp2_dp2_checkpoint_has_the_whole_models_names_and_loads_at_dp4_and_one_process(tmp_path):
    run_distributed(_save_pp2_dp2_then_load_at_dp4_and_one_process, 4, str(tmp_path / "ckpt"))
