"""A GPT cut into pipeline stages that keep the whole model's parameter names.

:func:`pipeline_stage` takes a :class:`GPT` (built anywhere, the meta device
included) and returns stage ``i`` of ``n``: a :class:`GPTStage` that *shares*
the whole model's modules for its layers (the embedding on the first stage,
the final norm and head on the last). Its layers sit in an ``nn.ModuleDict``
keyed by their index in the whole model, so ``layers.5.attention.wq.weight``
is still ``layers.5.attention.wq.weight``: the state dicts of all stages
together are exactly the whole model's, and a checkpoint does not depend on
how the model was cut.

Stage numbering is torch's: with ``v`` virtual stages per rank
(``interleaved``, ``looped_bfs``) there are ``pp * v`` stages and rank ``r``
holds stages ``r, r + pp, r + 2 pp, ...`` (:func:`stage_indices`).

A stage's forward takes tokens on the first stage and hidden states
elsewhere, and returns logits on the last (the schedule's ``loss_fn`` computes
the cross entropy) and hidden states elsewhere.

MoE load-balancing loss: it is not carried from stage to stage. Each stage
adds ``moe_aux_loss_coef`` times the summed aux losses of its own MoE layers
to its backward (its output is the identity whose backward also feeds that
constant gradient to the aux losses), so the gradients are those of
``CE + coef * sum(aux)`` per micro-batch, as ``GPT(tokens, targets)`` gives;
the value the schedule reports is the cross entropy alone (each stage leaves
its sum on ``stage.aux_loss``).

Tied embeddings over more than one stage would need the first and last
stages' gradients of one weight summed every step; that is not built, and
``tie_embeddings=True`` with ``num_stages > 1`` is refused.

Meta device: split a meta-built GPT, then initialize the stages with
:class:`StageInitializer` (``fully_shard(init_fn=...)``): it replays the whole
model's initialization order, so every stage parameter equals the same
parameter of the whole model built directly after the same seed.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..engine.materialize import MetaInitializer
from ..engine.rng import set_torch_generator_states, torch_generator_states
from .gpt import GPT, run_layers
from .norm_rope import rope_tables
from .tensor_parallel import copy_to_tp_region, gather_from_tp_region, group_size

__all__ = ["GPTStage", "pipeline_stage", "stage_layer_counts", "stage_indices", "StageInitializer"]


def _int(name: str, value, low: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name}={value!r} must be an integer >= {low}")
    return value


def stage_indices(pp_rank: int, pp: int, virtual: int = 1) -> list[int]:
    """The stages rank ``pp_rank`` of ``pp`` holds with ``virtual`` stages per rank (torch's looped order)."""
    _int("pp", pp, 1)
    _int("virtual", virtual, 1)
    if not isinstance(pp_rank, int) or not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank!r} must be in [0, pp={pp})")
    return [pp_rank + v * pp for v in range(virtual)]


def stage_layer_counts(n_layers: int, num_stages: int, split: Optional[Sequence[int]] = None) -> list[int]:
    """Layers per stage: ``split`` checked, or an even split (the first ``n_layers % num_stages`` stages one more).

    An explicit split may give the first or last stage no layers (it then holds only the
    embedding, or only the norm and head); a middle stage with none would only pass hidden
    states on and is refused.
    """
    _int("num_stages", num_stages, 1)
    if split is None:
        if num_stages > n_layers:
            raise ValueError(f"num_stages={num_stages} is more stages than n_layers={n_layers}; "
                             "use fewer stages or an explicit split")
        base, extra = divmod(n_layers, num_stages)
        return [base + (s < extra) for s in range(num_stages)]
    counts = list(split)
    if len(counts) != num_stages:
        raise ValueError(f"split={counts} has {len(counts)} entries, one per stage is needed (num_stages={num_stages})")
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in counts):
        raise ValueError(f"split={counts} must hold non-negative integers")
    if sum(counts) != n_layers:
        raise ValueError(f"split={counts} sums to {sum(counts)}, not n_layers={n_layers}")
    empty_middle = [s for s in range(1, num_stages - 1) if counts[s] == 0]
    if empty_middle:
        raise ValueError(f"split={counts} gives middle stages {empty_middle} no layers; only the first and last "
                         "stage may have none")
    return counts


class _AddAuxGrad(torch.autograd.Function):
    """Identity on ``x``; its backward also gives ``aux`` the gradient ``coef`` (the aux loss's weight)."""

    @staticmethod
    def forward(ctx, x, aux, coef):
        ctx.coef, ctx.aux_like = coef, (aux.shape, aux.dtype, aux.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.aux_like
        return grad, torch.full(shape, ctx.coef, dtype=dtype, device=device), None


class GPTStage(nn.Module):
    """Stage ``stage_index`` of ``num_stages`` of a GPT: some of its layers, under the whole model's names.

    ``layer_ids`` are the whole model's layer indices this stage runs, in order.
    """

    def __init__(self, model: GPT, stage_index: int, num_stages: int, layer_ids: Sequence[int]):
        super().__init__()
        if group_size(model.config.cp_group) > 1:
            raise NotImplementedError("pipeline stages of a context-parallel GPT (cp_group of more than one rank) "
                                      "are not built yet")
        self.config = model.config
        self.stage_index, self.num_stages = stage_index, num_stages
        self.is_first, self.is_last = stage_index == 0, stage_index == num_stages - 1
        self.layer_ids = list(layer_ids)
        self.embed = model.embed if self.is_first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in self.layer_ids})
        self.norm = model.norm if self.is_last else None
        self.output = model.output if self.is_last else None
        # the same tensors as the whole model's (computed by reset_parameters when built on meta)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.aux_loss = None

    def reset_parameters(self) -> None:
        """Recompute the RoPE tables (the stage holds no parameters of its own)."""
        c = self.config
        cos, sin = rope_tables(c.max_seq_len, c.head_dim, c.rope_theta, device=self.rope_cos.device)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def forward(self, x):
        c = self.config
        if x.shape[1] > c.max_seq_len:
            raise ValueError(f"sequence length {x.shape[1]} > max_seq_len={c.max_seq_len}")
        if self.is_first:
            x = F.dropout(self.embed(x), c.dropout, self.training)
        recompute = c.activation_checkpointing and self.training and torch.is_grad_enabled()
        x, aux = run_layers(self.layers.values(), x, self.rope_cos, self.rope_sin, recompute)
        self.aux_loss = torch.stack(aux).sum() if aux else None
        if self.aux_loss is not None and torch.is_grad_enabled() and c.moe_aux_loss_coef:
            x = _AddAuxGrad.apply(x, self.aux_loss, float(c.moe_aux_loss_coef))
        if not self.is_last:
            return x
        x = self.norm(x)
        if self.output is not None:
            return self.output(x)
        local = F.linear(copy_to_tp_region(x, c.tp_group), self.embed.weight)  # tied, one stage only
        return gather_from_tp_region(local, c.tp_group)


def pipeline_stage(model: GPT, stage_index: int, num_stages: int, *,
                   split: Optional[Sequence[int]] = None) -> GPTStage:
    """Stage ``stage_index`` of ``num_stages`` of ``model`` (sharing its modules; nothing is copied).

    ``split``: layers per stage (default: even, see :func:`stage_layer_counts`). With virtual
    stages, ``num_stages`` is ``pp * virtual`` and the index is torch's (:func:`stage_indices`).
    """
    if not isinstance(model, GPT):
        raise ValueError(f"model={type(model).__name__} is not a shardwise.models.GPT")
    _int("num_stages", num_stages, 1)
    if not isinstance(stage_index, int) or isinstance(stage_index, bool) or not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index={stage_index!r} must be in [0, num_stages={num_stages})")
    if model.config.tie_embeddings and num_stages > 1:
        raise ValueError(f"tie_embeddings=True with num_stages={num_stages}: the embedding (first stage) and the "
                         "head (last stage) would be one weight on two stages, whose gradients are not summed; "
                         "use tie_embeddings=False for pipeline parallelism")
    counts = stage_layer_counts(model.config.n_layers, num_stages, split)
    start = sum(counts[:stage_index])
    return GPTStage(model, stage_index, num_stages, range(start, start + counts[stage_index]))


class StageInitializer:
    """``init_fn`` for ``fully_shard`` of stages split from a meta-built GPT: the whole model's init order.

    ``plan()`` runs every module's reset of the whole ``model`` once on throw-away storage
    (one module at a time), recording where each starts in a direct build; materializing a
    stage's module then starts from its recorded state, so its values equal the whole model's.
    ``finish()`` materializes what no unit covered (the stages' roots) and leaves the
    generators where a direct build of the whole model would have.
    """

    def __init__(self, model: GPT, stages: Iterable[GPTStage], device: Optional[torch.device] = None):
        self.stages = list(stages)
        missing = [type(s).__name__ for s in self.stages if not isinstance(s, GPTStage)]
        if not self.stages or missing:
            raise ValueError(f"stages must be a non-empty list of GPTStage, got {missing or 'none'}")
        self._whole = MetaInitializer(model, device)
        self.device = self._whole.device
        self._final: Optional[dict] = None

    def plan(self) -> None:
        self._whole.plan()
        self._final = torch_generator_states(self.device)

    def __call__(self, owner: nn.Module, device: Optional[torch.device] = None) -> None:
        self._whole(owner, device)

    def finish(self) -> None:
        if self._final is None:
            raise RuntimeError("StageInitializer.finish() before plan(): call plan() before sharding")
        for stage in self.stages:
            self._whole(stage, self.device)
        set_torch_generator_states(self._final, self.device)
