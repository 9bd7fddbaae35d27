"""What the planner plans for: a model it can build (at full or reduced depth), its units, inputs and FLOPs.

A source is a preset (:mod:`shardwise.app.presets`), a Hugging Face config folder (Llama/Mistral/Mixtral
shapes, read by :func:`shardwise.hf.mapping.hf_to_gpt_fields`, no ``transformers`` needed), a Megatron-style
shape (layers, hidden, heads, ffn, vocab) or, from Python, any ``nn.Module`` factory. The reference GPT's
layers are identical, so a GPT source can also be built with fewer layers (``depth``): the planner traces a
few depths and extends the line, checked against a whole trace (``trace.py``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn as nn

from ...models import GPT, GPTConfig, TransformerLayer
from ..presets import PRESETS

__all__ = ["ModelSource", "gpt_source", "preset_source", "hf_source", "shape_source", "factory_source"]

_GPT_FIELDS = {f.name for f in fields(GPTConfig)}


@dataclass(frozen=True)
class ModelSource:
    """A model the planner can build, wrap and run one step of.

    build(depth, activation_checkpointing) -> module (``depth`` None: the whole model; only sources with
    ``layers`` take another). unit_spec(module) -> what ``fully_shard(unit_modules=...)`` gets. inputs(micro_batch,
    seq) -> forward's arguments; forward returns the loss (a tensor; reduced by ``sum`` when not a scalar).
    flops_per_token(seq): training FLOPs (forward and backward) per token, MFU's numerator.
    """

    name: str
    build: Callable[[int | None, bool], nn.Module]
    unit_spec: Callable[[nn.Module], list]
    inputs: Callable[[int, int], tuple]
    flops_per_token: Callable[[int], float]
    layers: int | None = None  # identical layers: depth can be reduced and extended
    layer_modules: Callable[[nn.Module], list] | None = None  # the layers in forward order (phase names)
    config: GPTConfig | None = None  # the reference GPT's config, when that is the model
    vocab_units: bool = True  # the reference GPT's embedding and head are units of their own (``gpt_source``)


def gpt_source(config: GPTConfig, name: str = "gpt", vocab_units: bool = True) -> ModelSource:
    """The reference GPT; ``vocab_units``: the embedding and the output head are units (``shardwise bench``),
    else only the layers are (``shardwise train``)."""

    def build(depth: int | None, checkpointing: bool) -> nn.Module:
        cfg = replace(config, activation_checkpointing=checkpointing,
                      n_layers=config.n_layers if depth is None else depth,
                      layer_pattern=config.layer_pattern)
        return GPT(cfg)

    def units(model: nn.Module) -> list:
        extra = [model.embed, model.output] if vocab_units and model.output is not None else []
        return [TransformerLayer, *extra]

    def inputs(micro_batch: int, seq: int) -> tuple:
        tokens = torch.randint(0, config.vocab_size, (micro_batch, seq + 1))
        return tokens[:, :-1], tokens[:, 1:]

    def flops(seq: int) -> float:
        with torch.device("meta"):
            model = GPT(replace(config, max_seq_len=max(seq, 1)))
        return model.flops_per_token(seq)

    uniform = len(set(config.layer_kinds)) == 1
    return ModelSource(name, build, units, inputs, flops, config.n_layers if uniform else None,
                       lambda model: list(model.layers), config, vocab_units)


def _with_seq(fields_: dict, seq: int | None) -> dict:
    shape = {k: v for k, v in fields_.items() if k in _GPT_FIELDS}
    if seq:
        shape["max_seq_len"] = max(seq, shape.get("max_seq_len", 0))
    return shape


def preset_source(name: str, seq: int | None = None, **kw) -> ModelSource:
    """A ``shardwise train --preset`` model (``seq``: the planned sequence length, for RoPE's tables)."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not one of {sorted(PRESETS)}")
    fields_ = dict(PRESETS[name])
    seq = seq or fields_.get("seq_len")
    return gpt_source(GPTConfig(**_with_seq(fields_, seq)), name=f"preset {name}", **kw)


def hf_source(folder: str | Path, seq: int | None = None, **kw) -> ModelSource:
    """A Hugging Face config folder (or its ``config.json``) of a Llama/Mistral/Mixtral-shaped model."""
    from ...hf.mapping import hf_to_gpt_fields

    path = Path(folder)
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"hf config {str(folder)!r}: no config.json there")
    fields_ = hf_to_gpt_fields(json.loads(path.read_text()))
    return gpt_source(GPTConfig(**_with_seq(fields_, seq)), name=f"hf {path.parent.name}", **kw)


def shape_source(layers: int, hidden: int, heads: int, ffn: int, vocab: int, kv_heads: int | None = None,
                 seq: int | None = None, **kw) -> ModelSource:
    """A Megatron-style shape (``--num-layers --hidden-size --num-attention-heads --ffn-hidden-size``,
    the padded vocabulary, ``--num-query-groups``): a Llama-style GPT of that shape."""
    for arg, value in dict(layers=layers, hidden=hidden, heads=heads, ffn=ffn, vocab=vocab).items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{arg}={value!r} must be a positive integer")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
    cfg = GPTConfig(vocab_size=vocab, dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads or heads,
                    ffn_hidden=ffn, max_seq_len=seq or 2048)
    return gpt_source(cfg, name=f"shape L{layers} h{hidden}", **kw)


def factory_source(factory: Callable[[], nn.Module], unit_modules: Sequence, inputs: Callable[[int, int], tuple],
                   flops_per_token: Callable[[int], float] | None = None, name: str = "model") -> ModelSource:
    """Any module: ``factory()`` builds it (the planner calls it under FakeTensorMode, so it allocates nothing),
    ``unit_modules`` as ``fully_shard`` takes them, ``inputs(micro_batch, seq)`` its forward's arguments.
    Without ``flops_per_token``, 6 x parameters (forward and backward of every weight once per token)."""
    if not callable(factory):
        raise ValueError(f"factory={factory!r} must be callable")

    def flops(seq: int) -> float:
        with torch.device("meta"):
            n = sum(p.numel() for p in factory().parameters())
        return 6.0 * n

    def build(depth, checkpointing):
        if checkpointing:
            raise ValueError("activation checkpointing of a factory model is the factory's own setting")
        return factory()

    return ModelSource(name, build, lambda model: list(unit_modules), inputs, flops_per_token or flops)
