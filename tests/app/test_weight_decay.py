"""``shardwise train``'s weight decay: the matrices are decayed, embeddings (any name), norms and biases not."""

from __future__ import annotations

from torch import nn

from shardwise.app.weight_decay import decayed_names, param_groups
from shardwise.models import GPT, GPTConfig


def test_the_gpts_matrices_are_decayed_and_its_embedding_and_norms_are_not():
    model = GPT(GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=64, max_seq_len=16))
    decayed = decayed_names(model)
    names = dict(model.named_parameters())
    assert decayed and all(names[n].dim() >= 2 for n in decayed)
    assert "embed.weight" not in decayed and "output.weight" in decayed
    assert not any("norm" in n for n in decayed)
    decay, no_decay = param_groups(model, decayed, 0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    assert {id(p) for p in decay["params"]} == {id(names[n]) for n in decayed}


def test_an_embedding_under_another_name_is_not_decayed():
    model = nn.ModuleDict({"embed_tokens": nn.Embedding(8, 4), "proj": nn.Linear(4, 4)})
    assert decayed_names(model) == {"proj.weight"}
