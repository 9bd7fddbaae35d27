"""GPT pipeline stages on one process: the whole model's names, forward and gradients; meta build; errors."""

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import (
    GPT,
    GPTConfig,
    StageInitializer,
    pipeline_stage,
    stage_indices,
    stage_layer_counts,
)


def config(**overrides):
    # A, E (MoE) and M (Mamba) layers; 3 stages of 2 layers put an MoE layer on two stages
    base = dict(vocab_size=64, dim=32, n_layers=6, n_heads=4, n_kv_heads=2, max_seq_len=16, layer_pattern="AEM",
                mamba_head_dim=16, mamba_chunk_size=4, moe_num_experts=4, moe_top_k=2, moe_aux_loss_coef=0.5)
    base.update(overrides)
    return GPTConfig(**base)


def run_stages(stages, tokens):
    x = tokens
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("num_stages,split", [(1, None), (3, None), (4, None),
                                              (3, [0, 4, 2]), (3, [3, 3, 0])])
def test_stages_hold_the_whole_models_names_and_compose_to_its_forward(num_stages, split):
    torch.manual_seed(0)
    model = GPT(config())
    stages = [pipeline_stage(model, i, num_stages, split=split) for i in range(num_stages)]
    keys = [k for s in stages for k in s.state_dict()]
    assert len(keys) == len(set(keys))  # every parameter on exactly one stage
    assert set(keys) == set(model.state_dict())
    names = {n for s in stages for n, _ in s.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}
    assert [i for s in stages for i in s.layer_ids] == list(range(6))
    assert ("embed.weight" in stages[0].state_dict()) and ("output.weight" in stages[-1].state_dict())
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(run_stages(stages, tokens), model(tokens), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_stage_gradients_equal_the_whole_models_including_the_moe_aux_loss(checkpointing):
    cfg = config(activation_checkpointing=checkpointing)
    torch.manual_seed(0)
    model = GPT(cfg)
    tokens, targets = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    model(tokens, targets).backward()
    assert model.aux_loss.item() > 0
    whole = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    stages = [pipeline_stage(model, i, 3) for i in range(3)]
    logits = run_stages(stages, tokens)
    F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()  # the schedule's loss_fn: CE only
    assert stages[1].aux_loss is None  # layers M, A: no MoE; layers 1 and 4 are the MoE ones
    torch.testing.assert_close(stages[0].aux_loss + stages[2].aux_loss, model.aux_loss, rtol=1e-6, atol=0)
    router = "layers.1.mlp.router"  # its gradient comes from the aux loss too
    staged = {n: p.grad for s in stages for n, p in s.named_parameters()}
    assert staged[router].abs().sum() > 0
    for name, grad in whole.items():
        torch.testing.assert_close(staged[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    # without the injected aux gradient the router's gradient would differ: the comparison can fail
    model.zero_grad()
    model(tokens, targets)
    F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten()).backward()
    assert not torch.allclose(dict(model.named_parameters())[router].grad, whole[router], rtol=1e-3)


def test_virtual_stages_follow_torchs_looped_numbering():
    assert stage_indices(0, 2, 2) == [0, 2] and stage_indices(1, 2, 2) == [1, 3]
    assert stage_indices(1, 3) == [1]
    torch.manual_seed(0)
    model = GPT(config())
    # rank 1 of pp=2 with 2 virtual stages: stages 1 and 3 of 4 (layers 2 and 5 of an even 2,2,1,1 split)
    held = [pipeline_stage(model, i, 4) for i in stage_indices(1, 2, 2)]
    assert [s.layer_ids for s in held] == [[2, 3], [5]]
    assert held[1].is_last and not held[0].is_first and held[1].embed is None


def test_a_meta_built_stage_initializes_to_the_whole_models_values():
    cfg = config()
    torch.manual_seed(3)
    direct = GPT(cfg)
    after_direct = torch.rand(4)
    torch.manual_seed(3)
    with torch.device("meta"):
        whole = GPT(cfg)
    stages = [pipeline_stage(whole, i, 3) for i in (1, 2)]  # this rank holds stages 1 and 2 only
    init = StageInitializer(whole, stages, torch.device("cpu"))
    init.plan()
    init.finish()
    expected = direct.state_dict()
    for stage in stages:
        for key, value in stage.state_dict().items():
            assert not value.is_meta and torch.equal(value, expected[key]), key
        torch.testing.assert_close(stage.rope_cos, direct.rope_cos, rtol=0, atol=0)
    assert whole.embed.weight.is_meta and whole.layers[0].attention.wq.weight.is_meta  # stage 0's: not built
    assert torch.equal(torch.rand(4), after_direct)  # the generator left where a direct build leaves it
    tokens = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        first = pipeline_stage(direct, 0, 3)  # the stage another rank would hold
        torch.testing.assert_close(stages[1](stages[0](first(tokens))), direct(tokens), rtol=1e-6, atol=1e-6)


def test_even_split_gives_the_remainder_to_the_first_stages():
    assert stage_layer_counts(7, 3) == [3, 2, 2]
    assert stage_layer_counts(6, 6) == [1] * 6
    assert stage_layer_counts(4, 3, [0, 4, 0]) == [0, 4, 0]


def test_bad_arguments_are_refused_naming_them():
    torch.manual_seed(0)
    model = GPT(config())
    with pytest.raises(ValueError, match=r"stage_index=3 must be in \[0, num_stages=3\)"):
        pipeline_stage(model, 3, 3)
    with pytest.raises(ValueError, match=r"stage_index=-1 must be in"):
        pipeline_stage(model, -1, 3)
    with pytest.raises(ValueError, match=r"num_stages=0 must be an integer >= 1"):
        pipeline_stage(model, 0, 0)
    with pytest.raises(ValueError, match=r"split=\[2, 2, 1\] sums to 5, not n_layers=6"):
        pipeline_stage(model, 0, 3, split=[2, 2, 1])
    with pytest.raises(ValueError, match=r"split=\[3, 3\] has 2 entries, one per stage is needed \(num_stages=3\)"):
        pipeline_stage(model, 0, 3, split=[3, 3])
    with pytest.raises(ValueError, match=r"split=\[3, 0, 3\] gives middle stages \[1\] no layers"):
        pipeline_stage(model, 0, 3, split=[3, 0, 3])
    with pytest.raises(ValueError, match=r"split=\[7, -1\] must hold non-negative integers"):
        pipeline_stage(model, 0, 2, split=[7, -1])
    with pytest.raises(ValueError, match=r"num_stages=7 is more stages than n_layers=6"):
        pipeline_stage(model, 0, 7)
    with pytest.raises(ValueError, match=r"tie_embeddings=True with num_stages=2"):
        pipeline_stage(GPT(config(tie_embeddings=True)), 0, 2)
    with pytest.raises(ValueError, match=r"model=Linear is not a shardwise.models.GPT"):
        pipeline_stage(torch.nn.Linear(2, 2), 0, 2)
    with pytest.raises(ValueError, match=r"pp_rank=2 must be in \[0, pp=2\)"):
        stage_indices(2, 2)
    with pytest.raises(ValueError, match=r"virtual=0 must be an integer >= 1"):
        stage_indices(0, 2, 0)
    with pytest.raises(ValueError, match=r"stages must be a non-empty list of GPTStage, got none"):
        StageInitializer(model, [])
    with pytest.raises(RuntimeError, match=r"finish\(\) before plan\(\)"):
        StageInitializer(model, [pipeline_stage(model, 0, 1)]).finish()


def test_one_stage_with_tied_embeddings_is_the_whole_model():
    torch.manual_seed(0)
    model = GPT(config(tie_embeddings=True, layer_pattern=""))
    stage = pipeline_stage(model, 0, 1)
    tokens = torch.randint(0, 64, (2, 16))
    assert set(stage.state_dict()) == set(model.state_dict())
    with torch.no_grad():
        assert torch.equal(stage(tokens), model(tokens))
