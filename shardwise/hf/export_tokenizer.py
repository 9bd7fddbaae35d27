"""The tokenizer of an exported Hugging Face folder: the one the run trained with.

``shardwise ckpt export --format hf`` writes it beside the weights, so that
``AutoTokenizer.from_pretrained(OUT)`` gives the ids the model learnt. Which
tokenizer comes from the run's ``config.json`` (``train.tokenizer``):

* a tokenizer folder (``--tokenizer DIR``, or the ``--init-from`` folder's own):
  its tokenizer files are copied;
* a ``tokenizer.json`` file: copied, with the ``tokenizer_config.json`` beside it
  (else a minimal one naming ``PreTrainedTokenizerFast``);
* byte tokens (the default, ``bytes``): a byte-level ``tokenizer.json`` whose ids
  are the UTF-8 bytes 0-255, which is what the run trained on (written with the
  ``tokenizers`` package).

What cannot be written (no run config, the tokenizer gone, ``tokenizers``
missing) is said in one warning; the weights are exported all the same.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

__all__ = ["run_tokenizer", "export_tokenizer", "byte_tokenizer_json"]

_FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                 "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja")
_FAST = {"tokenizer_class": "PreTrainedTokenizerFast"}


def run_tokenizer(ckpt: Path, config: str | Path | None = None) -> tuple[str | None, str]:
    """``(train.tokenizer, eos_token)`` of the run checkpoint ``ckpt`` belongs to (or of ``config``, a run's
    config.json); ``(None, "")`` when there is no run config to say it."""
    candidates = ([Path(config)] if config is not None else []) + [folder / "config.json" for folder in
                                                                   (ckpt, ckpt.parent, ckpt.parent.parent)]
    for path in candidates:
        path = path / "config.json" if path.is_dir() else path
        try:
            train = json.loads(path.read_text()).get("train")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(train, dict) and "tokenizer" in train:
            return train["tokenizer"] or "bytes", train.get("eos_token") or ""
    return None, ""


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the printable character the ByteLevel pre-tokenizer uses."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def byte_tokenizer_json() -> str:
    """A ``tokenizer.json`` whose ids are the UTF-8 bytes (id ``b`` is byte ``b``), decoding back to the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_to_char()
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str()


def export_tokenizer(tokenizer: str | None, out: Path, eos_token: str = "") -> list[Path]:
    """Write the run's tokenizer into the export folder ``out``; the files written."""
    if tokenizer is None:
        warnings.warn(f"no tokenizer written to {out}: no run config.json says which one the run used (pass "
                      f"--config RUN/config.json)")
        return []
    written = []
    if tokenizer == "bytes":
        try:
            text = byte_tokenizer_json()
        except ImportError:
            warnings.warn(f"no tokenizer written to {out}: the run trained on UTF-8 bytes, and the byte-level "
                          f"tokenizer.json is written with the tokenizers package: pip install 'shardwise[data]'")
            return []
        (out / "tokenizer.json").write_text(text)
        (out / "tokenizer_config.json").write_text(json.dumps({**_FAST, "model_max_length": 2**30}, indent=2) + "\n")
        return [out / "tokenizer.json", out / "tokenizer_config.json"]
    source = Path(tokenizer)
    if source.is_dir():
        for name in _FOLDER_FILES:
            if (source / name).is_file():
                written.append(Path(shutil.copyfile(source / name, out / name)))
    elif source.is_file():
        written.append(Path(shutil.copyfile(source, out / "tokenizer.json")))
        beside = source.parent / "tokenizer_config.json"
        if beside.is_file():
            written.append(Path(shutil.copyfile(beside, out / "tokenizer_config.json")))
        else:
            (out / "tokenizer_config.json").write_text(json.dumps(
                {**_FAST, **({"eos_token": eos_token} if eos_token else {})}, indent=2) + "\n")
            written.append(out / "tokenizer_config.json")
    if not written:
        warnings.warn(f"no tokenizer written to {out}: the run's tokenizer {tokenizer} is no longer there (copy its "
                      f"files into {out} by hand)")
    return written
