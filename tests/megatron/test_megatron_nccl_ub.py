"""``nccl_ub`` / ``fsdp_manual_registration`` and per-submodule gathers, with Megatron-Core's own objects on gloo.

- On gloo NCCL user buffers have nothing to register: Megatron-Core's GPTModel, DDP config
  and ``DistributedOptimizer`` through the face (Megatron's own class name after
  ``use_in_megatron()``), Megatron-LM's step in miniature (``no_sync`` micro-batches,
  ``finish_grad_sync``, the optimizer step, ``manual_buffer_registration()`` after the
  first iteration as Megatron-LM calls it), train bit for bit as without, with exactly
  one INFO line saying it has no effect there. Per-submodule gathers
  (``megatron_fsdp_enable_fine_grained_param_gather``) train bit for bit as per-layer ones
  too (two ranks: each element's reduction is one addition, whatever the buffer layout),
  with one unit per submodule holding parameters.
- The NCCL path cannot run here; what it is made of is checked on the CPU: every device
  allocation of a group's buffers happens inside ``Collectives.buffers()`` (a recording
  fake in place of the NCCL pool), and ``NcclUserBuffers`` / the face's
  ``user_buffers`` / ``register_manually`` against a fake NCCL backend (its pool from the
  backend's ``mem_allocator``, registered with exactly the data-parallel groups, now or
  when asked, once). On GPUs the first test registers the real pool and trains bit for bit too:
  ``SHARDWISE_TEST_BACKEND=nccl python -m pytest -q tests/megatron/test_megatron_nccl_ub.py -k bit_for_bit``
  (two GPUs); its speed: docs/megatron.md, "NCCL user buffers".
"""

from __future__ import annotations

import contextlib
import logging
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import shardwise
from shardwise.engine.collectives import Collectives
from shardwise.engine.model_ops import sharded_state

from tests.helpers.distributed import device, run_distributed
from tests.helpers.megatron_cpu import megatron_on_the_cpu
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch

pytest.importorskip("megatron.core", reason="megatron-core is a test requirement of the Megatron face")

VOCAB, SEQ, STEPS, MICRO = 64, 8, 3, 2
ADAPTER_LOGGER = "shardwise.megatron.mcore_fsdp_adapter"


# ------------------------------------------------------------------ Megatron-Core's objects on gloo
class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _chunk(version: int, strategy: str, options: dict, bias: bool):
    from megatron.core.distributed import DistributedDataParallelConfig, FullyShardedDataParallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, bf16=True,
                               params_dtype=torch.bfloat16, use_cpu_initialization=True,
                               gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
                               add_bias_linear=bias)
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=True, use_megatron_fsdp=True,
                                        data_parallel_sharding_strategy=strategy, check_for_nan_in_grad=False)
    ddp.megatron_fsdp_version = version
    for name, value in options.items():  # after construction, as Megatron-LM 0.19's kwargs would set 0.19's fields
        setattr(ddp, name, value)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = Float16Module(config, GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                                           max_sequence_length=SEQ))
    return FullyShardedDataParallel(config=config, ddp_config=ddp, module=model,
                                    pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def _run(version: int, strategy: str, options: dict, bias: bool = True) -> dict:
    from megatron.core import parallel_state
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from shardwise.megatron import use_in_megatron

    lines = _Lines()
    logging.getLogger(ADAPTER_LOGGER).addHandler(lines)
    logging.getLogger(ADAPTER_LOGGER).setLevel(logging.INFO)
    with megatron_on_the_cpu():
        parallel_state.initialize_model_parallel(1, 1)
        names = use_in_megatron()
        try:
            chunk = _chunk(version, strategy, options, bias)
            wrap_lines = list(lines.lines)
            # clip_grad=0: Megatron's clipping asserts 'torch.cuda.FloatTensor' grads (left for the GPU run)
            optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1,
                                                               clip_grad=0.0, bf16=True, use_distributed_optimizer=True),
                                               [chunk])
            position_ids = torch.arange(SEQ, device=device()).unsqueeze(0)
            mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device=device()).triu(1)
            losses = []
            for step in range(STEPS):
                chunk.zero_grad_buffer()
                optimizer.zero_grad()
                for micro in range(MICRO):
                    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
                    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator).to(device())
                    with chunk.no_sync() if micro < MICRO - 1 else contextlib.nullcontext():
                        loss = chunk(tokens, position_ids, mask, labels=tokens).float().mean()
                        loss.backward()
                    losses.append(loss.item())
                chunk.finish_grad_sync()
                ok, _, _ = optimizer.step()
                assert ok
                if step == 0 and options.get("fsdp_manual_registration"):  # Megatron-LM: after the first iteration
                    chunk.param_and_grad_buffer.manual_buffer_registration()
            weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                       for k, v in chunk.sharded_model.state_dict().items() if torch.is_tensor(v)}
            pool = chunk.param_and_grad_buffer._user_buffers  # the NCCL pool (None on gloo)
            return dict(losses=losses, weights=weights, wrap_lines=wrap_lines, backend=dist.get_backend(),
                        units=len(sharded_state(chunk.sharded_model).units),
                        registered=None if pool is None else pool.registered)
        finally:
            logging.getLogger(ADAPTER_LOGGER).removeHandler(lines)
            names.restore()
            parallel_state.destroy_model_parallel()


NCCL_UB = dict(nccl_ub=True, fsdp_manual_registration=True, fsdp_double_buffer=True)  # 0.19's --use-nccl-ub
FINE = dict(megatron_fsdp_enable_fine_grained_param_gather=True)


def _runs(version: int, strategy: str, without_bias: bool) -> dict:
    runs = {"off": _run(version, strategy, {}), "nccl_ub": _run(version, strategy, NCCL_UB),
            "nccl_ub_auto": _run(version, strategy, dict(nccl_ub=True)), "fine": _run(version, strategy, FINE)}
    if without_bias:  # --disable-bias-linear (the Llama recipes): no bias handed out, every submodule a unit
        runs["off_no_bias"] = _run(version, strategy, {}, bias=False)
        runs["fine_no_bias"] = _run(version, strategy, FINE, bias=False)
    return runs


def _same(a: dict, b: dict, what: str) -> None:
    assert a["losses"] == b["losses"], f"{what}: losses differ"
    assert a["weights"].keys() == b["weights"].keys()
    for key in a["weights"]:
        assert torch.equal(a["weights"][key], b["weights"][key]), f"{what}: {key} differs"


CASES = [(1, "optim_grads_params", True), (1, "optim", False), (2, "optim_grads_params", False)]


@pytest.mark.parametrize("version,strategy,without_bias", CASES, ids=[f"v{v}-{s}" for v, s, _ in CASES])
def test_nccl_ub_and_fine_grained_gathers_train_bit_for_bit_on_gloo(version, strategy, without_bias):
    for rank, runs in enumerate(run_distributed(_runs, 2, version, strategy, without_bias)):
        off = runs["off"]
        for variant in ("nccl_ub", "nccl_ub_auto", "fine"):
            _same(off, runs[variant], f"rank {rank} {variant}")
        said = [line for line in runs["nccl_ub"]["wrap_lines"] if "no effect" in line]
        if off["backend"] == "nccl":  # SHARDWISE_TEST_BACKEND=nccl on GPUs: the pool, registered with NCCL
            assert said == [] and runs["nccl_ub"]["registered"] is runs["nccl_ub_auto"]["registered"] is True
        else:
            assert len(said) == 1 and "nccl_ub=True (fsdp_manual_registration=True) has no effect on the gloo " \
                "backend" in said[0], runs["nccl_ub"]["wrap_lines"]
            assert runs["nccl_ub"]["registered"] is None
        assert not any("no effect" in line for line in off["wrap_lines"])
        if strategy == "optim_grads_params":  # two layers: per layer, or per submodule holding parameters:
            # input_layernorm, linear_qkv, pre_mlp_layernorm, linear_fc1, and the layer for linear_proj and
            # linear_fc2, which hand their bias to it (skip_bias_add); without biases all six submodules
            assert (off["units"], runs["fine"]["units"]) == (2, 8)
        if without_bias:
            _same(runs["off_no_bias"], runs["fine_no_bias"], f"rank {rank} fine without bias")
            assert (runs["off_no_bias"]["units"], runs["fine_no_bias"]["units"]) == (2, 12)


# ------------------------------------------------------------------ the pool context around every allocation
class _Recording(Collectives):
    """Collectives whose ``buffers()`` marks the allocations made inside it (a fake of the NCCL pool)."""

    def __init__(self):
        self.depth = 0
        self.entries = 0

    @contextlib.contextmanager
    def buffers(self):
        self.depth += 1
        self.entries += 1
        try:
            yield
        finally:
            self.depth -= 1


_ENGINE_MODULES = ("shardwise.engine.distributed_buffer", "shardwise.engine.param_group")


def _allocations_inside_the_context(strategy: str) -> dict:
    """Train two steps with every ``torch.empty`` / ``torch.zeros`` / storage ``resize_`` the engine's buffer
    modules call recorded with whether ``buffers()`` was entered around it."""
    recording = _Recording()
    seen = {"inside": 0, "outside": []}
    real = {"empty": torch.empty, "zeros": torch.zeros, "resize_": torch.UntypedStorage.resize_}

    def note(kind: str) -> None:
        caller = sys._getframe(2).f_globals.get("__name__", "")  # the function that called torch's
        if caller in _ENGINE_MODULES:
            if recording.depth:
                seen["inside"] += 1
            else:
                seen["outside"].append(f"{kind} from {caller}")

    def empty(*args, **kwargs):
        note("torch.empty")
        return real["empty"](*args, **kwargs)

    def zeros(*args, **kwargs):
        note("torch.zeros")
        return real["zeros"](*args, **kwargs)

    def resize_(storage, size):
        if size:
            note("resize_")
        return real["resize_"](storage, size)

    torch.empty, torch.zeros, torch.UntypedStorage.resize_ = empty, zeros, resize_
    try:
        config, world, rank = TinyConfig(), dist.get_world_size(), dist.get_rank()
        torch.manual_seed(0)
        model = shardwise.fully_shard(TinyLM(config), shardwise.build_dp_mesh(), strategy=strategy,
                                      unit_modules=[Block], collectives=recording)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            tokens, targets = batch(step, world, config)
            model(tokens[rank : rank + 1], targets[rank : rank + 1]).backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.empty, torch.zeros, torch.UntypedStorage.resize_ = real["empty"], real["zeros"], real["resize_"]
    return dict(seen, entries=recording.entries)


@pytest.mark.parametrize("strategy", ["optim_grads_params", "optim"])
def test_every_buffer_allocation_of_a_group_is_inside_the_collectives_pool_context(strategy):
    for seen in run_distributed(_allocations_inside_the_context, 2, strategy):
        assert seen["outside"] == [], seen["outside"]
        assert seen["inside"] > 0 and seen["entries"] >= seen["inside"]


# ------------------------------------------------------------------ the NCCL path against a fake backend
class _FakeBackend:
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls
        self.mem_allocator = f"ncclMemAlloc allocator of {name}"

    def register_mem_pool(self, pool, **kwargs):
        self.calls.append(("register", self.name, pool, kwargs))


class _FakeGroup:
    def __init__(self, name: str, calls: list):
        self.backend = _FakeBackend(name, calls)

    def _get_backend(self, device):
        assert device == torch.device("cuda", 3)
        return self.backend


class _FakeMesh:
    device_type = "cuda"

    def __init__(self, groups: dict):
        self.groups = groups
        self.mesh_dim_names = tuple(groups)

    def get_group(self, name):
        return self.groups[name]


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's pool API and the communicator-creating all-reduce, recorded."""
    calls: list = []

    class Pool:
        def __init__(self, allocator):
            self.allocator = allocator

    @contextlib.contextmanager
    def use_mem_pool(pool):
        calls.append(("use", pool))
        yield

    monkeypatch.setattr(torch.cuda, "MemPool", Pool)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: "one element")
    monkeypatch.setattr(dist, "all_reduce", lambda t, group: calls.append(("all_reduce", group.backend.name)))
    return calls


def test_the_pool_is_the_first_groups_nccl_allocator_registered_with_each_group_once(fake_cuda):
    from shardwise.engine.nccl_buffers import NcclUserBuffers

    dp, edp = _FakeGroup("dp", fake_cuda), _FakeGroup("edp", fake_cuda)
    buffers = NcclUserBuffers([dp, edp, dp], register_now=True)
    assert buffers.pool.allocator == "ncclMemAlloc allocator of dp"
    assert fake_cuda == [("all_reduce", "dp"), ("register", "dp", buffers.pool, {"symm": True}),
                         ("all_reduce", "edp"), ("register", "edp", buffers.pool, {"symm": True})]
    with buffers.buffers():
        pass
    assert fake_cuda[-1] == ("use", buffers.pool)
    with pytest.raises(RuntimeError, match="already registered"):
        buffers.register()


def test_manual_registration_waits_for_the_call_and_plain_registration_drops_symm(fake_cuda):
    from shardwise.engine.nccl_buffers import NcclUserBuffers

    buffers = NcclUserBuffers([_FakeGroup("dp", fake_cuda)], register_now=False, symmetric=False)
    assert fake_cuda == [] and not buffers.registered
    buffers.register()
    assert fake_cuda == [("all_reduce", "dp"), ("register", "dp", buffers.pool, {})]


def test_the_face_registers_the_data_parallel_axes_only(fake_cuda):
    from shardwise.megatron.nccl_ub import register_manually, user_buffers

    dense = _FakeMesh({"dp_outer": _FakeGroup("outer", fake_cuda), "dp_shard": _FakeGroup("inner", fake_cuda),
                       "tp": _FakeGroup("tp", fake_cuda)})
    experts = _FakeMesh({"expert_dp": _FakeGroup("edp", fake_cuda), "ep": _FakeGroup("ep", fake_cuda)})
    assert user_buffers(SimpleNamespace(nccl_ub=False), (dense, experts), "V1") is None
    ddp = SimpleNamespace(nccl_ub=True, fsdp_manual_registration=True, disable_symmetric_registration=False)
    buffers = user_buffers(ddp, (dense, experts), "V1")
    assert [g.backend.name for g in buffers.groups] == ["outer", "inner", "edp"] and fake_cuda == []
    register_manually(ddp, buffers)  # what Megatron-LM's manual_buffer_registration() call does
    assert [c[1] for c in fake_cuda if c[0] == "register"] == ["outer", "inner", "edp"]
    with pytest.raises(RuntimeError, match="already registered"):
        register_manually(ddp, buffers)
    auto = user_buffers(SimpleNamespace(nccl_ub=True, disable_symmetric_registration=True), (dense, None), "V2")
    assert auto.registered and fake_cuda[-1] == ("register", "inner", auto.pool, {})
    with pytest.raises(RuntimeError, match="needs nccl_ub=True and fsdp_manual_registration=True"):
        register_manually(SimpleNamespace(nccl_ub=True, fsdp_manual_registration=False), auto)


def test_an_nccl_without_the_allocator_trains_on_with_one_warning(fake_cuda, caplog):
    """torch 2.11.0+cu130's NCCL on an H200 answers ``mem_allocator`` with "NCCL mem allocator is not supported in
    this NCCL version": the chunk keeps PyTorch's allocator and says so once, instead of failing to build."""
    from shardwise.megatron.nccl_ub import user_buffers

    class Unsupported(_FakeBackend):
        @property
        def mem_allocator(self):
            raise RuntimeError("NCCL mem allocator is not supported in this NCCL version")

        @mem_allocator.setter
        def mem_allocator(self, value):
            pass

    group = _FakeGroup("dp", fake_cuda)
    group.backend = Unsupported("dp", fake_cuda)
    with caplog.at_level("WARNING", logger="shardwise.megatron.mcore_fsdp_adapter"):
        assert user_buffers(SimpleNamespace(nccl_ub=True), (_FakeMesh({"dp_shard": group}),), "V1") is None
    assert [r.message for r in caplog.records if "cannot allocate registered buffers" in r.message]
    assert fake_cuda == []  # nothing registered
