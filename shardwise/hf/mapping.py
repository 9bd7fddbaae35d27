"""shardwise's reference models in Hugging Face terms: configs and key names, both ways.

:class:`shardwise.models.GPT` is a Llama-style decoder, so a model of attention
layers only (``layer_pattern`` of ``A``) is a ``LlamaForCausalLM`` and a model of
mixture-of-experts layers only (``E``) is a ``MixtralForCausalLM``: same
shapes, same math (RMSNorm, rotate-half RoPE, SwiGLU, softmax-top-k router with
renormalized weights). Mamba layers, and patterns that mix dense and MoE layers
(``AE``), have no ``transformers`` equivalent and are refused with the reason.

Nothing here imports ``transformers``: the configs are plain dicts (what
``config.json`` holds) or objects with the same attributes.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Iterator

from ..models import GPTConfig

__all__ = [
    "MAPPABLE_MODEL_TYPES",
    "gpt_to_hf_config",
    "hf_to_gpt_fields",
    "gpt_hf_keys",
    "hf_architecture",
]

MAPPABLE_MODEL_TYPES = ("llama", "mistral", "mixtral")
"""``model_type`` values that :func:`hf_to_gpt_fields` can turn into a :class:`GPTConfig`."""

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}


def _as_gpt_config(config: GPTConfig | dict) -> GPTConfig:
    if isinstance(config, GPTConfig):
        return config
    known = {f.name for f in fields(GPTConfig)}
    return GPTConfig(**{k: v for k, v in config.items() if k in known})


def hf_architecture(config: GPTConfig | dict) -> str:
    """``llama`` or ``mixtral`` for a GPT config; ``ValueError`` naming why there is none."""
    c = _as_gpt_config(config)
    kinds = set(c.layer_kinds)
    if "M" in kinds:
        raise ValueError(f"layer_pattern={c.layer_pattern!r} has Mamba layers (M), which no transformers "
                         f"causal LM matches")
    if kinds == {"A"}:
        return "llama"
    if kinds == {"E"}:
        return "mixtral"
    raise ValueError(f"layer_pattern={c.layer_pattern!r} mixes dense (A) and MoE (E) layers; LlamaForCausalLM "
                     f"has dense layers only and MixtralForCausalLM MoE layers only (use A or E)")


def gpt_to_hf_config(config: GPTConfig | dict) -> dict[str, Any]:
    """The ``config.json`` of the ``LlamaForCausalLM`` / ``MixtralForCausalLM`` equal to a GPT config."""
    c = _as_gpt_config(config)
    c.validate()
    arch = hf_architecture(c)
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": c.vocab_size,
        "hidden_size": c.dim,
        "intermediate_size": c.ffn_hidden if arch == "llama" else c.moe_ffn_hidden,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": c.max_seq_len,
        "initializer_range": c.init_std,
        "rms_norm_eps": c.norm_eps,
        "tie_word_embeddings": bool(c.tie_embeddings),
        # transformers >= 5 reads rope_parameters, 4.x reads rope_theta; both say the same
        "rope_theta": c.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if arch == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    else:
        out.update(num_local_experts=c.moe_num_experts, num_experts_per_tok=c.moe_top_k,
                   router_aux_loss_coef=c.moe_aux_loss_coef, output_router_logits=False, router_jitter_noise=0.0,
                   sliding_window=None)
    return out


def _get(config, name: str, default=None):
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def _rope(config) -> tuple[str, float]:
    params = _get(config, "rope_parameters") or {}
    scaling = _get(config, "rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", _get(config, "rope_theta", 10000.0))
    return kind, float(theta)


def hf_to_gpt_fields(config) -> dict[str, Any]:
    """GPT config fields of the model a ``transformers`` config describes; ``ValueError`` if GPT differs.

    ``config`` is a ``PretrainedConfig`` (or a full ``config.json`` dict).
    Accepted: ``llama``, ``mistral`` and ``mixtral`` without biases, with SiLU,
    default RoPE, no sliding window and ``head_dim = hidden_size / heads``.
    """
    model_type = _get(config, "model_type")
    if model_type not in MAPPABLE_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not Llama/Mistral/Mixtral-shaped")
    hidden, heads = _get(config, "hidden_size"), _get(config, "num_attention_heads")
    why = []
    if _get(config, "hidden_act", "silu") not in ("silu", "swish"):
        why.append(f"hidden_act={_get(config, 'hidden_act')!r} (GPT uses SiLU)")
    for name in ("attention_bias", "mlp_bias"):
        if _get(config, name, False):
            why.append(f"{name}=True (GPT has no biases)")
    kind, theta = _rope(config)
    if kind != "default":
        why.append(f"rope_type={kind!r} (GPT has default RoPE)")
    if _get(config, "sliding_window") is not None:
        why.append(f"sliding_window={_get(config, 'sliding_window')} (GPT attends to the whole sequence)")
    head_dim = _get(config, "head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        why.append(f"head_dim={head_dim} is not hidden_size/num_attention_heads={hidden // heads}")
    if why:
        raise ValueError("; ".join(why))
    out = dict(
        vocab_size=_get(config, "vocab_size"), dim=hidden, n_layers=_get(config, "num_hidden_layers"),
        n_heads=heads, n_kv_heads=_get(config, "num_key_value_heads") or heads,
        ffn_hidden=_get(config, "intermediate_size"), max_seq_len=_get(config, "max_position_embeddings", 2048),
        rope_theta=theta, norm_eps=float(_get(config, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(_get(config, "tie_word_embeddings", False)),
        init_std=float(_get(config, "initializer_range", 0.02)), layer_pattern="",
    )
    if model_type == "mixtral":
        out.update(layer_pattern="E", moe_num_experts=_get(config, "num_local_experts"),
                   moe_top_k=_get(config, "num_experts_per_tok"), moe_ffn_hidden=_get(config, "intermediate_size"),
                   moe_aux_loss_coef=float(_get(config, "router_aux_loss_coef", 0.001)))
    return out


def gpt_hf_keys(config: GPTConfig | dict) -> Iterator[tuple[str, str, int | None]]:
    """``(gpt_name, hf_name, expert)`` for every HF tensor, in ``transformers``' save order per layer.

    ``expert`` is ``None`` when the HF tensor is the whole GPT parameter, else
    the index along dim 0 of GPT's stacked expert weight (Mixtral keeps one
    tensor per expert). Tied embeddings have no ``lm_head.weight``.
    """
    c = _as_gpt_config(config)
    arch = hf_architecture(c)
    yield "embed.weight", "model.embed_tokens.weight", None
    for i in range(c.n_layers):
        g, h = f"layers.{i}.", f"model.layers.{i}."
        yield g + "attention_norm.weight", h + "input_layernorm.weight", None
        for ours, theirs in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            yield g + f"attention.{ours}.weight", h + f"self_attn.{theirs}.weight", None
        yield g + "mlp_norm.weight", h + "post_attention_layernorm.weight", None
        if arch == "llama":
            for ours, theirs in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                yield g + f"mlp.{ours}.weight", h + f"mlp.{theirs}.weight", None
        else:
            yield g + "mlp.router", h + "block_sparse_moe.gate.weight", None
            for w in ("w1", "w2", "w3"):
                for e in range(c.moe_num_experts):
                    yield g + f"mlp.experts.{w}", h + f"block_sparse_moe.experts.{e}.{w}.weight", e
    yield "norm.weight", "model.norm.weight", None
    if not c.tie_embeddings:
        yield "output.weight", "lm_head.weight", None
