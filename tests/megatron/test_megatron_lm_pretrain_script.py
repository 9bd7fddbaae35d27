"""scripts/megatron_lm_pretrain.py's own logic on CPU: the one added line and the reading of Megatron-LM's log.

The runs themselves need a GPU (docs/benchmarks.md); the lines parsed here are Megatron-LM core_r0.19.0's
``training_log`` and ``report_memory`` output as that script's GPU job printed them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "megatron_lm_pretrain.py"
spec = importlib.util.spec_from_file_location("megatron_lm_pretrain", SCRIPT)
pretrain = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pretrain)

LOG = """\
[Rank 0] (after 1 iterations) memory (MB) | allocated: 2247.31 | max allocated: 4103.19 | reserved: 4582.00
 [2026-12-03 13:40:58.443207] iteration       20/      30 | consumed samples:          160 | elapsed time per \
iteration (ms): 152.7 | throughput per GPU (TFLOP/s/GPU): 45.7 | learning rate: 1.232827E-04 | global batch size:     \
8 | lm loss: 5.711961E+00 | loss scale: 1.0 | grad norm: 10.381 | num zeros: 0 | number of skipped iterations:   0 |
[Rank 0] (after 2 iterations) memory (MB) | allocated: 2247.31 | max allocated: 5130.65 | reserved: 5580.00
 [2026-12-03 13:41:02.875319] iteration       21/      30 | consumed samples:          168 | elapsed time per \
iteration (ms): 169.3 | throughput per GPU (TFLOP/s/GPU): 41.2 | learning rate: 1.075198E-04 | global batch size:     \
8 | lm loss: 5.318179E+00 | loss scale: 1.0 | grad norm: 13.817 | num zeros: 0 | number of skipped iterations:   0 |
"""


def test_the_added_lines_go_before_the_main_block_and_nothing_else_changes(tmp_path):
    source = 'import sys\n\ndef main():\n    pass\n\nif __name__ == "__main__":\n    main()\n'
    (tmp_path / "pretrain_gpt.py").write_text(source)
    out = tmp_path / "out"
    out.mkdir()
    written = pretrain.with_added_line(tmp_path, out).read_text()
    assert written == source.replace('if __name__', pretrain.ADDED + 'if __name__')
    assert "use_in_megatron()" in written.split('if __name__')[0]


def test_a_script_without_one_main_block_is_refused(tmp_path):
    (tmp_path / "pretrain_gpt.py").write_text("print(1)\n")
    with pytest.raises(SystemExit, match="expected one"):
        pretrain.with_added_line(tmp_path, tmp_path)


def test_megatron_lms_log_lines_are_read_per_iteration_with_the_largest_peak():
    run = pretrain.parse(LOG)
    assert sorted(run["iterations"]) == [20, 21]
    assert run["iterations"][21] == dict(loss=5.318179, grad_norm=13.817, ms=169.3, tflops=41.2,
                                         loss_text="5.318179E+00", grad_norm_text="13.817")
    assert run["max_allocated_mb"] == 5130.65


def test_differences_count_equal_prints_and_miss_nothing():
    a = pretrain.parse(LOG)
    b = pretrain.parse(LOG.replace("5.318179E+00", "5.318180E+00"))
    diff = pretrain.differences(a, b, 20, 21)
    assert diff["loss_equal_as_printed"] == 1 and diff["grad_norm_equal_as_printed"] == 2
    assert diff["loss_max_abs"] == pytest.approx(1e-6)
    assert pretrain.differences(a, b, 20, 22) == {"loss": None, "grad_norm": None}  # iteration 22 missing


def test_the_graph_comparison_adds_megatron_lms_full_iteration_flags_only_to_graphed_runs(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    eager = pretrain.graph_command(script, "optim", 30, 1, graphed=False, warmup=2)
    graphed = pretrain.graph_command(script, "optim", 30, 1, graphed=True, warmup=2)
    assert graphed[:len(eager)] == eager and "--cuda-graph-impl" not in eager
    extra = graphed[len(eager):]
    assert extra == ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad",
                     "--cuda-graph-warmup-steps", "2"]
    assert "--save" not in graphed and "--load" not in graphed  # timed runs write no checkpoints
