"""``train --cuda-graphs`` and ``bench --cuda-graphs``: refused by name where a graph cannot be captured
(on the CPU above all); the bench's eager runs unchanged by the new mode axis."""

from __future__ import annotations

import pytest

from shardwise.app.bench.cli import UsageError, parse_options
from shardwise.app.bench.graphs import unavailable_reason
from shardwise.app.bench.report import label
from shardwise.app.train import ConfigError, resolve_config

import torch

TINY = ["--dim", "32", "--n-layers", "2", "--n-heads", "2", "--n-kv-heads", "1", "--ffn-hidden", "64",
        "--seq-len", "32", "--micro-batch-size", "2"]


def _refusal(argv) -> str:
    with pytest.raises(ConfigError) as caught:
        resolve_config(TINY + argv)
    return str(caught.value)


def test_train_cuda_graphs_on_the_cpu_is_refused_by_name():
    message = _refusal(["--cuda-graphs", "--device", "cpu"])
    assert "--cuda-graphs" in message and "CUDA graphs need CUDA" in message


def test_train_cuda_graphs_refusals_name_offload_and_moe_on_a_gpu_config():
    from shardwise.app.config import TrainConfig
    from shardwise.app.cuda_graphs_train import check_flags
    from shardwise.models import GPTConfig

    for cfg, model, name in [(TrainConfig(cuda_graphs=True, offload=True), GPTConfig(), "offload"),
                             (TrainConfig(cuda_graphs=True, pp=2), GPTConfig(), "pp"),
                             (TrainConfig(cuda_graphs=True), GPTConfig(layer_pattern="AE"), "layer_pattern")]:
        with pytest.raises(ConfigError) as caught:
            check_flags(cfg, model, "cuda")
        assert caught.value.name == name and "with --cuda-graphs" in str(caught.value)
    check_flags(TrainConfig(cuda_graphs=True), GPTConfig(), "cuda")  # a plain GPT on a GPU passes


def test_bench_cuda_graphs_flag():
    with pytest.raises(UsageError, match="CUDA graphs need CUDA"):
        parse_options(["--device", "cpu", "--cuda-graphs", "on,off"])
    with pytest.raises(UsageError, match="a comma list of on and off"):
        parse_options(["--device", "cpu", "--cuda-graphs", "yes"])
    opts, _ = parse_options(["--device", "cpu", "--cuda-graphs", "off"])
    assert opts.cuda_graphs == (False,)


def test_bench_graphed_runs_exist_for_shardwise_and_the_ceiling_only():
    cuda = torch.device("cuda")
    assert unavailable_reason("shardwise", cuda, True) is None and unavailable_reason("none", cuda, True) is None
    assert "no CUDA-graph variant" in unavailable_reason("fsdp2", cuda, True)
    assert "need CUDA" in unavailable_reason("shardwise", torch.device("cpu"), True)
    assert unavailable_reason("fsdp2", cuda, False) is None
    assert label({"wrapper": "shardwise", "compiled": True, "cuda_graphs": True}) == "shardwise +compile +graphs"


class _EagerCapture:
    """``capture_step``'s stand-in on the CPU: the warm-up runs, and each 'replay' runs the step eagerly on the
    static inputs, so a run's plumbing (inputs, micro-batches, losses) is checked without a GPU."""

    def __init__(self, fn, sample_args, models, num_warmup_iters=1):
        self.fn, self.static = fn, tuple(a.clone() for a in sample_args)
        self.warmup_outputs = [fn(*self.static) for _ in range(num_warmup_iters)]

    def __call__(self, *args):
        for static, new in zip(self.static, args):
            static.copy_(new)
        return self.fn(*self.static)


def _graphed_run_against_eager():
    import shardwise
    from shardwise.app.cuda_graphs_train import GraphedRun
    from shardwise.app.loop import DataParallelRun
    from shardwise.models import GPT, GPTConfig, TransformerLayer

    def batches():
        g = torch.Generator().manual_seed(7)
        while True:
            t = torch.randint(0, 64, (2, 9), generator=g)
            yield t[:, :-1], t[:, 1:]

    out = []
    capture = shardwise.capture_step
    shardwise.capture_step = _EagerCapture
    try:
        for run_class in (DataParallelRun, GraphedRun):
            torch.manual_seed(0)
            model = shardwise.fully_shard(GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16)),
                                          unit_modules=[TransformerLayer], graph_safe=run_class is GraphedRun)
            run, opt, loader, seen = run_class(model), torch.optim.AdamW(model.parameters(), lr=1e-2), batches(), []
            for _ in range(3):
                seen.append(run.forward_backward(loader, 2, torch.device("cpu")).item())
                opt.step()
                opt.zero_grad(set_to_none=True)
            out.append(seen)
    finally:
        shardwise.capture_step = capture
    return out


def test_graphed_run_trains_the_micro_batches_as_the_eager_run():
    from tests.helpers.distributed import run_distributed

    ((eager, graphed),) = run_distributed(_graphed_run_against_eager, 1)
    assert graphed == eager
