"""Reference models on one process: shapes, init determinism, MoE routing, Mamba scan."""

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.models import (
    GPT,
    GPTConfig,
    MambaLayer,
    MoE,
    MoETransformerLayer,
    TransformerLayer,
    chunked_scan,
    init_weights,
    load_balancing_loss,
)

from tests.helpers.mamba_reference import sequential_scan


def small_config(**overrides):
    base = dict(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=32,
                mamba_head_dim=16, mamba_chunk_size=8, moe_num_experts=4, moe_top_k=2)
    base.update(overrides)
    return GPTConfig(**base)


@pytest.mark.parametrize("tie", [False, True])
def test_dense_forward_shapes_and_tying(tie):
    torch.manual_seed(0)
    model = GPT(small_config(tie_embeddings=tie))
    tokens = torch.randint(0, 256, (3, 17))
    assert model(tokens).shape == (3, 17, 256)
    loss = model(tokens, torch.randint(0, 256, (3, 17)))
    assert loss.shape == () and abs(loss.item() - math.log(256)) < 0.5
    names = {n for n, _ in model.named_parameters()}
    assert ("output.weight" in names) is not tie
    assert all(isinstance(layer, TransformerLayer) for layer in model.layers)
    assert model.layers[0].attention.n_kv_heads == 2


def test_hybrid_pattern_builds_layer_kinds():
    torch.manual_seed(0)
    model = GPT(small_config(n_layers=5, layer_pattern="AAMAE"))
    kinds = [type(layer) for layer in model.layers]
    assert kinds == [TransformerLayer, TransformerLayer, MambaLayer, TransformerLayer, MoETransformerLayer]
    assert GPTConfig(n_layers=6, layer_pattern="AM").layer_kinds == "AMAMAM"
    tokens = torch.randint(0, 256, (2, 20))
    loss = model(tokens, tokens)
    loss.backward()
    assert model.aux_loss is not None and model(tokens).shape == (2, 20, 256)
    assert any(".experts." in n for n, _ in model.named_parameters())
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, missing


def test_model_is_causal():
    torch.manual_seed(0)
    model = GPT(small_config(n_layers=3, layer_pattern="AME")).eval()
    a = torch.randint(0, 256, (1, 24))
    b = a.clone()
    b[:, 12:] = torch.randint(0, 256, (1, 12))
    torch.testing.assert_close(model(a)[:, :12], model(b)[:, :12])


def test_meta_init_matches_direct_build():
    config = small_config(n_layers=3, layer_pattern="AEM")
    torch.manual_seed(1234)
    direct = GPT(config)
    with torch.device("meta"):
        lazy = GPT(config)
    lazy.to_empty(device="cpu")
    torch.manual_seed(1234)
    for module in lazy.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    direct_state, lazy_state = direct.state_dict(), lazy.state_dict()
    assert list(direct_state) == list(lazy_state)  # the same keys, in the same order
    for name, value in direct_state.items():
        torch.testing.assert_close(value, lazy_state[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(direct.rope_cos, lazy.rope_cos)
    torch.manual_seed(1234)
    init_weights(lazy)  # the helper does the same loop
    torch.testing.assert_close(direct.embed.weight, lazy.embed.weight, rtol=0, atol=0)


def test_activation_checkpointing_same_gradients():
    config = small_config(n_layers=3, layer_pattern="AEM")
    tokens = torch.randint(0, 256, (2, 16))
    grads = []
    for recompute in (False, True):
        torch.manual_seed(0)
        config.activation_checkpointing = recompute
        model = GPT(config)
        model(tokens, tokens).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], msg=name)


def test_moe_routes_to_top_k_and_matches_per_token_loop():
    torch.manual_seed(0)
    config = small_config(dim=8, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden=16)
    moe = MoE(config)
    init_weights(moe)
    x = torch.randn(2, 5, 8)
    out = moe(x)
    tokens = x.reshape(-1, 8)
    probs = (tokens @ moe.router.t()).softmax(-1)
    ex = moe.experts
    expected = torch.zeros_like(tokens)
    for n in range(tokens.shape[0]):
        top = probs[n].argsort(descending=True)[:2]
        w = probs[n, top] / probs[n, top].sum()
        for weight, e in zip(w, top.tolist()):
            h = F.silu(ex.w1[e] @ tokens[n]) * (ex.w3[e] @ tokens[n])
            expected[n] += weight * (ex.w2[e] @ h)
    torch.testing.assert_close(out.reshape(-1, 8), expected)


def test_load_balancing_loss_hand_computed():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.1, 0.4], [0.2, 0.2, 0.6]])
    idx = torch.tensor([[0], [1], [0], [2]])  # top-1 choices
    # f = [2/4, 1/4, 1/4]; P = column means = [0.375, 0.275, 0.35]
    expected = 3 * (0.5 * 0.375 + 0.25 * 0.275 + 0.25 * 0.35)
    assert load_balancing_loss(probs, idx).item() == pytest.approx(expected)
    uniform = torch.full((6, 3), 1 / 3)
    balanced = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 1], [2, 0], [1, 2]])
    assert load_balancing_loss(uniform, balanced).item() == pytest.approx(1.0)


@pytest.mark.parametrize("t,chunk", [(23, 8), (16, 4), (5, 16)])
def test_chunked_scan_equals_sequential_recurrence(t, chunk):
    g = torch.Generator().manual_seed(t)
    b, h, p, n = 2, 3, 4, 5
    x = torch.randn(b, t, h, p, generator=g, dtype=torch.float64)
    dt = F.softplus(torch.randn(b, t, h, generator=g, dtype=torch.float64))
    A = -torch.rand(h, generator=g, dtype=torch.float64) * 4
    B = torch.randn(b, t, n, generator=g, dtype=torch.float64)
    C = torch.randn(b, t, n, generator=g, dtype=torch.float64)
    torch.testing.assert_close(chunked_scan(x, dt, A, B, C, chunk), sequential_scan(x, dt, A, B, C))


def test_mamba_layer_chunk_size_does_not_matter():
    x = torch.randn(2, 19, 64)
    outs = []
    for chunk in (4, 19, 64):
        torch.manual_seed(0)
        layer = MambaLayer(small_config(mamba_chunk_size=chunk))
        init_weights(layer)
        outs.append(layer(x))
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(outs[0], outs[2])


@pytest.mark.parametrize("field,value", [("n_kv_heads", 3), ("layer_pattern", "AX"), ("dim", 66)])
def test_config_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        GPT(small_config(**{field: value}))
