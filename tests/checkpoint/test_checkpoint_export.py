"""Offline tools: export a checkpoint as safetensors (streaming), ``shardwise ckpt info``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from safetensors.torch import load_file, load_model

import shardwise
from shardwise.checkpoint import CheckpointManager
from shardwise.app.ckpt import main as ckpt_main

from tests.checkpoint.test_checkpoint import _build, _global_batch_step
from tests.helpers import REPO
from tests.helpers.distributed import device, run_distributed
from tests.helpers.tiny_model import TinyConfig, TinyLM, batch


def _export_source(path: str):
    model, opt = _build("optim_grads_params", seed=0)
    for step in range(2):
        _global_batch_step(model, opt, step)
    CheckpointManager(path).save(2, model, opt, extra={"data": {"position": 16}})
    with torch.no_grad():
        losses = [model(*(t.to(device()) for t in batch(step, 8, TinyConfig()))).item() for step in (10, 11)]
    return losses, shardwise.full_state_dict(model), model.state_dict().keys() - set()


def _plain_losses(model: nn.Module) -> list[float]:
    with torch.no_grad():
        return [model(*batch(step, 8, TinyConfig())).item() for step in (10, 11)]


def test_export_loads_into_the_unwrapped_model_with_the_same_outputs(tmp_path, capsys):
    root = tmp_path / "ckpt"
    losses, full, keys = run_distributed(_export_source, 2, str(root))[0]
    assert set(full) == set(keys) == set(TinyLM(TinyConfig()).state_dict())  # tied head.weight included

    # fp32, one file, every state_dict key; the folder of checkpoints means its latest one.
    assert ckpt_main(["export", str(root), str(tmp_path / "fp32")]) == 0
    assert f"exported {root / 'step_00000002'}: wrote 1 file(s)" in capsys.readouterr().out  # which one it took
    exported = load_file(tmp_path / "fp32" / "model.safetensors")
    assert set(exported) == set(full) and all(torch.equal(exported[k], full[k]) for k in full)
    plain = TinyLM(TinyConfig())
    plain.load_state_dict(exported)  # strict: head.weight is there
    assert plain.head.weight is plain.embed.weight
    torch.testing.assert_close(torch.tensor(_plain_losses(plain)), torch.tensor(losses), rtol=1e-6, atol=0)

    # --tied-once: Hugging Face's form, the alias once under its first name (named in the metadata).
    assert ckpt_main(["export", str(root / "step_00000002"), str(tmp_path / "once.safetensors"),
                      "--tied-once"]) == 0
    once = load_file(tmp_path / "once.safetensors")
    assert set(once) == set(full) - {"head.weight"}
    missing, unexpected = TinyLM(TinyConfig()).load_state_dict(once, strict=False)
    assert missing == ["head.weight"] and unexpected == []
    other = TinyLM(TinyConfig())
    load_model(other, tmp_path / "once.safetensors")  # strict, understands tied weights
    assert torch.equal(other.blocks[1].odd.weight, full["blocks.1.odd.weight"])
    with open(tmp_path / "once.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert json.loads(header["__metadata__"]["shardwise_tied"]) == {"head.weight": "embed.weight"}

    # bf16, split into shards with an index.
    assert ckpt_main(["export", str(root), str(tmp_path / "bf16" / "m.safetensors"), "--dtype", "bf16",
                      "--max-shard-size", "16KB"]) == 0
    index = json.loads((tmp_path / "bf16" / "m.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0] == f"m-00001-of-{len(files):05d}.safetensors"
    merged = {}
    for name in files:
        assert (tmp_path / "bf16" / name).stat().st_size <= 16_000 + 4096  # + header
        merged.update(load_file(tmp_path / "bf16" / name))
    assert set(merged) == set(index["weight_map"]) == set(full)
    assert all(merged[k].dtype == torch.bfloat16 and torch.equal(merged[k], full[k].bfloat16()) for k in full)
    assert index["metadata"]["total_size"] == sum(v.numel() * 2 for v in merged.values())

    capsys.readouterr()
    assert ckpt_main(["info", str(root)]) == 0
    text = capsys.readouterr().out
    for expected in ("step: 2", "world size: 2", "dp_shard=optim_grads_params (size 2)", "AdamW",
                     "tied: head.weight -> embed.weight", "blocks.2.odd.weight", "7x15", "checksums: sha256 of",
                     "1 more state_dict key(s) tied"):
        assert expected in text, (expected, text)
    assert ckpt_main(["info", str(root), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["meta"]["world_size"] == 2 and info["model"]["embed.weight"]["shape"] == [61, 32]
    assert info["tied"] == {"head.weight": "embed.weight"}
    assert "head.weight  " in text and "tied to embed.weight" in text
    assert ckpt_main(["info", str(tmp_path / "nothing")]) == 2


# ------------------------------------------------------------------ streaming memory
_LAYERS, _ROWS, _COLS = 8, 2048, 2048  # 8 x 16 MiB fp32 = 128 MiB


def _big_source(path: str):
    torch.manual_seed(0)
    body = nn.Sequential(*[nn.Linear(_COLS, _ROWS, bias=False) for _ in range(_LAYERS)])
    model = shardwise.fully_shard(body, strategy="optim_grads_params", unit_modules=[nn.Linear])
    CheckpointManager(path).save(0, model)
    return dist.get_rank()


_MEASURE = r"""
import json, sys
from shardwise.app.ckpt import main
import shardwise.checkpoint.export

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak RSS to the current RSS
except OSError:
    pass
base = status("VmRSS:")
assert main(sys.argv[1:]) == 0
print(json.dumps({"base": base, "peak": status("VmHWM:")}))
"""


@pytest.mark.slow
def test_export_streams_one_tensor_at_a_time(tmp_path):
    run_distributed(_big_source, 2, str(tmp_path / "ckpt"))
    # glibc otherwise keeps freed 16 MiB blocks in its heap (its mmap threshold grows after the
    # first free), so RSS would count memory that is free; a fixed threshold measures live memory.
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, "export", str(tmp_path / "ckpt"), str(tmp_path / "out")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    usage = json.loads(proc.stdout.strip().splitlines()[-1])
    growth = usage["peak"] - usage["base"]
    largest, total = _ROWS * _COLS * 4, _LAYERS * _ROWS * _COLS * 4
    print(f"export peak RSS growth {growth / 2**20:.1f} MiB; largest tensor {largest / 2**20:.0f} MiB, "
          f"model {total / 2**20:.0f} MiB")
    assert growth < 2.5 * largest < total / 3  # the tensor being written + one saved chunk
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert len(out) == _LAYERS and out["3.weight"].shape == (_ROWS, _COLS)
