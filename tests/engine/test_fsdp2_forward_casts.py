"""``cast_forward_inputs`` and ``output_dtype`` reach the tensors inside containers exactly where FSDP2's do
(torch's test_fully_shard_mixed_precision.py::test_dataclass_input, run with the name rebound, failed with
shardwise: a dataclass input stayed fp32 and met bf16 weights). Each run with torch's ``fully_shard`` and
shardwise's in the same test; bf16 compute on both sides, so the comparison is exact (same ops, same order).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import shardwise
from shardwise.engine.precision import cast_floating
from tests.helpers.distributed import device, run_distributed


@dataclasses.dataclass
class _Batch:
    x: torch.Tensor
    mask: torch.Tensor  # bool: never cast
    scale: float


class _Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: dict = {}

    def forward(self, batch: _Batch) -> dict:
        # Outputs in pytree containers, not dataclasses: FSDP2 (torch 2.13) finds a unit's outputs for its
        # pre-backward hook with pytree, which does not look inside a dataclass (its backward then fails).
        self.seen.update(x=batch.x.dtype, mask=batch.mask.dtype)
        return {"y": self.lin(batch.x), "scale": batch.scale}


class _ContainerModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = _Block(), nn.Linear(4, 2)
        self.seen: dict = {}

    def forward(self, batch: _Batch, pair: _Pair, opts: dict) -> tuple:
        self.seen.update(x=batch.x.dtype, mask=batch.mask.dtype, a=pair.a.dtype, b=pair.b.dtype, w=opts["w"].dtype)
        inner = _Batch(batch.x + pair.a * pair.b + opts["w"], batch.mask, batch.scale)
        out = self.block(inner)
        return self.head(out["y"]) * out["scale"], {"mid": out["y"], "kept": [batch.mask]}


def _container_casts(which: str) -> dict:
    fully_shard = torch_fully_shard if which == "fsdp2" else shardwise.fully_shard
    torch.manual_seed(0)
    model = _ContainerModel().to(device())
    inner = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)  # casts inputs (default)
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    fully_shard(model.block, mp_policy=inner)
    fully_shard(model, mp_policy=root)
    torch.manual_seed(1 + dist.get_rank())
    x, a, b, w = (torch.randn(3, 4, device=device()) for _ in range(4))
    y, extra = model(_Batch(x, x > 0, 0.5), _Pair(a, b), {"w": w})
    y.sum().backward()
    return {
        "seen": {"root": dict(model.seen), "block": dict(model.block.seen)},
        "out_dtypes": (y.dtype, extra["mid"].dtype, extra["kept"][0].dtype),
        "out": (y.detach().cpu(), extra["mid"].detach().cpu()),
        "grads": {n: p.grad.full_tensor().cpu() for n, p in model.named_parameters()},
    }


def test_dataclass_namedtuple_and_dict_inputs_and_nested_outputs_are_cast_as_fsdp2_casts_them():
    theirs = run_distributed(_container_casts, 2, "fsdp2")
    ours = run_distributed(_container_casts, 2, "shardwise")
    for t, o in zip(theirs, ours):
        bf16 = torch.bfloat16
        assert t["seen"] == o["seen"] == {"root": dict(x=bf16, mask=torch.bool, a=bf16, b=bf16, w=bf16),
                                          "block": dict(x=bf16, mask=torch.bool)}
        assert t["out_dtypes"] == o["out_dtypes"] == (torch.float32, torch.float32, torch.bool)
        for mine, ref in zip(o["out"], t["out"]):
            torch.testing.assert_close(mine, ref, rtol=0, atol=0)
        assert o["grads"].keys() == t["grads"].keys()
        for name, grad in t["grads"].items():
            torch.testing.assert_close(o["grads"][name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("container", ["dataclass", "set", "object"])
def test_cast_floating_walks_the_containers_fsdp2_walks(container):
    """A set is walked as FSDP2 walks it; a tensor held by an arbitrary object's attribute is left alone, as
    FSDP2 leaves it (and a dataclass comes back a new instance of its class)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
    from torch.distributed.utils import _apply_to_tensors

    class Holder:
        def __init__(self, t):
            self.t = t

    t = torch.ones(2)
    tree = {"dataclass": _Batch(t, t > 0, 1.0), "set": {t}, "object": Holder(t)}[container]
    ours = cast_floating(tree, torch.bfloat16)
    theirs = _apply_to_tensors(lambda x: _cast_fp_tensor(torch.bfloat16, x), tree)
    assert type(ours) is type(theirs)
    if container == "dataclass":
        assert ours is not tree and (ours.x.dtype, ours.mask.dtype) == (theirs.x.dtype, theirs.mask.dtype)
        assert ours.x.dtype == torch.bfloat16
    elif container == "set":
        assert [x.dtype for x in ours] == [x.dtype for x in theirs] == [torch.bfloat16]
    else:
        assert ours is tree and theirs is tree and ours.t.dtype == torch.float32
