"""``shardwise train --fp8``: the flags' checks, compiled by default, an FP8 run's checkpoint exported as
plain weights (safetensors into the unconverted GPT, ``--format hf`` into transformers), and FP8 pipeline
stages (``--pp 2``) training as the whole FP8 model does in one process."""

from __future__ import annotations

import sys

import pytest
import torch

from shardwise.app.train import main, resolve_config
from tests.helpers import REPO
from tests.helpers.distributed import run_distributed
from tests.helpers.hf_cases import export_and_compare, train_then_logits
from tests.helpers.train_runs import train_records

BF16 = ["--precision", "bf16"]


@pytest.mark.parametrize("argv, message", [
    (["--fp8", "fp4"] + BF16, "--fp8 fp4: use one of tensorwise, rowwise"),
    (["--fp8", "tensorwise"], "--fp8 tensorwise: needs --precision bf16"),
    (["--fp8", "tensorwise", "--fp8-all-gather", "--strategy", "optim_grads"] + BF16,
     "--fp8-all-gather: needs --strategy optim_grads_params (parameters sharded like the main weights), not "
     "optim_grads; add --no-fp8-all-gather"),
    (["--fp8", "tensorwise", "--fp8-all-gather", "--offload"] + BF16,
     "--fp8-all-gather: is not built for offloaded main weights"),
    (["--fp8", "rowwise", "--hf-config", "x"] + BF16, "--fp8 rowwise: with --hf-config / --init-from is not built"),
])
def test_bad_fp8_flags_name_flag_and_value(argv, message, capsys, tmp_path):
    assert main(argv + ["--out-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_without_torchao_the_flag_says_how_to_install(tmp_path, monkeypatch, capsys):
    for name in ("torchao", "torchao.float8", "torchao.float8.float8_linear"):
        monkeypatch.setitem(sys.modules, name, None)  # import -> ImportError
    assert main(["--fp8", "tensorwise", *BF16, "--out-dir", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shardwise train: error: --fp8 tensorwise: FP8 training needs torchao"), err
    assert "pip install 'shardwise[fp8]'" in err and len(err.splitlines()) == 1, err


def test_fp8_compiles_units_unless_told_not_to():
    assert resolve_config(["--fp8", "tensorwise", *BF16])[0].compile == "inductor"
    assert resolve_config(["--fp8", "rowwise", *BF16, "--no-compile"])[0].compile == ""
    assert resolve_config(["--fp8", "rowwise", *BF16, "--compile", "aot_eager"])[0].compile == "aot_eager"
    cfg = resolve_config(["--fp8", "rowwise", *BF16, "--fp8-skip", "output,w2"])[0]
    assert cfg.fp8_skip == "output,w2" and not cfg.fp8_all_gather  # the FP8 gather is opt-in
    assert resolve_config(["--fp8", "tensorwise", *BF16, "--fp8-all-gather"])[0].fp8_all_gather
    assert resolve_config([])[0].fp8 == ""


def test_fp8_run_exports_plain_weights(tmp_path):
    from safetensors.torch import load_file

    from shardwise.checkpoint.export import export_safetensors
    from shardwise.models import GPT

    run = tmp_path / "run"
    argv = ["--preset", "tiny", "--out-dir", str(run), "--data", str(REPO / "shardwise" / "models"), "--steps", "2",
            "--save-every", "2", "--seq-len", "32", "--micro-batch-size", "2", "--fp8", "tensorwise", *BF16,
            "--no-compile"]
    step, logits, name = run_distributed(train_then_logits, 2, argv)[0]  # loaded into an unconverted GPT
    assert step == 2 and name == "ShardedGPT"
    export_and_compare(run, logits, tmp_path / "hf")  # --format hf: transformers loads it, the same logits
    files = export_safetensors(run / "checkpoints", tmp_path / "plain")
    cfg, model_cfg = resolve_config(argv)
    plain = GPT(model_cfg)
    plain.load_state_dict(load_file(str(files[0])), strict=True)
    assert all(v.dtype == torch.float32 for v in load_file(str(files[0])).values())
    with torch.no_grad():
        from tests.helpers.hf_cases import tokens

        torch.testing.assert_close(plain.eval()(tokens()), logits, rtol=0, atol=1e-5)


def _losses(argv: list[str]) -> list[float]:
    return [r["loss"] for r in train_records(argv) or []]


# two layers of width 32 (FP8 matmuls take multiples of 16), bf16 compute, eager (compiled FP8 is the GPU's)
_SMALL = ["--preset", "tiny", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1",
          "--ffn-hidden", "64", "--seq-len", "32", "--micro-batch-size", "2", "--grad-accum", "2", "--steps", "3",
          "--data", str(REPO / "shardwise" / "models"), *BF16, "--no-compile"]


def test_fp8_pipeline_stages_train_as_one_fp8_process(tmp_path):
    """``--fp8 --pp 2``: each stage computes its linears in FP8, as the whole model does in one process."""
    one = run_distributed(_losses, 1, [*_SMALL, "--fp8", "tensorwise", "--out-dir", str(tmp_path / "one")])[0]
    pp2 = run_distributed(_losses, 2, [*_SMALL, "--fp8", "tensorwise", "--pp", "2",
                                       "--out-dir", str(tmp_path / "pp2")])[0]
    bf16 = run_distributed(_losses, 1, [*_SMALL, "--out-dir", str(tmp_path / "bf16")])[0]
    assert len(one) == len(pp2) == len(bf16) == 3
    one, pp2, bf16 = (torch.tensor(x, dtype=torch.float64) for x in (one, pp2, bf16))
    # equal on gloo (the same kernels in the same order); bf16 linears would be off by ~1e-4 of the loss
    torch.testing.assert_close(pp2, one, rtol=1e-6, atol=0)
    assert ((bf16 - one).abs() / one).max() > 2e-5  # so this compares FP8 runs, not two bf16 ones
