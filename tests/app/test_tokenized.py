"""``shardwise train --tokenizer``: packing with EOS, the token cache, input formats, uint32 ``.bin`` files.

Everything here runs in the test process: ``check_data`` is what the launching process runs
before it starts the workers, ``open_data`` what every worker runs (rank 0 of 1 here).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from shardwise.app import corpus, tokenized
from shardwise.app.data import TokenLoader, load_tokens, write_tokens
from shardwise.app.train import ConfigError, main, resolve_config

from tests.helpers.text_data import EOS, documents, expected_stream, train_tokenizer, write_jsonl

TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1", "--ffn-hidden", "64",
        "--seq-len", "16", "--micro-batch-size", "2"]


def _data(cfg_args: list[str]) -> tuple[np.ndarray, np.ndarray | None]:
    """What the launcher checks and builds, then what a worker opens (rank 0 of 1)."""
    cfg, model = resolve_config(cfg_args)
    corpus.check_world(cfg, model, build=True)
    return corpus.open_data(cfg, 0, 1)


@pytest.fixture
def tok(tmp_path):
    return train_tokenizer(tmp_path / "tok.json", documents(200, seed=1))


def test_jsonl_documents_are_packed_with_one_eos_each_and_cut_into_windows(tmp_path, tok):
    texts = documents(60) + ["", "a last document without a final newline"]
    data = write_jsonl(tmp_path / "docs.jsonl", texts)
    with open(data, "a") as f:
        f.write("\n")  # a blank line is no document
    train, held = _data(["--data", str(data), "--tokenizer", str(tok), *TINY])
    want = expected_stream(tok, texts)
    assert held is None and train.dtype == np.uint16
    assert train.tolist() == want  # each document then EOS, the empty one skipped, in order
    assert (train == 0).sum() == len(texts) - 1  # EOS is id 0: exactly one per non-empty document
    loader = TokenLoader(train, 16, 2, seed=0)
    inputs, targets = next(loader)
    order = np.random.default_rng([0, 0]).permutation(loader.num_windows)
    for row, window in enumerate(order[:2]):
        np.testing.assert_array_equal(inputs[row].numpy(), want[window * 16:window * 16 + 16])
        np.testing.assert_array_equal(targets[row].numpy(), want[window * 16 + 1:window * 16 + 17])


def test_text_folders_and_parquet_give_the_same_stream(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = documents(30, seed=2)
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    for i, text in enumerate(texts):  # one document per file, in sorted path order
        (folder / ("sub" if i % 2 else "") / f"{i:03d}.txt").write_text(text)
    (folder / "blob.bin").write_bytes(b"\0\1\2")  # binary: skipped
    in_order = [texts[i] for i in sorted(range(30), key=lambda i: ("sub/" if i % 2 else "") + f"{i:03d}.txt")]
    assert _data(["--data", str(folder), "--tokenizer", str(tok), *TINY])[0].tolist() == expected_stream(tok, in_order)
    pq.write_table(pa.table({"content": texts, "n": list(range(30))}), tmp_path / "docs.parquet", row_group_size=7)
    stream = _data(["--data", str(tmp_path / "docs.parquet"), "--text-key", "content", "--tokenizer", str(tok), *TINY])
    assert stream[0].tolist() == expected_stream(tok, texts)
    shards = tmp_path / "shards"  # a dataset's parquet shards, in file name order
    shards.mkdir()
    for i in range(3):
        pq.write_table(pa.table({"text": texts[i * 10:(i + 1) * 10]}), shards / f"train-{i:05d}-of-00003.parquet")
    assert _data(["--data", str(shards), "--tokenizer", str(tok), *TINY])[0].tolist() == expected_stream(tok, texts)
    with pytest.raises(ConfigError, match="holds only .parquet files, whose documents are read with a tokenizer"):
        resolve_config(["--data", str(shards)])


def test_cache_is_reused_and_replaced_by_another_tokenizer_or_changed_data(tmp_path, tok, monkeypatch):
    texts = documents(40, seed=3)
    data = write_jsonl(tmp_path / "docs.jsonl", texts)
    args = ["--data", str(data), "--tokenizer", str(tok), *TINY]
    first = _data(args)[0]
    caches = sorted((tmp_path / ".shardwise-cache").glob("*.bin"))
    assert len(caches) == 1 and json.loads(caches[0].with_suffix(".bin.json").read_text())["documents"] == 40

    def no_rebuild(*a, **k):
        raise AssertionError("tokenized again although the cache is valid")

    monkeypatch.setattr(corpus, "build_cache", no_rebuild)
    np.testing.assert_array_equal(_data(args)[0], first)  # memory-mapped from the cache
    monkeypatch.undo()

    other = train_tokenizer(tmp_path / "other.json", documents(200, seed=9), vocab_size=280)
    second = _data(["--data", str(data), "--tokenizer", str(other), *TINY])[0]
    assert second.tolist() == expected_stream(other, texts) and second.tolist() != first.tolist()
    assert len(list((tmp_path / ".shardwise-cache").glob("*.bin"))) == 2  # one per tokenizer
    write_jsonl(data, texts[:20])
    os.utime(data, ns=(1, 1))  # even with an old timestamp: the size changed
    assert _data(args)[0].tolist() == expected_stream(tok, texts[:20])


def test_a_partial_cache_is_not_used(tmp_path, tok):
    data = write_jsonl(tmp_path / "docs.jsonl", documents(20))
    args = ["--data", str(data), "--tokenizer", str(tok), "--data-cache", str(tmp_path / "c"), *TINY]
    want = _data(args)[0].tolist()
    (cache,) = (tmp_path / "c").glob("*.bin")
    cache.with_suffix(".bin.json").unlink()  # died before the sidecar was renamed into place
    assert _data(args)[0].tolist() == want and cache.with_suffix(".bin.json").is_file()
    with open(cache, "r+b") as f:
        f.truncate(10)  # truncated after it was written: the sidecar's token count says so
    assert _data(args)[0].tolist() == want


def test_uint32_ids_round_trip_and_resume_exactly(tmp_path):
    ids = (np.arange(5000, dtype=np.int64) * 7919) % 128_256  # Llama-3's vocabulary: ids far above 65,535
    path = write_tokens(tmp_path / "ids.bin", ids)
    assert json.loads((tmp_path / "ids.bin.json").read_text())["dtype"] == "uint32"
    tokens = load_tokens(str(path))
    assert tokens.dtype == np.uint32 and int(tokens.max()) > 65_535
    np.testing.assert_array_equal(tokens, ids)
    loader = TokenLoader(tokens, 16, 3, seed=5)
    for _ in range(40):
        next(loader)
    state = loader.state_dict()
    want = [next(loader) for _ in range(150)]  # 312 windows: crosses an epoch
    resumed = TokenLoader(load_tokens(str(path)), 16, 3, seed=0)
    resumed.load_state_dict(state)
    for x, y in want:
        rx, ry = next(resumed)
        assert torch.equal(rx, x) and torch.equal(ry, y)
    assert min(int(x.max()) for x, _ in want) > 65_535  # every batch holds ids a uint16 could not
    # the same ids without a sidecar: --data-dtype says the width; uint16 (the default) is refused
    ids.astype(np.uint32).tofile(tmp_path / "bare.bin")
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "bare.bin"), "uint32"), ids)


def test_dtype_errors_name_flag_and_file(tmp_path, capsys):
    write_tokens(tmp_path / "ids.bin", np.array([1, 70_000, 3] * 50))
    out = ["--out-dir", str(tmp_path / "run")]
    assert main(["--data", str(tmp_path / "ids.bin"), "--data-dtype", "uint16", *out]) == 2
    assert (f"--data {tmp_path / 'ids.bin'}: holds uint32 tokens (its sidecar {tmp_path / 'ids.bin.json'} says so), "
            f"not --data-dtype uint16") in capsys.readouterr().err
    np.array([1, 2, 3] * 50, dtype=np.uint32).tofile(tmp_path / "bare.bin")
    assert main(["--data", str(tmp_path / "bare.bin"), "--data-dtype", "uint16", *out]) == 2
    assert "every second uint16 is 0: this looks like a uint32 token file; pass --data-dtype uint32" in \
        capsys.readouterr().err
    assert main(["--data", str(tmp_path / "ids.bin"), "--vocab-size", "65536", *TINY, *out]) == 2
    assert "--vocab-size 65536: data " in capsys.readouterr().err  # ... holds token id 70000
    assert main(["--data", str(tmp_path / "ids.bin"), "--tokenizer", str(tmp_path / "ids.bin"), *out]) == 2
    assert "is a .bin of token ids already (nothing to tokenize); drop --tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_a_bin_without_sidecar_needs_its_dtype(tmp_path, capsys):
    """uint32 ids above 65,535 without a sidecar: read as uint16 they would train as other ids (exit 0), so the
    file is refused until --data-dtype says its width; with it, the ids are the ones written."""
    ids = (np.arange(4000, dtype=np.int64) * 7919) % 128_256
    ids.astype(np.uint32).tofile(tmp_path / "bare.bin")
    out = ["--out-dir", str(tmp_path / "run")]
    assert main(["--data", str(tmp_path / "bare.bin"), *TINY, *out]) == 2
    err = capsys.readouterr().err
    assert (f"--data {tmp_path / 'bare.bin'}: has no sidecar bare.bin.json saying its token dtype: pass --data-dtype "
            "uint8, uint16 or uint32") in err, err
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="has no sidecar"):
        load_tokens(str(tmp_path / "bare.bin"))
    np.testing.assert_array_equal(load_tokens(str(tmp_path / "bare.bin"), "uint32"), ids)


@pytest.mark.parametrize("content,message", [
    ('{"text": "ok"}\n{"text": "fine"\n', "docs.jsonl line 2: not JSON"),
    ('{"text": "ok"}\n{"body": "x"}\n', "docs.jsonl line 2: no string field 'text' (--text-key)"),
    ('{"text": ""}\n', "holds no documents (every one is empty)"),
])
def test_bad_inputs_fail_in_one_line_before_training(tmp_path, tok, capsys, content, message):
    (tmp_path / "docs.jsonl").write_text(content)
    assert main(["--data", str(tmp_path / "docs.jsonl"), "--tokenizer", str(tok), "--out-dir",
                 str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"shardwise train: error: --data {tmp_path / 'docs.jsonl'}: ") and message in err, err
    assert not list((tmp_path / ".shardwise-cache").glob("*.bin"))  # nothing half-written is left to be used


def test_tokenizer_errors(tmp_path, tok, capsys):
    data = str(write_jsonl(tmp_path / "docs.jsonl", documents(10)))
    out = ["--data", data, "--out-dir", str(tmp_path / "run")]
    no_eos = train_tokenizer(tmp_path / "no_eos.json", documents(50), vocab_size=270, eos=None)
    (tmp_path / "junk.json").write_text("{}")
    for argv, message in [
        (["--tokenizer", str(tmp_path / "nope.json")], f"--tokenizer {tmp_path / 'nope.json'}: no such file"),
        (["--tokenizer", str(tmp_path / "junk.json")], "not a tokenizers JSON file"),
        (["--tokenizer", str(no_eos)], "has no EOS token to separate documents; name one with --eos-token"),
        (["--tokenizer", str(tok), "--eos-token", "<eot>"], "has no token '<eot>' (the EOS of --eos-token)"),
        (["--tokenizer", str(tok), "--vocab-size", "100"],
         f"--tokenizer {tok}: has 300 tokens but the model's vocabulary is 100 (--vocab-size): its ids would not fit"),
        (["--eos-token", EOS], "--eos-token <|endoftext|>: needs --tokenizer"),
        ([], f"--data {data}: .jsonl documents are read with a tokenizer: add --tokenizer PATH"),
    ]:
        assert main(argv + out) == 2, argv
        assert message in capsys.readouterr().err, argv
    cfg, model = resolve_config(["--tokenizer", str(no_eos), "--eos-token", "!"])  # any token can end documents
    assert model.vocab_size == 270 and tokenized.load_tokenizer(cfg.tokenizer, cfg.eos_token).eos_token == "!"


def test_init_from_folder_tokenizer_is_the_default_and_must_fit_the_vocabulary(tmp_path, capsys):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer

    from tests.helpers.hf_cases import save_folder

    folder = tmp_path / "llama"  # vocab_size 256
    save_folder(folder, "llama")
    data = str(write_jsonl(tmp_path / "docs.jsonl", documents(10)))
    too_big = Tokenizer.from_file(str(train_tokenizer(tmp_path / "t.json", documents(100))))
    PreTrainedTokenizerFast(tokenizer_object=too_big, eos_token=EOS).save_pretrained(folder)
    assert main(["--init-from", str(folder), "--data", data, "--out-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer {folder}: the tokenizer of the --init-from folder" in err
    assert (f"--tokenizer {folder}: has 300 tokens but the model's vocabulary is 256 (the --init-from config's "
            f"vocab_size): its ids would not fit") in err
    cfg, _ = resolve_config(["--init-from", str(folder), "--tokenizer", "bytes"])
    assert cfg.tokenizer == "bytes"  # byte tokens on request (the stdlib corpus here)
    from tokenizers import models, pre_tokenizers

    small = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", EOS, *sorted(set(" ".join(
        documents(10)).replace(".", " ").replace("!", " ").split()))])}, unk_token="<unk>"))
    small.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=small, eos_token=EOS).save_pretrained(folder)
    cfg, model = resolve_config(["--init-from", str(folder), "--data", data, *TINY])
    assert cfg.tokenizer == str(folder) and model.vocab_size == 256  # the model keeps the folder's vocabulary
    corpus.check_world(cfg, model, build=True)
    train, _ = corpus.open_data(cfg, 0, 1)
    assert int(train.max()) < small.get_vocab_size() and (train == 1).sum() == 10  # transformers' EOS id


def test_resuming_on_other_data_says_so():
    state = TokenLoader(np.arange(1000), 16, 2).state_dict()
    assert state["windows"] == 62
    TokenLoader(np.arange(1000), 16, 2).load_state_dict(state)  # the same data: silent
    with pytest.warns(UserWarning, match="the data has 124 windows of seq_len\\+1 tokens where the checkpoint's "
                                         "had 62: the data or --seq-len changed"):
        TokenLoader(np.arange(2000), 16, 2).load_state_dict(state)


def test_the_readmes_tokenizer_recipe_trains_one_train_can_use(tmp_path, monkeypatch):
    """docs/cli.md's "No tokenizer at hand?" code, run as written on a text file: a tokenizer.json whose EOS
    ``--tokenizer`` finds by itself."""
    from tests.helpers import REPO

    page = (REPO / "docs" / "cli.md").read_text()
    after = page[page.index("**No tokenizer at hand?**"):]
    code = after[after.index("```python\n") + len("```python\n"):after.index("  ```\n", after.index("```python"))]
    code = "\n".join(line[2:] for line in code.splitlines()).replace("vocab_size=8000", "vocab_size=400")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(" ".join(documents(200)))
    exec(compile(code, "docs/cli.md", "exec"), {})
    tok = tokenized.load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tok.eos_token == "<|endoftext|>" and 256 < tok.vocab_size <= 400
    cfg, model = resolve_config(["--data", "corpus.txt", "--tokenizer", "tokenizer.json", *TINY])
    assert model.vocab_size == tok.vocab_size
