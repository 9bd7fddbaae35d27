"""A model built on ``meta`` only to count its parameters costs no ``torch._dynamo`` import.

The ``shardwise train`` launcher and ``shardwise plan`` build GPT on ``meta`` to count its units;
torch's meta ``normal_``/``arange`` import ``torch._dynamo`` (about as long as importing torch),
so ``init_weights`` leaves modules whose tensors are all on ``meta`` alone. ``import shardwise``
itself imports no ``torch._dynamo`` either (``torch.nn.attention.bias`` is imported where a
context-parallel chunk is masked). A fresh interpreter, since this test session has long imported it.
"""

import subprocess
import sys

import torch

from shardwise.models import GPT, GPTConfig, init_weights

CFG = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, max_seq_len=16)


def test_meta_build_imports_no_dynamo():
    code = ("import sys, torch, shardwise\n"
            "print('torch._dynamo' in sys.modules)\n"
            "from shardwise.models import GPT, GPTConfig\n"
            f"with torch.device('meta'):\n    GPT(GPTConfig(**{CFG!r}))\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"], out.stdout + out.stderr  # after the import, after the build


def test_meta_modules_left_alone_but_cpu_ones_initialized():
    """A model on both devices: its meta modules stay untouched, the rest is initialized as ever."""
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG))
    model.norm.to_empty(device="cpu")
    with torch.no_grad():
        model.norm.weight.fill_(7.0)
    init_weights(model)  # reaches the CPU norm, not the meta layers
    assert torch.equal(model.norm.weight, torch.ones(32))
    assert all(p.is_meta for p in model.layers.parameters())
