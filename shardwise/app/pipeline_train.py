"""``shardwise train --pp N``: the GPT cut by layers into pipeline stages, each sharded over its data ranks.

The world is ``pp x dp`` ranks on a ``(pp, dp_shard)`` mesh, ``(pp, dp_outer, dp_shard)`` with
``--outer-dp`` (HSDP/HFSDP inside each stage). Stage ``i`` of ``pp x --pp-virtual-stages`` is
:func:`shardwise.models.pipeline_split.pipeline_stage` of the whole GPT (the embedding on the first,
the final norm and head on the last; ``--pp-split`` the layers per stage, default even); rank ``r`` of
the pipeline holds stages ``r, r + pp, ...`` (with ``--pp-schedule zb``, torch's ZBV schedule, the two
stages of a V: ``r`` and ``2 pp - 1 - r``). Each stage module is wrapped by ``fully_shard`` on the
rank's data-parallel sub-mesh with the flags the one-model path uses (strategy, mixed precision,
offload, meta init, activation checkpointing, ``--compile``) and driven by
:func:`shardwise.engine.pipeline.build_schedule`: ``--grad-accum`` is the number of micro-batches, the loss
of each is the mean cross entropy, and torch scales the gradients by the micro-batch count, so the
gradients are those of the one-model path's mean loss. Clipping spans the stages
(``extra_groups=[pp_group]``); the loss is the last stage's, summed over all ranks (the others add
zeros); checkpoints hold the whole model's names (each rank saves its stage; ``CheckpointManager``
joins the stages' keys and parameter groups), so a ``--pp 2`` checkpoint resumes at ``--pp 1`` and
back, and ``shardwise ckpt export`` reads it.

Checked here, at config time: :func:`check_flags` (the flags alone), :func:`check_world` (with the
number of processes).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .errors import ConfigError
from .weight_decay import decayed_names

__all__ = ["PP_SCHEDULES", "check_flags", "check_world", "parse_split", "PipelineRun", "StageOptimizers",
           "StageTimer", "build_pipeline"]

# --pp-schedule choices, and the name shardwise.engine.pipeline.SCHEDULES gives each ("zb": torch's ZBV).
PP_SCHEDULES = ("1f1b", "gpipe", "interleaved", "looped_bfs", "zb", "interleaved_zb")
_SCHEDULE_NAME = {"zb": "zbv"}
_MULTI_STAGE = ("interleaved", "looped_bfs", "interleaved_zb")  # several stages per rank, looped numbering
_ROUNDS = ("interleaved", "interleaved_zb")  # torch splits the micro-batches into whole rounds


def schedule_name(cfg) -> str:
    """``--pp-schedule`` as :func:`shardwise.engine.pipeline.build_schedule` names it."""
    return _SCHEDULE_NAME.get(cfg.pp_schedule, cfg.pp_schedule)


def rank_stage_indices(cfg, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds: looped (``r, r + pp, ...``), or ZBV's V (``r, 2 pp - 1 - r``)."""
    from ..models.pipeline_split import stage_indices

    if cfg.pp_schedule == "zb":
        return [pp_rank, 2 * cfg.pp - 1 - pp_rank]
    return stage_indices(pp_rank, cfg.pp, cfg.pp_virtual_stages)


def parse_split(text: str) -> list[int] | None:
    """``--pp-split 3,5`` as ``[3, 5]`` (``None`` when empty: an even split)."""
    if not text:
        return None
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError("pp_split", text, "needs a comma list of whole numbers, the layers of each stage "
                          "(e.g. 3,5)") from None
    return counts


def check_flags(cfg, model) -> None:
    """Refuse what ``--pp`` cannot train, naming the flag and value (before any process starts)."""
    if cfg.pp < 1:
        raise ConfigError("pp", cfg.pp, "must be at least 1 (the number of pipeline stages)")
    if cfg.pp_virtual_stages < 1:
        raise ConfigError("pp_virtual_stages", cfg.pp_virtual_stages, "must be at least 1")
    if cfg.pp_schedule not in PP_SCHEDULES:
        raise ConfigError("pp_schedule", cfg.pp_schedule, f"unknown schedule; use one of {', '.join(PP_SCHEDULES)}")
    if cfg.pp == 1:
        for name, unset in (("pp_virtual_stages", 1), ("pp_split", "")):
            if getattr(cfg, name) != unset:
                raise ConfigError(name, getattr(cfg, name), "needs --pp 2 or more (a pipeline)")
        return
    virtual = cfg.pp_virtual_stages
    if cfg.pp_schedule == "zb" and virtual != 2:
        raise ConfigError("pp_virtual_stages", virtual, "--pp-schedule zb (torch's ZBV zero-bubble schedule) runs "
                          "exactly two stages per rank, in a V: use --pp-virtual-stages 2")
    if virtual > 1 and cfg.pp_schedule not in _MULTI_STAGE + ("zb",):
        raise ConfigError("pp_virtual_stages", virtual, f"--pp-schedule {cfg.pp_schedule} runs one stage per "
                          f"rank; several need --pp-schedule interleaved (or looped_bfs)")
    if virtual == 1 and cfg.pp_schedule in _MULTI_STAGE:
        raise ConfigError("pp_schedule", cfg.pp_schedule, "runs several stages per rank: add "
                          "--pp-virtual-stages 2 (or more)")
    stages = cfg.pp * virtual
    if cfg.pp_schedule == "1f1b" and cfg.grad_accum < stages:
        raise ConfigError("grad_accum", cfg.grad_accum, f"is the number of micro-batches, of which torch's 1F1B "
                          f"schedule needs at least one per stage ({stages} with --pp {cfg.pp})")
    if cfg.pp_schedule in _ROUNDS:
        rounds = max(1, cfg.grad_accum // cfg.pp)
        if cfg.grad_accum % rounds:
            raise ConfigError("grad_accum", cfg.grad_accum, f"torch's {cfg.pp_schedule} schedule needs the micro-batches "
                              f"in whole rounds: a multiple of {rounds} (e.g. a multiple of --pp {cfg.pp})")
    from ..models.pipeline_split import stage_layer_counts

    try:
        stage_layer_counts(model.n_layers, stages, parse_split(cfg.pp_split))
    except ValueError as e:
        name, value = ("pp_split", cfg.pp_split) if cfg.pp_split else ("pp", cfg.pp)
        raise ConfigError(name, value, f"{e} ({stages} stages: --pp {cfg.pp} x --pp-virtual-stages {virtual})"
                          ) from None
    if model.tie_embeddings:
        raise ConfigError("tie_embeddings", "", "with --pp is not built: the embedding (first stage) and the "
                          "head (last stage) would share one weight whose two gradients are not summed; use "
                          "--no-tie-embeddings")
    not_built = [("hf_config", "the transformers model cannot be cut into stages; --pp trains the GPT model"),
                 ("init_from", "reading --init-from rows into stages is not built yet"),
                 ("eval_data", "evaluation through the pipeline's stages is not built yet"),
                 ("eval_fraction", "evaluation through the pipeline's stages is not built yet")]
    for name, why in not_built:
        if getattr(cfg, name):
            raise ConfigError(name, getattr(cfg, name), f"with --pp: {why}")


def check_world(cfg, world: int) -> int:
    """The data-parallel size ``world / pp``; ``ConfigError`` when ``--pp`` does not divide the processes."""
    if world % cfg.pp:
        raise ConfigError("pp", cfg.pp, f"must divide the number of processes ({world}): each of the world / pp "
                          f"data-parallel replicas is a whole pipeline")
    dp = world // cfg.pp
    if cfg.outer_dp and dp % cfg.outer_dp:
        raise ConfigError("outer_dp", cfg.outer_dp, f"must divide the data-parallel size {dp} (processes {world} "
                          f"/ --pp {cfg.pp})")
    return dp


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross entropy of one micro-batch, as ``GPT(tokens, targets)`` computes it."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class StageTimer:
    """The pipeline bubble: the share of each schedule step a rank spends outside its stages' work.

    Busy is the time inside this rank's stages' ``forward_one_chunk``, ``backward_one_chunk``,
    ``backward_weight_one_chunk`` (the zero-bubble schedules' weight pass) and ``perform_reduce_grad``:
    the computation, with the data-parallel all-gathers and the gradient reduction the engine does
    inside them (the stage's own work, which a deeper pipeline does not change). The bubble is the
    rest of ``schedule.step``: waiting on neighbouring stages, sends and receives, the schedule's
    bookkeeping. The optimizer step is outside the window, as in the textbook
    ``(pp - 1) / (v m + pp - 1)``. On CUDA the times are device time (events on the current stream,
    read by :meth:`bubble`, so a timed step adds no synchronization), on the CPU wall time.
    ``train --pp`` (``pp_bubble``) and ``bench --pp`` (``bubble``) both report the mean over all ranks.
    """

    _TIMED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk", "perform_reduce_grad")

    def __init__(self, stages, device: torch.device):
        self.cuda = device.type == "cuda"
        self.steps: list = []  # (begin, end, busy spans) of each step run since the last bubble()
        self._spans: list = []
        for stage in stages:
            for name in self._TIMED:
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _timed(self, method):
        def timed(*args, **kwargs):
            begin = self._mark()
            try:
                return method(*args, **kwargs)
            finally:
                self._spans.append((begin, self._mark()))
        return timed

    def _seconds(self, begin, end) -> float:
        return begin.elapsed_time(end) / 1e3 if self.cuda else end - begin

    def run(self, fn) -> None:
        """Call ``fn`` (one schedule step), timed."""
        self._spans = []
        begin = self._mark()
        fn()
        self.steps.append((begin, self._mark(), self._spans))

    def bubble(self) -> float:
        """This rank's mean bubble over the steps run since the last call (0 when none); forgets them."""
        steps, self.steps = self.steps, []
        if self.cuda and steps:
            steps[-1][1].synchronize()
        fractions = []
        for begin, end, spans in steps:
            total = self._seconds(begin, end)
            busy = sum(self._seconds(a, b) for a, b in spans)
            fractions.append(max(0.0, 1.0 - busy / total) if total > 0 else 0.0)
        return sum(fractions) / len(fractions) if fractions else 0.0


class StageOptimizers:
    """One optimizer per stage module of this rank, stepped as one by the loop.

    A checkpoint needs each optimizer over one module (torch's optimizer state-dict functions map its
    parameters through that module's names), so a rank with several stages keeps one each. It is not
    a fused optimizer to ``clip_grad_norm_``: the clipping factor scales the gradients instead.
    """

    def __init__(self, optimizers: list):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


class PipelineRun:
    """The loop's view of a pipeline (as :class:`.loop.DataParallelRun` is of one model).

    ``modules``: this rank's stage modules (sharded); ``module``: the stage when there is one per rank
    (:meth:`checkpointed` says what a checkpoint holds). ``step_metrics`` gives ``pp_bubble``: the step's
    bubble (:class:`StageTimer`), the mean over all ranks.
    """

    def __init__(self, cfg, modules, stages, pp_group, dp: int, device: torch.device):
        self.cfg, self.modules, self.stages, self.pp_group = cfg, modules, stages, pp_group
        self.module = modules[0] if len(modules) == 1 else None
        self.extra_groups = [pp_group]
        self.data_ranks = dp
        self.data_rank = dist.get_rank() % dp  # a pipeline's stages of one replica read the same micro-batches
        self.first = any(s.is_first for s in stages)
        self.last = any(s.is_last for s in stages)
        self.timer = StageTimer(stages, device)
        self._schedule, self._micro = None, None

    def train(self) -> None:
        for module in self.modules:
            module.train()

    def optimizer(self, make):
        """``make(module)`` of the stage, or :class:`StageOptimizers` of every stage this rank holds."""
        if len(self.modules) == 1:
            return make(self.modules[0])
        return StageOptimizers([make(module) for module in self.modules])

    def checkpointed(self, optimizer):
        """``(model, optimizer)`` as a checkpoint saves and loads them: the stage modules and one optimizer each
        (``shardwise.checkpoint`` maps each optimizer's state through its own module)."""
        if isinstance(optimizer, StageOptimizers):
            return list(self.modules), list(optimizer.optimizers)
        return self.module, optimizer

    def parameters(self) -> list:
        return [p for module in self.modules for p in module.parameters()]

    def _schedule_for(self, micro: int):
        if self._micro != micro:  # built once (again only if a resume changed --grad-accum)
            from ..engine.pipeline import build_schedule

            self._schedule, self._micro = build_schedule(schedule_name(self.cfg), self.stages, micro, lm_loss), micro
        return self._schedule

    def forward_backward(self, loader, grad_accum: int, device: torch.device) -> torch.Tensor:
        """One schedule step over ``grad_accum`` micro-batches (the loader's, in order, as one batch the schedule
        splits again); the sum of their mean losses on the last stage, zero elsewhere."""
        schedule = self._schedule_for(grad_accum)
        batches = [next(loader) for _ in range(grad_accum)]
        inputs = torch.cat([b[0] for b in batches])
        targets = torch.cat([b[1] for b in batches])
        losses: list = []
        self.timer.run(lambda: schedule.step(  # no outputs returned: nobody reads the logits
            *((inputs,) if self.first else ()), target=targets if self.last else None,
            losses=losses if self.last else None, return_outputs=False))
        if self.last:
            return torch.stack(losses).detach().float().sum()
        return torch.zeros((), device=device)

    def step_metrics(self) -> dict:
        bubble = torch.tensor([self.timer.bubble()], dtype=torch.float64, device=self.stages[0].device)
        dist.all_reduce(bubble)
        return {"pp_bubble": bubble.item() / dist.get_world_size()}


def build_pipeline(cfg, model_cfg, device: torch.device, world: int, policy, say) -> tuple:
    """This rank's stages, sharded: ``(PipelineRun, whole-model facts)`` (``bench --pp`` builds through it too).

    The facts are ``(n_params, flops_per_token, matrix names)`` of the whole model (built on the
    meta device first, so nothing but this rank's stages is ever allocated with ``--meta-init``).
    """
    import shardwise
    from torch.distributed.device_mesh import init_device_mesh

    from ..models import GPT
    from ..models.pipeline_split import StageInitializer, pipeline_stage, stage_layer_counts
    from ..engine.pipeline import ShardedPipelineStage, pipeline_groups

    dp = world // cfg.pp
    if cfg.outer_dp:
        mesh = init_device_mesh(device.type, (cfg.pp, cfg.outer_dp, dp // cfg.outer_dp),
                                mesh_dim_names=("pp", "dp_outer", "dp_shard"))
        dp_mesh = mesh["dp_outer", "dp_shard"]
    else:
        mesh = init_device_mesh(device.type, (cfg.pp, dp), mesh_dim_names=("pp", "dp_shard"))
        dp_mesh = mesh["dp_shard"]
    pp_group, pp_rank, _ = pipeline_groups(mesh)
    num_stages = cfg.pp * cfg.pp_virtual_stages
    indices = rank_stage_indices(cfg, pp_rank)
    with torch.device("meta" if cfg.meta_init else device):
        whole = GPT(model_cfg)
    if cfg.fp8:  # the whole model's linears, before it is cut: each stage keeps the ones it holds
        from .fp8 import convert_model

        say(convert_model(whole, cfg.fp8, cfg.fp8_skip, cfg.fp8_all_gather).describe())
    facts = (whole.num_params(), whole.flops_per_token(cfg.seq_len), decayed_names(whole))
    split = parse_split(cfg.pp_split)
    parts = [pipeline_stage(whole, i, num_stages, split=split) for i in indices]
    init_fn = None
    if cfg.meta_init:
        init_fn = StageInitializer(whole, parts, device)
        init_fn.plan()  # the whole model's init order: each stage's values are the whole model's
    unit_modules = list(dict.fromkeys(type(layer) for layer in whole.layers))
    del whole  # the stages share its modules; the others are never materialized
    modules = [shardwise.fully_shard(
        part, mesh=dp_mesh, strategy=cfg.strategy, outer_dp_sharding_strategy=cfg.outer_strategy or None,
        unit_modules=unit_modules, mixed_precision=policy, init_fn=init_fn,
        offload_policy=shardwise.OffloadPolicy(fraction=cfg.offload_fraction) if cfg.offload else None)
        for part in parts]
    if init_fn is not None:
        init_fn.finish()
    if cfg.compile:
        for module in modules:
            shardwise.compile_units(module, modules=unit_modules, backend=cfg.compile)
    stages = [ShardedPipelineStage(module, i, num_stages, group=pp_group) for module, i in zip(modules, indices)]
    counts = stage_layer_counts(model_cfg.n_layers, num_stages, split)
    say(f"pipeline: {cfg.pp} ranks x {dp} data-parallel replicas, {num_stages} stages of {counts} layers "
        f"(embedding on the first, norm and head on the last), schedule {cfg.pp_schedule} (a micro-batch per "
        f"--grad-accum)")
    return PipelineRun(cfg, modules, stages, pp_group, dp, device), facts
