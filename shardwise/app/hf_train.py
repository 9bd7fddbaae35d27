"""The ``shardwise train`` side of Hugging Face support: ``--hf-config`` and ``--init-from``.

* ``--hf-config CONFIG`` (a ``config.json`` or a folder holding one) trains the
  ``transformers`` causal LM it describes: built on the meta device,
  initialized by ``transformers``' own ``_init_weights`` one decoder layer at
  a time while it is sharded (units: the ``_no_split_modules`` classes), the
  loss is the model's own. The config is copied to ``<out-dir>/hf_config.json``
  so ``shardwise ckpt export --format hf`` finds it.
* ``--init-from FOLDER`` (a ``save_pretrained`` folder with safetensors) starts
  from its weights: every rank reads only its own rows. Without
  ``--hf-config``, a Llama / Mistral / Mixtral folder trains as shardwise's own
  GPT of the same shape (its model flags are taken from the folder's config);
  any other architecture trains as the ``transformers`` model, as if
  ``--hf-config FOLDER`` had been given.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..hf.load import init_from_folder
from ..hf.mapping import hf_to_gpt_fields
from ..hf.models import (INSTALL_HINT, HFCausalLM, MetaInit, build_hf_model, decoder_layer_classes, encoder_only,
                         hf_reset, load_config, require_transformers)
from ..models import GPT, GPTConfig
from .errors import ConfigError

__all__ = ["resolve", "build_model"]

HF_CONFIG_FILE = "hf_config.json"
_ARCH_FIELDS = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "rope_theta", "norm_eps",
                "tie_embeddings", "layer_pattern", "moe_num_experts", "moe_top_k", "moe_ffn_hidden")


def _say(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"shardwise train: {message}", file=sys.stderr, flush=True)


def resolve(cfg, model_cfg: GPTConfig) -> GPTConfig:
    """Check ``--hf-config`` / ``--init-from`` before any process starts; the model config to train.

    Raises ``shardwise.app.errors.ConfigError`` (``--flag value: reason``). May set
    ``cfg.hf_config`` (an ``--init-from`` folder that is no GPT shape).
    """
    flag, value = ("hf_config", cfg.hf_config) if cfg.hf_config else ("init_from", cfg.init_from)
    try:
        require_transformers()
    except ImportError:
        raise ConfigError(flag, value, f"needs the transformers package, which is not installed (an optional "
                          f"extra): {INSTALL_HINT}") from None
    if cfg.init_from:
        folder = Path(cfg.init_from)
        if not folder.is_dir():
            raise ConfigError("init_from", cfg.init_from, "no such folder (a save_pretrained folder)")
        if not any(folder.glob("*.safetensors")):
            raise ConfigError("init_from", cfg.init_from, "holds no .safetensors file (save_pretrained writes "
                                                          "model.safetensors or shards with an index)")
    source = cfg.hf_config or cfg.init_from
    try:
        config = load_config(source)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(flag, value, str(e)) from None
    if not cfg.hf_config:  # --init-from alone: shardwise's GPT where the shapes match
        try:
            fields = hf_to_gpt_fields(config)
            fields["max_seq_len"] = max(fields["max_seq_len"], cfg.seq_len)  # RoPE tables, not weights
            mapped = replace(model_cfg, **fields)
            mapped.validate()
        except ValueError as e:
            cfg.hf_config = cfg.init_from
            _say(f"--init-from {cfg.init_from}: {type(config).__name__.replace('Config', '')} is no shardwise GPT "
                 f"shape ({e}); training the transformers model (as with --hf-config)")
        else:
            changed = [f"{k}={getattr(mapped, k)}" for k in _ARCH_FIELDS if getattr(mapped, k) != getattr(model_cfg, k)]
            _say(f"--init-from {cfg.init_from}: {config.model_type} maps to shardwise's GPT; model flags taken "
                 f"from its config ({', '.join(changed) or 'as given'}); add --hf-config {cfg.init_from} to "
                 f"train the transformers model instead")
            return mapped
    if encoder_only(config):
        raise ConfigError(flag, value, f"{type(config).__name__} ({config.model_type}) is an encoder: its attention "
                          f"sees the whole sequence, so next-token training would let each position see the token it "
                          f"predicts; use a causal LM's config (Llama, Qwen2, GPT-2...), or set \"is_decoder\": true "
                          f"in it for its causal-mask decoder form")
    try:
        build_hf_model(config, meta=True)  # a causal LM this transformers can build
    except ValueError as e:
        raise ConfigError(flag, value, str(e)) from None
    # The data check compares token ids with vocab_size; the rest of the GPT config is unused.
    return replace(model_cfg, vocab_size=config.get_text_config().vocab_size)


def build_model(cfg, model_cfg: GPTConfig, device: torch.device):
    """``(model, init_fn, unit_modules)`` for ``shardwise.app.train`` when ``--hf-config`` / ``--init-from`` is set.

    ``init_fn`` goes to ``fully_shard``; its ``finish()`` (called after
    sharding) reads the ``--init-from`` rows.
    """
    load = None
    if cfg.hf_config:
        config = load_config(cfg.hf_config)
        hf_model = build_hf_model(config, meta=cfg.meta_init or bool(cfg.init_from), device=device)
        model = HFCausalLM(hf_model)
        units = decoder_layer_classes(hf_model)
        if not dist.is_initialized() or dist.get_rank() == 0:
            out = Path(cfg.out_dir)
            out.mkdir(parents=True, exist_ok=True)
            (out / HF_CONFIG_FILE).write_text(hf_model.config.to_json_string(use_diff=False))
        if cfg.init_from:
            load = lambda m: init_from_folder(m, cfg.init_from)  # noqa: E731
        if not any(p.is_meta for p in model.parameters()):
            return model, None, units
        reset = hf_reset(hf_model)
        init_fn = MetaInit(model, device, reset=None if load else reset, buffer_reset=reset, load=load)
        return model, init_fn, units
    # --init-from alone with a GPT-shaped folder (resolve() mapped the config)
    with torch.device("meta"):
        model = GPT(model_cfg)
    units = list(dict.fromkeys(type(layer) for layer in model.layers))
    load = lambda m: init_from_folder(m, cfg.init_from, model_cfg)  # noqa: E731
    init_fn = MetaInit(model, device, reset=None, buffer_reset=lambda m: m.reset_parameters(), load=load)
    return model, init_fn, units
