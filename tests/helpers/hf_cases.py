"""Tiny Hugging Face configs and folders shared by the tests/hf/test_hf_*.py files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64)
CONFIGS = {
    "llama": dict(model_type="llama", intermediate_size=64, tie_word_embeddings=True, **TINY),
    "qwen2": dict(model_type="qwen2", intermediate_size=64, **TINY),  # q/k/v biases: no GPT shape
    "mixtral": dict(model_type="mixtral", intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, **TINY),
}


def tokens(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def write_config(path: Path, name: str) -> Path:
    path.write_text(json.dumps(CONFIGS[name]))
    return path


def save_folder(folder: Path, name: str, seed: int = 0, **save_kwargs) -> torch.Tensor:
    """A random ``save_pretrained`` folder of config ``name``; returns its logits on :func:`tokens`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    data = dict(CONFIGS[name])
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder, **save_kwargs)
    with torch.no_grad():
        return model(tokens()).logits


def hf_logits(folder) -> tuple[torch.Tensor, dict]:
    """``from_pretrained(folder)``'s logits on :func:`tokens` and its loading info."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    with torch.no_grad():
        return model.eval()(tokens()).logits, info


def tensor_bytes(folder) -> int:
    from safetensors import safe_open

    total = 0
    for f in Path(folder).glob("*.safetensors"):
        with safe_open(f, framework="pt") as h:
            for key in h.keys():
                s = h.get_slice(key)
                n = 1
                for d in s.get_shape():
                    n *= d
                total += n * {"F32": 4, "BF16": 2, "F16": 2}[s.get_dtype()]
    return total


def train_then_logits(argv: list[str]):
    """On every rank: ``shardwise train``'s worker with these flags, then the last checkpoint loaded into a
    freshly built sharded model; returns (step, its logits on :func:`tokens`, its class name)."""
    import shardwise
    from shardwise.checkpoint import CheckpointManager
    from shardwise.app.hf_train import build_model
    from shardwise.models import GPT
    from shardwise.app.train import resolve_config, train

    cfg, model_cfg = resolve_config(argv)
    train(cfg, model_cfg)
    torch.manual_seed(123)  # another init: every value must come from the checkpoint
    if cfg.hf_config:
        model, init_fn, units = build_model(type(cfg)(**{**vars(cfg), "init_from": ""}), model_cfg,
                                            torch.device("cpu"))
    else:
        with torch.device("meta"):
            model = GPT(model_cfg)
        init_fn, units = shardwise.MetaInitializer(model, torch.device("cpu")), [type(b) for b in model.layers]
    model = shardwise.fully_shard(model, unit_modules=list(dict.fromkeys(units)), init_fn=init_fn)
    init_fn.finish()
    restored = CheckpointManager(Path(cfg.out_dir) / "checkpoints").load_latest(model)
    with torch.no_grad():
        return restored.step, model.eval()(tokens()), type(model).__name__


def export_and_compare(run: Path, logits: torch.Tensor, out: Path, *args: str) -> dict:
    """``shardwise ckpt export RUN/checkpoints OUT --format hf``; from_pretrained(OUT) loads it with no missing
    or unexpected keys and gives ``logits`` (fp32, 1e-5). Returns the exported config.json."""
    from shardwise.app.ckpt import main as ckpt_main

    assert ckpt_main(["export", str(run / "checkpoints"), str(out), "--format", "hf", *args]) == 0
    hf, info = hf_logits(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    torch.testing.assert_close(hf, logits, rtol=0, atol=1e-5)
    _same_tokenizer(run, out)
    return json.loads((out / "config.json").read_text())


def _same_tokenizer(run: Path, out: Path) -> None:
    """The export's tokenizer gives the ids the run trained on (UTF-8 bytes, or the run's --tokenizer's)."""
    from transformers import AutoTokenizer

    used = json.loads((run / "config.json").read_text())["train"]["tokenizer"]
    text = "héllo wörld\n\tdef f(x):  return x  # 日本"
    ids = AutoTokenizer.from_pretrained(str(out))(text, add_special_tokens=False)["input_ids"]
    if used == "bytes":
        assert ids == list(text.encode()), ids
    else:
        from tokenizers import Tokenizer

        source = Path(used) / "tokenizer.json" if Path(used).is_dir() else Path(used)
        assert ids == Tokenizer.from_file(str(source)).encode(text, add_special_tokens=False).ids
