"""``shardwise ckpt export CKPT OUT --format hf``: a folder ``transformers``' ``from_pretrained`` loads.

Offline like the plain export (no GPU, no process group, one tensor in memory
at a time): ``OUT/config.json`` plus ``model.safetensors`` (or
``model-0000i-of-0000N.safetensors`` with ``model.safetensors.index.json``
when ``max_shard_size`` splits it), with Hugging Face key names, and the run's
tokenizer (:mod:`.export_tokenizer`).

Which model the checkpoint holds comes from the run folder the checkpoint
lives in (``<run>/checkpoints/step_N``): its ``config.json`` and, for a run
trained with ``--hf-config``, the ``hf_config.json`` next to it; ``config=``
names either file (or a ``transformers`` ``config.json``) explicitly.

* shardwise's GPT becomes ``LlamaForCausalLM`` (attention layers only) or
  ``MixtralForCausalLM`` (MoE layers only), keys renamed, stacked experts
  written one tensor per expert as Mixtral checkpoints hold them; tied
  embeddings are written once (``tie_word_embeddings``), as ``transformers``
  saves them.
* A ``transformers`` model trained with ``--hf-config`` keeps its keys; where
  ``transformers`` saves a parameter in another layout (fused experts back to
  one tensor per expert) the export does the same, via ``transformers``' own
  ``revert_weight_conversion``.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..checkpoint.export import (
    DTYPES,
    checkpoint_info,
    parse_size,
    read_tensors,
    resolve_checkpoint,
    split_by_size,
    write_safetensors,
)
from .export_tokenizer import export_tokenizer, run_tokenizer
from .mapping import gpt_hf_keys, gpt_to_hf_config

__all__ = ["export_hf", "find_model_config"]

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_OUR_FILES = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?$")

# ------------------------------------------------------------------ which model
def _read_json(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise FileNotFoundError(f"{path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object")
    return data


def _from_run_config(path: Path, data: dict) -> tuple[str, dict]:
    train = data.get("train") or {}
    if train.get("hf_config"):
        for candidate in (path.parent / "hf_config.json", Path(train["hf_config"])):
            candidate = candidate / "config.json" if candidate.is_dir() else candidate
            if candidate.is_file():
                return "hf", _read_json(candidate)
        raise FileNotFoundError(f"{path}: the run trained a transformers model (--hf-config {train['hf_config']}) "
                                f"but neither {path.parent / 'hf_config.json'} nor that file exists")
    return "gpt", data["model"]


def find_model_config(ckpt: Path, config: str | os.PathLike | None = None) -> tuple[str, dict]:
    """``("gpt", GPTConfig fields)`` or ``("hf", transformers config dict)`` for checkpoint ``ckpt``."""
    if config is not None:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        data = _read_json(path)
        if "model_type" in data:
            return "hf", data
        if isinstance(data.get("model"), dict):
            return _from_run_config(path, data)
        if "dim" in data and "n_layers" in data:
            return "gpt", data
        raise ValueError(f"{path}: neither a run's config.json (train/model) nor a transformers config.json "
                         f"(model_type)")
    looked = []
    for folder in (ckpt, ckpt.parent, ckpt.parent.parent):
        run = folder / "config.json"
        looked.append(str(run))
        if run.is_file():
            data = _read_json(run)
            if isinstance(data.get("model"), dict):
                return _from_run_config(run, data)
            if "model_type" in data:
                return "hf", data
    raise FileNotFoundError(f"no run config.json next to {ckpt} (looked at {', '.join(looked)}); pass --config FILE "
                            f"(the run's config.json, or the transformers config.json of the model)")


# ------------------------------------------------------------------ plans
Plan = list[tuple[str, list[tuple[str, tuple, Callable[[torch.Tensor], torch.Tensor]]]]]
"""[(checkpoint tensor, [(HF key, shape, full tensor -> HF tensor), ...]), ...] in file order."""


def _gpt_plan(model: dict, saved: dict[str, dict]) -> tuple[Plan, dict]:
    hf_config = gpt_to_hf_config(model)
    groups: dict[str, list] = {}
    for gpt_name, hf_name, expert in gpt_hf_keys(model):
        if gpt_name not in saved:
            raise KeyError(f"the checkpoint holds no {gpt_name} (the run's model config says it should)")
        shape = tuple(saved[gpt_name]["shape"])
        if expert is None:
            groups.setdefault(gpt_name, []).append((hf_name, shape, lambda t: t))
        else:
            groups.setdefault(gpt_name, []).append((hf_name, shape[1:], lambda t, e=expert: t[e]))
    extra = sorted(set(saved) - set(groups))
    if extra:
        raise ValueError(f"the checkpoint holds tensors the {hf_config['architectures'][0]} mapping does not know: "
                         f"{extra[:6]}")
    return list(groups.items()), hf_config


def _hf_plan(config: dict, saved: dict[str, dict]) -> tuple[Plan, dict]:
    from .load import _reverted_keys
    from .models import build_hf_model, require_transformers

    transformers = require_transformers("--format hf for a model trained with --hf-config")
    data = dict(config)
    hf_config = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
    model = build_hf_model(hf_config, meta=True)
    declared = getattr(model, "_tied_weights_keys", None)
    tie = bool(getattr(hf_config.get_text_config(), "tie_word_embeddings", False))
    tied = dict(declared) if isinstance(declared, dict) and tie else {}  # {alias: canonical}, HF's names
    params = dict(model.named_parameters())  # tied weights once, under HF's canonical name
    expected = {n: tuple(p.shape) for n, p in params.items()}
    param_ids = {id(p) for p in params.values()}
    expected.update({n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()
                     if n not in expected and id(t) not in param_ids})  # persistent buffers

    def hf_name(name: str) -> str:  # a tied weight saved under HF's alias name gets HF's canonical one
        return tied[name] if name in tied and tied[name] not in saved else name

    names = {hf_name(n): n for n in saved}
    missing = sorted(set(expected) - set(names))
    unexpected = sorted(set(names) - set(expected))
    if missing or unexpected:
        raise ValueError(f"the checkpoint does not match {type(model).__name__} of this config: "
                         f"missing {missing[:6]}, unexpected {unexpected[:6]}")
    plan: Plan = []
    for name in expected:  # the model's order
        source = names[name]
        shape = tuple(saved[source]["shape"])
        reverted = _reverted_keys(model, name, shape) or {name: shape}
        if list(reverted) == [name]:
            plan.append((source, [(name, shape, lambda t: t)]))
            continue

        # revert once per checkpoint tensor; each HF key takes its piece of the result
        cache: dict = {}

        def piece(t, name=name, cache=cache):
            if cache.get("tensor") is not t:
                from transformers.core_model_loading import revert_weight_conversion
                cache.clear()
                cache.update(tensor=t, out=revert_weight_conversion(model, {name: t}))
            return cache["out"]

        plan.append((source, [(key, tuple(shp), lambda t, key=key, piece=piece: piece(t)[key])
                              for key, shp in reverted.items()]))
    out_config = dict(config)
    if not out_config.get("architectures"):
        out_config["architectures"] = [type(model).__name__]
    return plan, out_config


# ------------------------------------------------------------------ export
def _verify(ckpt: Path) -> None:
    """Check the checkpoint's files against the sha256 recorded at save, where shardwise records them."""
    try:
        from ..checkpoint.integrity import verify_checkpoint
    except ImportError:  # checkpoints without recorded digests
        return
    report = verify_checkpoint(ckpt)
    if not report["ok"]:
        raise ValueError(f"checkpoint {ckpt} is damaged: {'; '.join(report['problems'])}")


def export_hf(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
              max_shard_size: int | str | None = None, config: str | os.PathLike | None = None,
              verify: bool = True) -> list[Path]:
    """Write checkpoint ``ckpt``'s model as a Hugging Face folder ``out``; return the files written.

    ``ckpt`` is a checkpoint, a folder of them (its latest complete one) or a run folder.

    ``dtype`` casts floating tensors (default: as saved, fp32) and is recorded
    in ``config.json``; ``max_shard_size`` (bytes or ``"2GB"``) splits the
    weights into shards plus ``model.safetensors.index.json``; ``verify``
    checks the checkpoint's files first (as the plain export does).
    """
    run = Path(ckpt)
    if (run / "checkpoints").is_dir() and (run / "config.json").is_file():  # a run folder: its checkpoints
        ckpt = run / "checkpoints"
    ckpt = resolve_checkpoint(ckpt)
    if verify:
        _verify(ckpt)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    limit = parse_size(max_shard_size) if max_shard_size is not None else None
    out = Path(out)
    if out.suffix == ".safetensors" or out.is_file():
        raise ValueError(f"{out}: --format hf writes a folder (config.json and model.safetensors), not a file")
    kind, model_config = find_model_config(ckpt, config)
    info = checkpoint_info(ckpt)
    saved = info["model"]
    if kind == "gpt":
        plan, hf_config = _gpt_plan(model_config, saved)
    else:
        plan, hf_config = _hf_plan(model_config, saved)

    def out_dtype(source: str) -> torch.dtype:
        src = getattr(torch, saved[source]["dtype"])
        return dtype if dtype is not None and src.is_floating_point else src

    entries = [(key, shape, out_dtype(source), source) for source, outs in plan for key, shape, _ in outs]
    float_dtypes = {d for _, _, d, _ in entries if d.is_floating_point}
    shards = split_by_size([e[:3] for e in entries], limit)

    out.mkdir(parents=True, exist_ok=True)
    for old in out.iterdir():  # a previous export's weights would mix with these
        if _OUR_FILES.match(old.name):
            old.unlink()
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    converters = {key: fn for _, outs in plan for key, _, fn in outs}

    def stream(indices: list[int]) -> Iterator[tuple[str, torch.Tensor]]:
        """Each checkpoint tensor read once (one in memory at a time), cut into its HF tensors."""
        current, tensor = None, None
        for i in indices:
            key, _, _, source = entries[i]
            if source != current:
                tensor = None  # drop the previous one before reading the next
                tensor = next(read_tensors(ckpt, [source]))[1]
                current = source
            yield key, converters[key](tensor)

    written = []
    metadata = {"format": "pt", "shardwise_step": str(info["meta"].get("step"))}
    for name, indices in zip(names, shards):
        path = out / name
        write_safetensors(path, [entries[i][:3] for i in indices], stream(indices), metadata)
        written.append(path)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(math.prod(s) * d.itemsize for _, s, d, _ in entries)},
                 "weight_map": {entries[i][0]: names[k] for k, indices in enumerate(shards) for i in indices}}
        path = out / "model.safetensors.index.json"
        path.write_text(json.dumps(index, indent=2) + "\n")
        written.append(path)
    if len(float_dtypes) == 1:
        name = _DTYPE_NAMES.get(float_dtypes.pop())
        if name:
            hf_config["dtype"] = name
            hf_config.pop("torch_dtype", None)
    path = out / "config.json"
    path.write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    written.append(path)
    tokenizer, eos_token = run_tokenizer(ckpt, config)  # the ids the model learnt: AutoTokenizer reads them here
    return written + export_tokenizer(tokenizer, out, eos_token)
