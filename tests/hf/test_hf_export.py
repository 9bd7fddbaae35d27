"""``shardwise ckpt export --format hf`` of shardwise's own GPT: LlamaForCausalLM / MixtralForCausalLM."""

from __future__ import annotations

import json

import pytest


from tests.helpers import REPO
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_cases import export_and_compare, train_then_logits

DATA = str(REPO / "shardwise" / "models")
TINY = ["--data", DATA, "--steps", "2", "--save-every", "2", "--seq-len", "32", "--micro-batch-size", "2"]


@pytest.mark.parametrize("preset, extra, arch", [
    ("tiny", [], "LlamaForCausalLM"),
    ("tiny", ["--tie-embeddings", "--precision", "bf16"], "LlamaForCausalLM"),
    ("tiny-moe", ["--layer-pattern", "E"], "MixtralForCausalLM"),
])
def test_presets_export_to_transformers(tmp_path, preset, extra, arch):
    run = tmp_path / "run"
    argv = ["--preset", preset, "--out-dir", str(run), *TINY, *extra]
    step, logits, _ = run_distributed(train_then_logits, 2, argv)[0]
    assert step == 2
    config = export_and_compare(run, logits, tmp_path / "hf", *(["--max-shard-size", "200KB"] if preset == "tiny"
                                                                  else []))
    assert config["architectures"] == [arch]
    assert config["tie_word_embeddings"] is ("--tie-embeddings" in extra)
    if preset == "tiny":
        index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert ("lm_head.weight" in index["weight_map"]) is not config["tie_word_embeddings"]


def test_unmappable_patterns_and_missing_config_are_one_line_errors(tmp_path, capsys):
    from shardwise.app.ckpt import main as ckpt_main
    from shardwise.hf.mapping import gpt_to_hf_config
    from shardwise.models import GPTConfig

    with pytest.raises(ValueError, match="mixes dense"):
        gpt_to_hf_config(GPTConfig(layer_pattern="AE"))
    with pytest.raises(ValueError, match="Mamba"):
        gpt_to_hf_config(GPTConfig(layer_pattern="AM", dim=64, n_heads=2, mamba_head_dim=32))
    # a checkpoint outside a run folder needs --config
    run = tmp_path / "run"
    run_distributed(train_then_logits, 2, ["--preset", "tiny-moe", "--out-dir", str(run), *TINY, "--steps", "1",
                                           "--save-every", "1", "--dim", "32", "--n-layers", "2"])
    capsys.readouterr()
    assert ckpt_main(["export", str(run / "checkpoints"), str(tmp_path / "hf"), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert "layer_pattern='AE' mixes dense (A) and MoE (E) layers" in err and len(err.strip().splitlines()) == 1
    (run / "config.json").rename(tmp_path / "elsewhere.json")
    assert ckpt_main(["export", str(run / "checkpoints"), str(tmp_path / "hf"), "--format", "hf"]) == 2
    assert "pass --config FILE" in capsys.readouterr().err


def test_config_mapping_round_trip():
    import transformers

    from shardwise.hf.mapping import gpt_to_hf_config, hf_to_gpt_fields
    from shardwise.models import GPTConfig

    for gpt in (GPTConfig(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=96, rope_theta=5e5, norm_eps=1e-6,
                          tie_embeddings=True, max_seq_len=256, init_std=0.01),
                GPTConfig(dim=64, n_layers=2, n_heads=4, layer_pattern="E", moe_num_experts=4, moe_top_k=2,
                          moe_ffn_hidden=80, moe_aux_loss_coef=0.02)):
        data = gpt_to_hf_config(gpt)
        hf = transformers.AutoConfig.for_model(data.pop("model_type"), **data)
        fields = hf_to_gpt_fields(hf)
        assert all(getattr(gpt, k) == v for k, v in fields.items() if k != "ffn_hidden" or not gpt.layer_pattern), \
            {k: (getattr(gpt, k), v) for k, v in fields.items() if getattr(gpt, k) != v}
    qwen2 = transformers.AutoConfig.for_model("qwen2", hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="qwen2"):
        hf_to_gpt_fields(qwen2)
    llama = transformers.AutoConfig.for_model("llama", hidden_size=64, num_attention_heads=4, attention_bias=True,
                                              rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ValueError, match="attention_bias=True .*rope_type='linear'"):
        hf_to_gpt_fields(llama)


def test_the_export_carries_the_runs_tokenizer(tmp_path):
    """A run's --tokenizer file (or folder) goes into the export as AutoTokenizer reads it; one gone is a warning."""
    pytest.importorskip("tokenizers")
    from transformers import AutoTokenizer

    from shardwise.hf.export_tokenizer import export_tokenizer, run_tokenizer
    from tests.helpers.text_data import documents, train_tokenizer

    (tmp_path / "tok").mkdir()
    source = train_tokenizer(tmp_path / "tok" / "tokenizer.json", documents(40), vocab_size=300)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    text = " ".join(documents(3, seed=5))
    for used in (source, source.parent):  # a tokenizer.json file, a tokenizer folder
        (tmp_path / "run" / "config.json").write_text(json.dumps({"train": {"tokenizer": str(used)}, "model": {}}))
        out = tmp_path / f"hf_{used.name}"
        out.mkdir()
        assert run_tokenizer(ckpt) == (str(used), "")
        assert (out / "tokenizer.json") in export_tokenizer(*run_tokenizer(ckpt)[:1], out)
        ids = AutoTokenizer.from_pretrained(str(out))(text, add_special_tokens=False)["input_ids"]
        from tokenizers import Tokenizer

        assert ids == Tokenizer.from_file(str(source)).encode(text, add_special_tokens=False).ids
    with pytest.warns(UserWarning, match="the run's tokenizer .*gone.* is no longer there"):
        assert export_tokenizer(str(tmp_path / "gone.json"), tmp_path) == []
