"""Hugging Face in and out: train ``transformers`` causal LMs, start from HF weights, export HF folders.

* ``shardwise train --hf-config CONFIG.json``: any ``transformers`` causal LM
  built from a config, sharded per decoder layer (``_no_split_modules``),
  trained with its own loss (:mod:`shardwise.hf.models`; the command side is
  :mod:`shardwise.app.hf_train`).
* ``shardwise train --init-from HF_FOLDER``: start from a ``save_pretrained``
  folder; the model is built on the meta device and every rank reads only its
  own rows with ``safe_open(...).get_slice`` (:mod:`shardwise.hf.load`).
* ``shardwise ckpt export CKPT OUT --format hf``: ``config.json`` and
  safetensors with HF key names that ``from_pretrained`` loads
  (:mod:`shardwise.hf.export`); shardwise's GPT maps to ``LlamaForCausalLM`` /
  ``MixtralForCausalLM`` (:mod:`shardwise.hf.mapping`).

``transformers`` is an optional extra (``pip install 'shardwise[hf]'``); the
mapping and the export of shardwise's own models do not need it.
"""

from .mapping import gpt_hf_keys, gpt_to_hf_config, hf_to_gpt_fields

__all__ = ["gpt_hf_keys", "gpt_to_hf_config", "hf_to_gpt_fields", "export_hf", "init_from_folder", "HFCausalLM",
           "load_config", "build_hf_model", "decoder_layer_classes", "INSTALL_HINT"]


def __getattr__(name):  # the parts that need transformers (or torch.distributed) load on first use
    if name == "export_hf":
        from .export import export_hf

        return export_hf
    if name == "init_from_folder":
        from .load import init_from_folder

        return init_from_folder
    if name in ("HFCausalLM", "load_config", "build_hf_model", "decoder_layer_classes", "INSTALL_HINT"):
        from . import models

        return getattr(models, name)
    raise AttributeError(name)
