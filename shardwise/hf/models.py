"""Train ``transformers`` causal LMs with shardwise: build from a config, wrap, initialize per unit.

    model = HFCausalLM(build_hf_model(load_config("config.json"), meta=True))
    model = shardwise.fully_shard(model, unit_modules=decoder_layer_classes(model.hf_model),
                                  init_fn=HFInitializer(model, device))   # HF's own init, one layer at a time
    loss = model(tokens, targets)       # the model's own loss (and router aux loss where it has one)

:class:`HFCausalLM` adopts the HF model's children, so its parameter names
(and the checkpoints' keys) are exactly ``transformers``' (``model.layers.0...``,
``lm_head.weight``); ``model.hf_model`` is the HF model itself, sharing them.
"""

from __future__ import annotations

import contextlib
import importlib
import json
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from ..engine.fp8 import quiet_torchao_import
from ..engine.materialize import allocate_meta_tensors, meta_tensor_names

__all__ = [
    "INSTALL_HINT",
    "require_transformers",
    "load_config",
    "build_hf_model",
    "decoder_layer_classes",
    "encoder_only",
    "HFCausalLM",
    "MetaInit",
]

INSTALL_HINT = "pip install 'shardwise[hf]' (in a checkout: pip install -e '.[hf]')"


def require_transformers(what: str = "this"):
    """The ``transformers`` module, or ``ImportError`` saying how to install it."""
    try:
        with quiet_torchao_import():
            import transformers
            with contextlib.suppress(ImportError):  # its torchao glue imports torchao (when installed), whose
                importlib.import_module("transformers.integrations.torchao")  # import notices are noise here
    except ImportError:
        raise ImportError(f"{what} needs the transformers package, an optional extra: {INSTALL_HINT}") from None
    return transformers


def load_config(path: str | Path):
    """A ``PretrainedConfig`` from a ``config.json`` file or a folder holding one."""
    transformers = require_transformers("a Hugging Face config")
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no such file" + (" (a save_pretrained folder has config.json)"
                                                            if path.is_dir() else ""))
    try:
        raw = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{file}: not a transformers config (no model_type)")
    model_type = raw.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **raw)
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


def build_hf_model(config, meta: bool = False, device: torch.device | str | None = None) -> nn.Module:
    """``AutoModelForCausalLM.from_config(config)`` in fp32, on the meta device or on ``device``."""
    transformers = require_transformers("a Hugging Face model")
    if type(config) not in transformers.AutoModelForCausalLM._model_mapping:
        raise ValueError(f"{type(config).__name__} ({config.model_type}) has no causal-LM class in transformers "
                         f"{transformers.__version__}")
    with torch.device("meta" if meta else (device or "cpu")):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except TypeError:  # transformers < 4.56 names it torch_dtype
            model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]
    return model


def encoder_only(config) -> bool:
    """Whether ``config`` describes an encoder (BERT and its kin): a model whose causal-LM class exists but whose
    attention sees the whole sequence unless the config says ``is_decoder``, so a next-token loss would let each
    position see the token it predicts. Encoder-decoder configs (BART) are not: their causal LM is the decoder."""
    require_transformers("a Hugging Face model")
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return (config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and getattr(config, "is_decoder", None) is False
            and not getattr(config, "is_encoder_decoder", False))


def decoder_layer_classes(hf_model: nn.Module) -> list[type]:
    """The classes named by ``_no_split_modules`` that occur in the model (its decoder layers)."""
    names = set(getattr(hf_model, "_no_split_modules", None) or ())
    found = list(dict.fromkeys(type(m) for m in hf_model.modules() if type(m).__name__ in names))
    if not found:
        raise ValueError(f"{type(hf_model).__name__} names no layer class in _no_split_modules "
                         f"({sorted(names) or 'none'}) that it contains; cannot pick sharding units")
    return found


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM with shardwise's calling convention.

    ``forward(tokens)`` gives the logits; ``forward(tokens, targets)`` the
    model's own loss, with ``targets`` already shifted (``targets[:, i]`` is
    the token after ``tokens[:, i]``, as ``shardwise.app.data`` yields them), so
    every position counts. Parameter names are the HF model's.
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        own = [n for n, _ in hf_model.named_parameters(recurse=False)]
        own += [n for n, _ in hf_model.named_buffers(recurse=False)]
        if own:
            raise ValueError(f"{type(hf_model).__name__} holds tensors of its own ({own}); HFCausalLM needs them "
                             f"in submodules")
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self.__dict__["hf_model"] = hf_model  # the same children, not registered twice
        self.__dict__["config"] = hf_model.config

    def forward(self, tokens, targets=None, **kwargs):
        if targets is None:
            return self.hf_model(input_ids=tokens, use_cache=False, **kwargs).logits
        targets = targets.contiguous()  # the loss views them flat
        out = self.hf_model(input_ids=tokens, labels=targets, shift_labels=targets, use_cache=False, **kwargs)
        return out.loss

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """6 x parameters + 12 x layers x hidden x seq (all parameters counted, so MoE is over-counted)."""
        c = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
        layers, hidden = getattr(c, "num_hidden_layers", 0), getattr(c, "hidden_size", 0)
        return 6 * self.num_params() + 12 * layers * hidden * seq_len


class MetaInit:
    """``init_fn`` for ``fully_shard``: give a meta-built model's tensors storage one unit at a time.

    ``reset(module)`` gives the values of a module whose tensors were just
    allocated: the model's own initialization for a fresh model, or ``None``
    to leave parameters uninitialized because ``load`` fills them after
    sharding (only modules with meta *buffers* then get ``buffer_reset``, e.g.
    RoPE tables). :meth:`finish` covers what no unit held and then calls
    ``load(root)``. Ranks build units in the same order, so a random
    initialization is the same on every rank.
    """

    def __init__(self, root: nn.Module, device: torch.device, reset: Callable[[nn.Module], None] | None = None,
                 buffer_reset: Callable[[nn.Module], None] | None = None,
                 load: Callable[[nn.Module], object] | None = None):
        self.root, self.device = root, torch.device(device)
        self.reset, self.buffer_reset, self.load = reset, buffer_reset or reset, load
        self.memo: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}
        self.load_result = None

    @torch.no_grad()
    def __call__(self, owner: nn.Module, device: torch.device | None = None) -> None:
        device = torch.device(device) if device is not None else self.device
        for module in owner.modules():
            params, buffers = meta_tensor_names(module)
            if not params and not buffers:
                continue
            if not allocate_meta_tensors(module, params, buffers, device, self.memo):
                continue  # only re-bound ties: already initialized
            if self.reset is not None and params:
                self.reset(module)
            elif buffers:
                if self.buffer_reset is None:
                    raise ValueError(f"{type(module).__name__} holds meta buffers {buffers} and nothing computes them")
                self.buffer_reset(module)

    def finish(self) -> None:
        self(self.root, self.device)
        if self.load is not None:
            self.load_result = self.load(self.root)


def hf_reset(hf_model: nn.Module) -> Callable[[nn.Module], None]:
    """``reset(module)`` with ``transformers``' own initialization (the ``_init_weights`` of the
    innermost ``PreTrainedModel`` holding the module)."""
    from transformers import PreTrainedModel

    owner: dict[int, nn.Module] = {}
    for pm in hf_model.modules():
        if isinstance(pm, PreTrainedModel):
            for m in pm.modules():
                owner[id(m)] = pm

    def reset(module: nn.Module) -> None:
        pm = owner.get(id(module), hf_model)
        with torch.no_grad():
            pm._init_weights(module)

    return reset
