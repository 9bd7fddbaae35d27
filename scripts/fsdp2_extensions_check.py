"""GPUs: torchao's float8 training with FSDP2's float8 all-gather (its ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` hooks) under torch's FSDP2 and under shardwise, same seed, same batches.

gloo cannot gather float8 tensors, so the CPU tests (``tests/engine/test_fsdp2_all_gather_extensions.py``)
use subclasses of their own; this is the real one on NCCL. For ``param_dtype`` None and bf16, each
implementation trains ``--steps`` steps of a small MLP of torchao ``Float8Linear`` s converted with
``enable_fsdp_float8_all_gather=True``; written: the local tensor types (``WeightWithDynamicFloat8CastTensor``
expected on both), the losses, the max abs difference of the losses and of the weights against FSDP2's
(the same kernels in the same order: 0 expected), how many times the pre-hook ran, and ms/step.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    torchrun --nproc-per-node 2 scripts/fsdp2_extensions_check.py --out $OUT/fsdp2-extensions.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import shardwise  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: E402

DIMS = (1024, 4096, 1024, 4096, 1024)  # multiples of 16 (float8 matmul); every weight splits over 2 and 8


def _train(impl: str, param_dtype: torch.dtype | None, steps: int) -> dict:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    calls = [0]
    original = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather

    def counted(self, *args, **kwargs):  # shown with torchao's signature (FSDP2 and shardwise read its arity)
        calls[0] += 1
        return original(self, *args, **kwargs)

    counted.__signature__ = inspect.signature(original)
    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = counted
    try:
        torch.manual_seed(0)
        layers = []
        for i, (a, b) in enumerate(zip(DIMS, DIMS[1:])):
            layers += [nn.Linear(a, b, bias=False)] + ([nn.ReLU()] if i < len(DIMS) - 2 else [])
        model = nn.Sequential(*layers).cuda()
        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        fully_shard = torch_fully_shard if impl == "fsdp2" else shardwise.fully_shard
        kwargs = {} if param_dtype is None else {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype)}
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
        kinds = sorted({type(p._local_tensor).__name__ for p in model.parameters()})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses, times = [], []
        for step in range(steps):
            gen = torch.Generator(device="cuda").manual_seed(100 * step + dist.get_rank())
            x = torch.randn(256, DIMS[0], device="cuda", generator=gen, dtype=param_dtype or torch.float32)
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
            losses.append(loss.item())
        weights = [getattr(p._local_tensor, "_tensor", p._local_tensor).detach().float().clone()
                   for p in model.parameters()]
        return {"kinds": kinds, "losses": losses, "weights": weights, "pre_hook_calls": calls[0],
                "ms_per_step": sorted(times[1:])[len(times[1:]) // 2] if steps > 1 else times[0]}
    finally:
        WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    report = {}
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        ref = _train("fsdp2", dtype, args.steps)
        got = _train("shardwise", dtype, args.steps)
        report[name] = {
            "kinds": {"fsdp2": ref["kinds"], "shardwise": got["kinds"]},
            "losses": {"fsdp2": ref["losses"], "shardwise": got["losses"]},
            "max_loss_diff": max(abs(a - b) for a, b in zip(ref["losses"], got["losses"])),
            "max_weight_diff": max(float((a - b).abs().max()) for a, b in zip(ref["weights"], got["weights"])),
            "pre_hook_calls": {"fsdp2": ref["pre_hook_calls"], "shardwise": got["pre_hook_calls"]},
            "ms_per_step": {"fsdp2": ref["ms_per_step"], "shardwise": got["ms_per_step"]},
        }
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))
    shardwise.destroy_process_groups()


if __name__ == "__main__":
    main()
