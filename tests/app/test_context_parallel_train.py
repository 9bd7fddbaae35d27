"""``shardwise train --cp N``: refusals at start, the activation estimate, and a CP run that trains
as the data-parallel run over the same data ranks does."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise.app.memory import activation_bytes
from shardwise.app.train import main
from shardwise.models import GPTConfig
from shardwise.models.context_parallel import zigzag_split

from tests.app.test_memory_estimate import _saved_bytes
from tests.helpers.distributed import run_distributed
from tests.helpers.train_runs import train_records

SMALL = ["--preset", "tiny", "--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1",
         "--ffn-hidden", "64", "--seq-len", "32", "--micro-batch-size", "2"]


@pytest.mark.parametrize("argv,message", [
    (["--cp", "0"], "--cp 0: must be at least 1"),
    (["--cp", "2", "--seq-len", "30"], "--seq-len 30: must be divisible by 2 x --cp = 4"),
    (["--cp", "4", "--nproc", "2"], "--cp 4: must divide the number of processes (2)"),
    (["--cp", "2", "--nproc", "2", "--outer-dp", "2", "--outer-strategy", "no_shard"],
     "--outer-dp 2: must divide the data-parallel ranks (processes / --cp = 1)"),
    (["--cp", "2", "--pp", "2", "--nproc", "4", "--grad-accum", "2"], "--pp 2: with --cp 2 is not built yet"),
    (["--cp", "2", "--compile", "aot_eager"], "--compile aot_eager: with --cp 2 is not built yet"),
    (["--cp", "2", "--eval-fraction", "0.1"], "--eval-fraction 0.1: with --cp 2 is not built yet"),
    (["--cp", "2", "--layer-pattern", "AE"], "--layer-pattern AE: --cp 2 is built for attention layers (A) only"),
])
def test_cp_flags_are_refused_at_start_naming_flag_and_value(argv, message, capsys, tmp_path):
    assert main(SMALL + argv + ["--out-dir", str(tmp_path / "x")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _cp_saved_bytes_and_estimate(dtype_name: str) -> tuple[int, int]:
    dtype = getattr(torch, dtype_name)
    config = GPTConfig(vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=160, max_seq_len=64,
                       cp_group=dist.group.WORLD)
    torch.manual_seed(0)
    tokens = torch.randint(0, 96, (3, 64))
    saved = _saved_bytes(config, zigzag_split(tokens, dist.group.WORLD))
    return saved, activation_bytes(config, 64, 3, compute_dtype=dtype, cp=2, materialized_mask=True).saved_at_loss


def test_the_cp_activation_count_is_what_autograd_saves():
    # _saved_bytes runs the model in bf16 on the CPU: this rank's tokens, the keys and values each query chunk
    # sees, and the lower-right causal masks the CPU path materializes (CP rank 1 holds the most of them)
    saved, counted = run_distributed(_cp_saved_bytes_and_estimate, 2, "bfloat16")[1]
    assert counted == saved
    whole = activation_bytes(GPTConfig(vocab_size=96, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=160,
                                       max_seq_len=64), 64, 3, compute_dtype=torch.bfloat16).saved_at_loss
    assert counted < 0.6 * whole  # about half: each rank holds half of every sequence


@pytest.mark.slow
def test_cp2_dp2_trains_as_dp2_over_the_same_rows(tmp_path):
    argv = [*SMALL, "--steps", "3", "--strategy", "3"]
    cp = run_distributed(train_records, 4, [*argv, "--cp", "2", "--out-dir", str(tmp_path / "cp")])[0]
    dp = run_distributed(train_records, 2, [*argv, "--out-dir", str(tmp_path / "dp")])[0]
    assert [r["tokens"] for r in cp] == [r["tokens"] for r in dp] == [2 * 32 * 2 * s for s in (1, 2, 3)]
    # AdamW's losses: the same up to fp32 summation order (the gradients are reduced over 4 ranks, not 2)
    torch.testing.assert_close(torch.tensor([r["loss"] for r in cp], dtype=torch.float64),
                               torch.tensor([r["loss"] for r in dp], dtype=torch.float64), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor([r["grad_norm"] for r in cp], dtype=torch.float64),
                               torch.tensor([r["grad_norm"] for r in dp], dtype=torch.float64), rtol=1e-5, atol=0)
