"""Data mistakes that used to train silently: each is refused in one line saying what to do, or, where it can be
meant, accepted with one warning naming the consequence; the start line names the corpus and its share."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from shardwise.app.config import ConfigError, check_world, resolve_config
from shardwise.app.corpus import describe_coverage

TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1", "--ffn-hidden", "64",
        "--seq-len", "32", "--micro-batch-size", "2", "--out-dir", "unused"]


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(Path(json.__file__).read_bytes() * 4)
    return path


def _warnings(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if ": warning: " in line]


def test_a_binary_file_given_as_text_is_refused(tmp_path):
    image = tmp_path / "image.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8)
    for flag in ("--data", "--eval-data"):
        with pytest.raises(ConfigError, match=rf"^{flag} {image}: is a binary file \(NUL bytes in its first 8 KiB\), "
                                              r"not text: give a text file"):
            resolve_config([*TINY, flag, str(image)])


def test_eval_data_that_is_the_training_data_is_warned_about(text, tmp_path, capsys):
    resolve_config([*TINY, "--data", str(text), "--eval-data", str(text)])
    warning, = _warnings(capsys)
    assert warning == (f"shardwise train: warning: --eval-data {text} is the training data (--data {text}): its eval "
                       f"loss measures how well the run memorised what it trained on, not how it does on unseen "
                       f"text; --eval-fraction F holds out the end of --data instead")
    resolve_config([*TINY, "--data", str(text.parent), "--eval-data", str(text)])  # a file of the data folder
    assert "is part of the training data" in _warnings(capsys)[0]
    other = tmp_path / "held_out.txt"
    shutil.copy(text, other)
    resolve_config([*TINY, "--data", str(text), "--eval-data", str(other)])
    assert _warnings(capsys) == []


def test_a_narrow_bin_read_wide_is_a_data_dtype_problem(tmp_path):
    """uint16 ids read as uint32 join pairs into ids past the vocabulary: the error names --data-dtype."""
    ids = tmp_path / "ids.bin"
    np.arange(4000, dtype=np.uint16).__mod__(256).astype(np.uint16).tofile(ids)  # no sidecar
    cfg, model = resolve_config([*TINY, "--data", str(ids), "--data-dtype", "uint32"])
    with pytest.raises(ConfigError, match=rf"^--data-dtype uint32: {ids} read as uint32 holds id [\d,]+, past the "
                                          r"vocabulary \(256\), but read as uint16 every id fits: it was written as "
                                          r"uint16; pass --data-dtype uint16$"):
        check_world(cfg, model, 2)
    cfg, model = resolve_config([*TINY, "--data", str(ids), "--data-dtype", "uint16"])
    check_world(cfg, model, 2)  # read right: accepted


def test_an_encoder_config_is_refused_and_a_decoder_one_accepted(tmp_path):
    pytest.importorskip("transformers")
    from transformers import BertConfig

    bert = tmp_path / "bert"
    BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=64).save_pretrained(bert)
    with pytest.raises(ConfigError, match=rf"^--hf-config {bert}: BertConfig \(bert\) is an encoder: .*causal LM"):
        resolve_config([*TINY, "--hf-config", str(bert)])
    decoder = tmp_path / "bert_decoder"
    BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
               is_decoder=True).save_pretrained(decoder)
    resolve_config([*TINY, "--hf-config", str(decoder)])  # its causal-mask form: a causal LM


def test_init_from_with_another_tokenizer_is_warned_about(tmp_path, capsys):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.helpers.hf_cases import CONFIGS
    from tests.helpers.text_data import documents, train_tokenizer

    folder = tmp_path / "llama"
    fields = {**CONFIGS["llama"], "vocab_size": 320}  # room for a byte-level BPE's 256 bytes and some merges
    AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields)).save_pretrained(folder)
    own = train_tokenizer(folder / "tokenizer.json", documents(50), vocab_size=300)
    other = train_tokenizer(tmp_path / "other.json", documents(50, seed=1), vocab_size=290)
    data = tmp_path / "corpus.txt"
    data.write_text(" ".join(documents(200)))
    argv = [*TINY, "--init-from", str(folder), "--data", str(data)]
    capsys.readouterr()
    resolve_config([*argv, "--tokenizer", str(other)])
    warning, = _warnings(capsys)
    assert warning.startswith(f"shardwise train: warning: --tokenizer {other} is not the tokenizer of --init-from "
                              f"{folder}: its pretrained embeddings were learnt for the ids of its own tokenizer")
    resolve_config([*argv, "--tokenizer", "bytes"])
    assert _warnings(capsys)[0].startswith("shardwise train: warning: --tokenizer bytes (UTF-8 byte ids 0-255) is "
                                           "not the tokenizer of --init-from")
    resolve_config([*argv, "--tokenizer", str(own)])  # the folder's own, named explicitly: nothing to say
    assert _warnings(capsys) == []


def test_the_start_line_names_the_corpus_its_share_and_epochs():
    cfg, _ = resolve_config(["--steps", "10", "--out-dir", "unused"])
    line = describe_coverage(cfg, 1_000_000, 7_751, 16)
    assert line == ("data: the Python standard library's .py sources (the default; --data PATH for yours) (UTF-8 "
                    "bytes): 1,000,000 tokens, 7,751 windows of 129 tokens; --steps 10 x 16 sequences = 160 windows, "
                    "2.1% of it (each window at most once)")
    cfg, _ = resolve_config(["--steps", "100", "--data", __file__, "--out-dir", "unused"])
    line = describe_coverage(cfg, 5_000, 38, 16)
    assert line.startswith(f"warning: data: --data {__file__} (UTF-8 bytes): 5,000 tokens, 38 windows") and \
        "= 1,600 windows, 42.1 epochs: the run sees each window about 42.1 times;" in line
    assert "one step alone takes more windows" in describe_coverage(cfg, 500, 3, 16)
