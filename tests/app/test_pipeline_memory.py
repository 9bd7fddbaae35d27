"""The pipeline memory estimate: per-stage activations against what autograd saves, and the per-rank sums."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.app.pipeline_memory import estimate_pipeline, estimate_pipeline_rank, stage_activations
from shardwise.app.memory_estimate import BufferSizes
from shardwise.models import GPT, GPTConfig, pipeline_stage

CONFIG = GPTConfig(vocab_size=96, dim=64, n_layers=6, n_heads=4, n_kv_heads=2, ffn_hidden=160, max_seq_len=32)
T, B = 32, 3  # sequence length, micro-batch
TOKENS = T * B


def _saved_bytes(fn, exclude) -> tuple[torch.Tensor, int]:
    """What autograd saves while ``fn`` runs (each storage once, ``exclude``'s storages left out)."""
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in exclude:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(saved.values())


def test_each_stages_count_is_what_autograd_saves_for_it():
    torch.manual_seed(0)
    model = GPT(CONFIG).to(torch.bfloat16)
    stages = [pipeline_stage(model, i, 3, split=[1, 3, 2]) for i in range(3)]
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    tokens, targets = torch.randint(0, 96, (B, T)), torch.randint(0, 96, (B, T))
    x, measured = tokens, []
    for stage in stages:  # each stage on its own, as a pipeline rank runs it; the last with the schedule's loss
        run = (lambda s=stage, x=x: F.cross_entropy(s(x).flatten(0, 1).float(), targets.flatten())) \
            if stage.is_last else (lambda s=stage, x=x: s(x))
        out, saved = _saved_bytes(run, own)
        measured.append(saved)
        x = out.detach().requires_grad_()
    counted = [stage_activations(CONFIG, T, B, s.layer_ids, first=s.is_first, last=s.is_last).saved for s in stages]
    assert counted == measured


def test_outputs_receive_buffers_and_checkpointing():
    c, d, v = 2, CONFIG.dim, CONFIG.vocab_size
    middle = stage_activations(CONFIG, T, B, [2, 3], first=False, last=False)
    last = stage_activations(CONFIG, T, B, [4, 5], first=False, last=True)
    first = stage_activations(CONFIG, T, B, [0, 1], first=True, last=False)
    assert (middle.output, last.output) == (c * TOKENS * d, c * TOKENS * v)  # hidden states; logits
    assert (first.receive, middle.receive, last.receive) == (c * TOKENS * d, 2 * c * TOKENS * d, c * TOKENS * d)
    ckpt = stage_activations(CONFIG, T, B, [2, 3], first=False, last=False, checkpointing=True)
    assert ckpt.saved == 2 * c * TOKENS * d  # each layer's input only
    assert ckpt.backward > middle.backward  # the recomputed layer's activations come back in its backward


@pytest.mark.parametrize("schedule,virtual,in_flight", [
    ("gpipe", 1, [[4], [4], [4]]),
    ("1f1b", 1, [[3], [2], [1]]),
    ("looped_bfs", 2, [[4, 4], [4, 4], [4, 4]]),
])
def test_a_ranks_estimate_adds_its_stages_state_and_the_chunks_in_flight(schedule, virtual, in_flight):
    kw = dict(pp=3, dp=2, schedule=schedule, n_microbatches=4, virtual=virtual, split=[1] * 6 if virtual == 2 else None)
    ranks = estimate_pipeline(CONFIG, T, B, **kw)
    layers = [[0, 1], [2, 3], [4, 5]] if virtual == 1 else [[0, 3], [1, 4], [2, 5]]
    per_param = BufferSizes(2).optimizer(1.0)  # AdamW's two fp32 moments over 2 ranks: 4 bytes a parameter
    total_params = sum(p.numel() for p in GPT(CONFIG).parameters())
    counted = 0
    for r, est in enumerate(ranks):
        info = est.inputs["pipeline"]
        assert info["layers"] == [[i] for i in layers[r]] if virtual == 2 else info["layers"] == [layers[r]]
        assert info["in_flight"] == in_flight[r]
        stages = [stage_activations(CONFIG, T, B, ids, first=s == 0, last=s == 3 * virtual - 1)
                  for s, ids in zip(info["stages"], info["layers"])]
        peak = est.phases["backward, micro-batches in flight"]
        assert est.gpu_bytes == max(est.phases.values()) == sum(est.parts.values())
        assert est.parts["activations in flight"] == sum(n * a.saved for n, a in zip(in_flight[r], stages))
        assert est.parts["stage outputs in flight"] == sum(n * a.output for n, a in zip(in_flight[r], stages))
        assert est.parts["receive buffers"] == sum(4 * a.receive for a in stages)
        assert peak == est.gpu_bytes  # activations outweigh the optimizer step here
        counted += est.parts["optimizer"] / per_param
    assert counted == pytest.approx(total_params)  # every parameter's state on exactly one rank


def test_return_outputs_keeps_the_logits_of_every_micro_batch_on_the_last_rank():
    kw = dict(pp=2, pp_rank=1, dp=1, schedule="1f1b", n_microbatches=4)
    kept = estimate_pipeline_rank(CONFIG, T, B, return_outputs=True, **kw)
    assert kept.parts["returned logits"] == 4 * 2 * TOKENS * CONFIG.vocab_size
    assert "returned logits" not in estimate_pipeline_rank(CONFIG, T, B, **kw).parts


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match=r"schedule='zbv' is not one of"):
        estimate_pipeline_rank(CONFIG, T, B, pp=2, pp_rank=0, dp=1, schedule="zbv", n_microbatches=4)
    with pytest.raises(ValueError, match=r"tie_embeddings=True"):
        estimate_pipeline_rank(GPTConfig(tie_embeddings=True), T, B, pp=2, pp_rank=0, dp=1, schedule="1f1b",
                               n_microbatches=4)
    with pytest.raises(ValueError, match=r"split=\[1, 1\] sums to 2, not n_layers=6"):
        estimate_pipeline_rank(CONFIG, T, B, pp=2, pp_rank=0, dp=1, schedule="1f1b", n_microbatches=4, split=[1, 1])


def test_the_train_line_says_per_rank_on_the_cpu():
    """``train --pp`` prints each pipeline rank's estimate: on the CPU a rank's memory is the process's, not a GPU's."""
    from shardwise.app.train import _pipeline_estimate, resolve_config

    cfg, model_cfg = resolve_config(["--pp", "2", "--grad-accum", "2", "--dim", "32", "--n-layers", "2", "--n-heads",
                                     "2", "--n-kv-heads", "1", "--ffn-hidden", "64", "--seq-len", "32"])
    line = _pipeline_estimate(cfg, model_cfg, 2, False, "cpu")
    assert line.startswith("memory estimate: per pipeline rank ") and "per rank " in line, line
    assert "GPU" not in line, line
    assert "per GPU " in _pipeline_estimate(cfg, model_cfg, 2, True, "cuda")
