"""--hf-config trains transformers models; --init-from starts from HF weights; --format hf exports both.

Training runs ``shardwise.app.train.train`` on the 2-process gloo pool (what each
spawned worker of ``shardwise train`` runs), with the configuration resolved
from command-line flags by ``resolve_config``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (the test extra installs it: missing, it must fail, not skip)


from tests.helpers import REPO
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_cases import export_and_compare, save_folder, train_then_logits, write_config


DATA = str(REPO / "shardwise" / "models")  # a few hundred KB of text, byte tokens


def _flags(out_dir: Path, *extra: str, steps: int = 4) -> list[str]:
    return ["--out-dir", str(out_dir), "--data", DATA, "--steps", str(steps), "--save-every", str(steps),
            "--seq-len", "32", "--micro-batch-size", "2", "--lr", "3e-3", "--warmup-steps", "0", *extra]


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", ["llama", "qwen2", "mixtral"])
def test_hf_config_trains_and_exports(tmp_path, name):
    config = write_config(tmp_path / f"{name}.json", name)
    run = tmp_path / "run"
    step, logits, cls = run_distributed(train_then_logits, 2, _flags(run, "--hf-config", str(config)))[0]
    losses = _losses(run)
    assert step == 4 and len(losses) == 4 and all(map(torch.isfinite, torch.tensor(losses)))
    assert losses[-1] < losses[0], losses
    assert cls == "ShardedHFCausalLM"
    assert json.loads((run / "hf_config.json").read_text())["model_type"] == name
    summary = json.loads((run / "summary.json").read_text())  # named by its source, not the preset's model
    assert (summary["model"], summary["preset"]) == (f"hf-config:{name}.json", None)
    exported = export_and_compare(run, logits, tmp_path / "hf", *(["--max-shard-size", "60KB"] if name == "mixtral"
                                                                    else []))
    assert exported["model_type"] == name
    if name == "mixtral":  # written as transformers saves Mixtral: one tensor per expert
        index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in index["weight_map"]


def _first_batch_loss(folder: Path, seq_len: int = 32, micro_batch_size: int = 2, world: int = 2) -> float:
    """The HF model's loss on step 1's global batch of ``shardwise train --data DATA`` (mean over ranks)."""
    from transformers import AutoModelForCausalLM

    from shardwise.app.data import TokenLoader, load_tokens

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    data, losses = load_tokens(DATA), []
    for rank in range(world):
        inputs, targets = next(TokenLoader(data, seq_len, micro_batch_size, rank, world, 0, torch.device("cpu")))
        with torch.no_grad():
            logits = model(inputs).logits
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item())
    return sum(losses) / world


def test_round_trip_init_from_train_export(tmp_path):
    """HF folder -> --init-from -> 5 steps on 2 processes -> checkpoint -> --format hf -> from_pretrained."""
    source = tmp_path / "llama"
    save_folder(source, "llama", max_shard_size="40KB")  # shards + index, tied embeddings
    run = tmp_path / "run"
    step, logits, cls = run_distributed(train_then_logits, 2, _flags(run, "--init-from", str(source), steps=5))[0]
    assert step == 5 and cls == "ShardedGPT"  # a Llama folder trains as shardwise's own GPT of its shape
    model = json.loads((run / "config.json").read_text())["model"]
    assert (model["dim"], model["n_layers"], model["n_kv_heads"], model["tie_embeddings"]) == (32, 2, 2, True)
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["model"], summary["preset"]) == ("init-from:llama", None)
    losses = _losses(run)
    # step 1 started from the folder's weights: its loss is the HF model's on the same batch
    assert losses[0] == pytest.approx(_first_batch_loss(source), rel=1e-5)
    assert losses[-1] < losses[0], losses
    exported = export_and_compare(run, logits, tmp_path / "hf")  # the trained weights, as a Llama again
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["tie_word_embeddings"] is True


def test_without_transformers_the_flags_say_how_to_install(tmp_path, monkeypatch, capsys):
    from shardwise.app.train import main

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    for flag in ("--hf-config", "--init-from"):
        assert main([flag, str(tmp_path), "--out-dir", str(tmp_path / "run")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"shardwise train: error: {flag} {tmp_path}: needs the transformers package"), err
        assert "pip install 'shardwise[hf]'" in err and len(err.splitlines()) == 1
