"""The options table (``shardwise/megatron/options.py``) row by row, in V1 and V2.

- The table covers every ``DistributedDataParallelConfig`` field of Megatron-Core
  0.16.1 and 0.19.2 (``tests/helpers/data/megatron_core_fields.json``), its
  release column is that record's, and ``docs/megatron-options.md`` is its rendering.
- Each REFUSED row: the real constructor refuses it at wrap time, naming the face,
  field and value and what to do, with Megatron-Core's own objects (and the mirror).
- Each IGNORED row: the chunk wraps, and one step gives the gradients it gives without it.
- IMPLEMENTED rows with behaviour of their own: main weight / main grad dtypes
  (Megatron's ``auto`` per release; mixed dtypes trained against one process),
  ``decoupled_grad``, fused wgrad accumulation through Megatron's real linear
  layers, the NaN check. Megatron's ``DistributedOptimizer`` itself allocates on
  CUDA in its constructor (0.16.1), so the optimizer-side reads of
  ``decoupled_grad`` are checked with its CPU-capable helper
  (``_zero_grad_group_helper``) and left to the GPU run otherwise.
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatron.core.distributed import DistributedDataParallelConfig as RealDDPConfig
from megatron.core.transformer import TransformerConfig as RealTransformerConfig

import shardwise
from shardwise.engine.model_ops import compute_parameters, sharded_state
from shardwise.megatron import (
    DistributedDataParallelConfig,
    FullyShardedDataParallelV1,
    FullyShardedDataParallelV2,
    ProcessGroupCollection,
    TransformerConfig,
    build_process_groups,
)
from shardwise.megatron.main_dtypes import mixed_precision_for
from shardwise.megatron.options import (
    ARG, DDP, OPTIONS, TC, V1, V2, UnsupportedMegatronOption, Verdict, render_markdown,
)
from shardwise.megatron.config import as_ddp_config, as_transformer_config

from tests.helpers import DATA, REPO
from tests.helpers.distributed import device, run_distributed
from tests.helpers.parity import Trained, compare, megatron_hooks, train_both
from tests.helpers.tiny_model import Block, TinyConfig, TinyLM, batch

RECORD = json.loads((DATA / "megatron_core_fields.json").read_text())
FACES = {V1: FullyShardedDataParallelV1, V2: FullyShardedDataParallelV2}
RELEASE_NAMES = {"0.16.1": "0.16", "0.19.2": "0.19"}
CLASS_OF = {DDP: "DistributedDataParallelConfig", TC: "TransformerConfig"}


# ------------------------------------------------------------------ the table itself
def test_the_doc_page_is_the_table():
    page = (REPO / "docs" / "megatron-options.md").read_text()
    assert page == render_markdown(), "run: python -m shardwise.megatron.options"


def test_every_ddp_field_of_both_releases_has_a_row():
    rows = {o.name for o in OPTIONS if o.source == DDP}
    for release, classes in RECORD.items():
        missing = set(classes["DistributedDataParallelConfig"]) - rows
        assert not missing, (release, sorted(missing))


@pytest.mark.parametrize("row", [o for o in OPTIONS if o.source != ARG], ids=lambda o: o.name)
def test_release_column_is_megatron_cores(row):
    have = [RELEASE_NAMES[r] for r in sorted(RECORD) if row.name in RECORD[r][CLASS_OF[row.source]]]
    assert row.releases == (", ".join(have) if have else "shardwise")


def test_each_refused_row_says_what_to_do():
    for row in OPTIONS:
        for face in FACES:
            handling = row.handling(face)
            if handling.verdict is Verdict.REFUSED:
                assert handling.todo and handling.text, (row.name, face)


# ------------------------------------------------------------------ refused rows
_TRIGGER = {
    "fp8": "e4m3", "fp4": "e2m1", "cuda_graph_impl": "local", "pipeline_model_parallel_size": 2,
    "context_parallel_size": 2, "param_name_patterns_for_fp32_local_accumulation": ("router",),
    "pg_collection": None,
}
REFUSED = [(face, row) for row in OPTIONS for face in FACES if row.handling(face).verdict is Verdict.REFUSED]
_MIRRORS = {DDP: DistributedDataParallelConfig(), TC: TransformerConfig()}
# Megatron-Core's own objects for every row; shardwise's mirrors for the fields they carry
REFUSED_CASES = [(face, row, real) for face, row in REFUSED for real in (True, False)
                 if real or row.source == ARG or hasattr(_MIRRORS[row.source], row.name)]


def _wrap_args(face, config, ddp, **arguments):
    kwargs = dict(pg_collection=ProcessGroupCollection(dp_cp=object()) if face == V2 else None)
    kwargs.update(arguments)
    return dict(config=config, ddp_config=ddp, module=TinyLM(TinyConfig()), **kwargs)


@pytest.mark.parametrize("face,row,real", REFUSED_CASES,
                         ids=[f"{f[-2:]}-{r.name}-{'mcore' if real else 'mirror'}" for f, r, real in REFUSED_CASES])
def test_refused_at_wrap_time_by_field_and_value(face, row, real):
    value = _TRIGGER.get(row.name, True)
    if real:
        config = RealTransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
        ddp = RealDDPConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    else:
        config, ddp = TransformerConfig(), DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    arguments = {}
    if row.source == ARG:
        arguments[row.name] = value
    else:
        setattr(ddp if row.source == DDP else config, row.name, value)  # after construction: Megatron-Core's own checks stay out of it
    handling = row.handling(face)
    with pytest.raises(UnsupportedMegatronOption, match=re.escape(f"{face} does not support {row.name}={value!r}")) as err:
        FACES[face](**_wrap_args(face, config, ddp, **arguments))
    assert handling.todo in str(err.value) and isinstance(err.value, ValueError)


def _manual_registration(face):
    wrapped = _wrap(face, TransformerConfig(), _ddp(), TinyLM(TinyConfig()), build_process_groups())
    with pytest.raises(RuntimeError, match="needs nccl_ub=True and fsdp_manual_registration=True"):
        wrapped.param_and_grad_buffer.manual_buffer_registration()
    return True


@pytest.mark.parametrize("face", FACES)
def test_manual_buffer_registration_exists_and_says_what_to_do(face):
    assert run_distributed(_manual_registration, 1, face) == [True]


# ------------------------------------------------------------------ ignored rows
_IGNORED_VALUE = {"num_buckets": 4, "suggested_communication_unit_size": 1000, "bucket_size": 1000}


def _ddp(**fields):
    values = dict(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    values.update(fields)
    return DistributedDataParallelConfig(**values)


def _wrap(face, config, ddp, model, pg):
    return FACES[face](config, ddp, model, fsdp_unit_modules=[Block], device=device(), pg_collection=pg)


def _one_step_grads(face, config, ddp, pg) -> dict:
    torch.manual_seed(0)
    wrapped = _wrap(face, config, ddp, TinyLM(TinyConfig()), pg)
    tokens, targets = batch(0, 4, TinyConfig())
    wrapped(tokens.to(device()), targets.to(device())).backward()
    wrapped.finish_grad_sync()
    return {n: p.grad.full_tensor() for n, p in wrapped.sharded_model.named_parameters() if p.grad is not None}


def _ignored_rows_change_nothing():
    pg = build_process_groups()
    checked = []
    for face in FACES:
        baseline = _one_step_grads(face, TransformerConfig(), _ddp(), pg)
        for row in OPTIONS:
            if row.handling(face).verdict is not Verdict.IGNORED or row.source == ARG:
                continue
            value = False if row.when.text == "False" else _IGNORED_VALUE.get(row.name, True)
            config, ddp = TransformerConfig(), _ddp()
            target = ddp if row.source == DDP else config
            setattr(target, row.name, value)
            grads = _one_step_grads(face, config, ddp, pg)
            assert grads.keys() == baseline.keys()
            for name in grads:
                assert torch.equal(grads[name], baseline[name]), (face, row.name, name)
            checked.append((face, row.name))
    return checked


def test_ignored_rows_wrap_and_change_nothing():
    checked = run_distributed(_ignored_rows_change_nothing, 1)[0]
    expected = [(f, r.name) for f in FACES for r in OPTIONS
                if r.handling(f).verdict is Verdict.IGNORED and r.source != ARG]
    assert checked == expected


# ------------------------------------------------------------------ main dtypes and auto
class Release016DDPConfig:
    """Megatron-Core 0.16.1's DDP config as it is: no Megatron-FSDP dtype fields."""

    def __init__(self, **fields):
        real = RealDDPConfig(**fields)
        for name, value in vars(real).items():
            setattr(self, name, value)


@pytest.mark.parametrize("bf16", [False, True])
def test_auto_means_what_each_release_means(bf16):
    model = TinyLM(TinyConfig())
    compute = torch.bfloat16 if bf16 else torch.float32
    cfg = as_transformer_config(TransformerConfig(bf16=bf16))

    def policy(raw):
        return mixed_precision_for(cfg, as_ddp_config(raw), raw, model)

    # 0.19 (and the mirror): None = the compute dtype; Megatron-LM's defaults are fp32 / auto / auto
    assert not hasattr(RealDDPConfig(), "megatron_fsdp_main_grads_dtype")  # the installed 0.16.1
    p = policy(DistributedDataParallelConfig(megatron_fsdp_main_params_dtype=None, grad_reduce_in_fp32=True))
    assert (p.main_params_dtype, p.main_grads_dtype, p.comm_dtype(compute)) == (compute, compute, compute)
    p = policy(DistributedDataParallelConfig(grad_reduce_in_fp32=True))  # 0.19's Megatron-FSDP ignores it
    assert (p.main_params_dtype, p.main_grads_dtype) == (torch.float32, compute)
    p = policy(DistributedDataParallelConfig(megatron_fsdp_main_grads_dtype=torch.float32,
                                             megatron_fsdp_grad_comm_dtype=torch.bfloat16))
    assert (p.main_grads_dtype, p.comm_dtype(torch.float32)) == (torch.float32, torch.bfloat16)
    # 0.16: preserve_fp32_weights and grad_reduce_in_fp32 decide
    p = policy(RealDDPConfig(grad_reduce_in_fp32=True))
    assert (p.main_params_dtype, p.main_grads_dtype) == (torch.float32, torch.float32)
    p = policy(RealDDPConfig(grad_reduce_in_fp32=False, preserve_fp32_weights=False))
    assert (p.main_params_dtype, p.main_grads_dtype) == (compute, compute)


def _dtypes_reach_the_groups(face):
    pg = build_process_groups()
    cfg = TransformerConfig(bf16=True)
    wrapped = _wrap(face, cfg, _ddp(megatron_fsdp_main_params_dtype=torch.float32), TinyLM(TinyConfig()), pg)
    groups = sharded_state(wrapped.sharded_model).groups
    tokens, targets = batch(0, 4, TinyConfig())
    wrapped(tokens.to(device()), targets.to(device())).backward()
    wrapped.finish_grad_sync()
    grads = {p.grad.dtype for p in wrapped.sharded_model.parameters() if p.grad is not None}
    return ({(g.main_dtype, g.main_grad_dtype, g.compute_dtype) for g in groups if g.requires_grad}, grads)


@pytest.mark.parametrize("face", FACES)
def test_megatron_lm_defaults_accumulate_in_bf16_and_step_fp32(face):
    groups, grads = run_distributed(_dtypes_reach_the_groups, 1, face)[0]
    assert groups == {(torch.float32, torch.bfloat16, torch.bfloat16)}
    assert grads == {torch.float32}  # the cast Megatron-FSDP makes for the optimizer


def _rounded_reference_backward(parts: int, grad_dtype: torch.dtype):
    """The sharded run's arithmetic in one process: each data rank's rows (the same shapes) give fp32
    gradients, averaged in fp32 in rank order (the reduction, in fp32), stored in ``grad_dtype`` (the main
    grads) and handed to the optimizer in the weights' dtype (Megatron-FSDP's cast)."""

    def backward(reference, tokens, targets):
        rows = tokens.shape[0] // parts
        params = list(reference.parameters())
        sums = [None] * len(params)
        loss = torch.zeros(())
        for k in range(parts):
            part = slice(k * rows, (k + 1) * rows)
            part_loss = reference(tokens[part], targets[part])
            part_loss.backward()
            loss += part_loss.detach()
            for i, q in enumerate(params):
                if q.grad is not None:
                    sums[i] = q.grad.float() if sums[i] is None else sums[i] + q.grad.float()
                    q.grad = None
        for p, total in zip(params, sums):
            if total is not None:
                p.grad = (total / parts).to(grad_dtype).to(p.dtype)
        return loss / parts

    return backward


def _train_mixed(face: str, main_grads: torch.dtype) -> tuple[Trained, Trained]:
    world = dist.get_world_size()
    pg = build_process_groups()
    ddp = _ddp(megatron_fsdp_main_params_dtype=torch.float32, megatron_fsdp_main_grads_dtype=main_grads,
               megatron_fsdp_grad_comm_dtype=torch.float32)

    def build():
        torch.manual_seed(0)
        return TinyLM(TinyConfig())

    sharded, reference = train_both(
        build, lambda m: _wrap(face, TransformerConfig(), ddp, m, pg),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), lambda step: batch(step, 8, TinyConfig()),
        4, hooks=megatron_hooks(), full_state=lambda w: shardwise.full_state_dict(w.sharded_model),
        reference_backward=_rounded_reference_backward(world, main_grads),
    )
    return _sendable(sharded), _sendable(reference)


def _sendable(run: Trained) -> Trained:
    """What a worker sends back: the losses and the full state (a sharded model does not pickle)."""
    return Trained(run.losses, run.state, None, None)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("face", FACES)
def test_fp32_main_weights_with_bf16_main_grads_train_like_one_process(face, world):
    # fp32 compute and reduction; the gradients are rounded to bf16 where the run keeps them, as the
    # reference rounds them: what is left is the fp32 order of the average (1e-5 as for any fp32 run)
    for sharded, reference in run_distributed(_train_mixed, world, face, torch.bfloat16):
        compare(sharded, reference, trained_by=0.1)


BF16_STEPS = 3


def _bf16_main_weights_with_fp32_grads():
    pg = build_process_groups()
    world = dist.get_world_size()
    ddp = _ddp(megatron_fsdp_main_params_dtype=None, megatron_fsdp_main_grads_dtype=torch.float32)

    def build():
        torch.manual_seed(0)
        return TinyLM(TinyConfig()).to(torch.bfloat16)

    def reference_backward(reference, tokens, targets):
        # bf16 gradients of each rank's rows, averaged in fp32 (the main grads), cast back for the bf16 weights
        return _rounded_reference_backward(world, torch.float32)(reference, tokens, targets)

    sharded, reference = train_both(
        build, lambda m: _wrap(V1, TransformerConfig(bf16=True), ddp, m, pg),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.05), lambda step: batch(step, 8, TinyConfig()),
        BF16_STEPS, hooks=megatron_hooks(), full_state=lambda w: shardwise.full_state_dict(w.sharded_model),
        reference_backward=reference_backward,
    )
    main = {g.main_dtype for g in sharded_state(sharded.model.sharded_model).groups}
    return _sendable(sharded), _sendable(reference), main


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_main_weights_with_fp32_main_grads_train_like_one_process(world):
    for sharded, reference, main in run_distributed(_bf16_main_weights_with_fp32_grads, world):
        assert main == {torch.bfloat16}  # auto: the compute weights are the main weights
        # bf16 weights, each step's update rounded once to bf16 in both runs from fp32 gradients that
        # differ only in the fp32 order of the average: the two runs' weights are the same bf16 numbers
        # unless such a difference flips a rounding to the neighbouring bf16 number, one ulp, at most one
        # bf16 epsilon of the element (so of its tensor, and of its tensor's largest element), once per step
        bound = BF16_STEPS * torch.finfo(torch.bfloat16).eps
        compare(sharded, reference, loss_rtol=bound, rtol=bound, element_rtol=bound)


# ------------------------------------------------------------------ decoupled_grad
def _decoupled(face):
    from megatron.core.optimizer.optimizer import _zero_grad_group_helper

    pg = build_process_groups()
    results = {}
    for decoupled in (False, True):
        torch.manual_seed(0)
        ddp = _ddp(megatron_fsdp_main_grads_dtype=torch.bfloat16, megatron_fsdp_grad_comm_dtype=torch.float32)
        ddp.megatron_fsdp_use_decoupled_grad = decoupled
        wrapped = _wrap(face, TransformerConfig(), ddp, TinyLM(TinyConfig()), pg)
        tokens, targets = batch(0, 8, TinyConfig())
        rows = slice(dist.get_rank() * 8 // dist.get_world_size(), (dist.get_rank() + 1) * 8 // dist.get_world_size())
        for step in range(2):  # the second step: after Megatron's optimizer cleared the decoupled grads
            wrapped.zero_grad_buffer()
            wrapped(tokens[rows].to(device()), targets[rows].to(device())).backward()
            wrapped.finish_grad_sync()
            params = list(wrapped.sharded_model.parameters())
            if step == 0 and decoupled:
                assert all(p.grad is None for p in params)
                grads = [p.decoupled_grad for p in params if getattr(p, "decoupled_grad", None) is not None]
                assert grads and all(isinstance(g, DTensor) and g.dtype == torch.bfloat16 for g in grads)
                _zero_grad_group_helper(params, set_to_none=True, use_decoupled_grad=True)  # Megatron's zero_grad
                assert all(getattr(p, "decoupled_grad", None) is None for p in params)
        wrapped.scale_gradients(0.5)
        attr = "decoupled_grad" if decoupled else "grad"
        results[decoupled] = {n: getattr(p, attr).full_tensor().float()
                              for n, p in wrapped.sharded_model.named_parameters() if getattr(p, attr, None) is not None}
    return results


@pytest.mark.parametrize("face", FACES)
def test_decoupled_grad_holds_the_uncast_main_grads(face):
    for results in run_distributed(_decoupled, 2, face):
        cast, decoupled = results[False], results[True]
        assert cast.keys() == decoupled.keys() and cast
        for name in cast:  # the same bf16 numbers: one handed out cast to fp32, the other as they are
            assert torch.equal(cast[name], decoupled[name]), name


# ------------------------------------------------------------------ gradient_accumulation_fusion
def _megatron_linears(fusion: bool):
    import megatron.core.tensor_parallel.layers as layers

    class Net(torch.nn.Module):
        def __init__(self, cfg):
            super().__init__()
            self.a = layers.ColumnParallelLinear(8, 16, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                                 gather_output=False)
            self.b = layers.RowParallelLinear(16, 8, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                              input_is_parallel=True, skip_bias_add=False)

        def forward(self, x):
            y, _ = self.a(x)
            y, _ = self.b(torch.relu(y))
            return y

    cfg = RealTransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True,
                                gradient_accumulation_fusion=fusion)
    torch.manual_seed(0)
    return Net(cfg), cfg, (layers.ColumnParallelLinear, layers.RowParallelLinear)


def _fused_wgrad(face):
    import megatron.core.tensor_parallel.layers as layers
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection as RealProcessGroups

    # Megatron's layers refuse gradient_accumulation_fusion without apex's CUDA kernel; its
    # Megatron-FSDP path (a weight with __fsdp_param__) never calls that kernel: a plain matmul into
    # get_main_grad(). The flag says the kernel is there so that path runs on the CPU.
    available, layers._grad_accum_fusion_available = layers._grad_accum_fusion_available, True
    parallel_state.initialize_model_parallel()
    try:
        pg = RealProcessGroups.use_mpu_process_groups()
        ddp = RealDDPConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
        grads, calls = {}, []
        for fusion in (False, True):
            net, cfg, units = _megatron_linears(fusion)
            wrapped = FACES[face](cfg, ddp, net, fsdp_unit_modules=list(units), device=device(), pg_collection=pg)
            if fusion:
                for p in compute_parameters(wrapped.sharded_model):
                    inner = p.get_main_grad
                    p.get_main_grad = (lambda f: lambda: calls.append(1) or f())(inner)
            g = torch.Generator().manual_seed(7 + dist.get_rank())
            wrapped.zero_grad_buffer()
            for micro in range(2):  # two micro-batches: the first under no_sync
                x = torch.randn(3, 2, 8, generator=g).to(device())
                ctx = wrapped.no_sync() if micro == 0 else torch.enable_grad()
                with ctx:
                    wrapped(x).square().mean().backward()
            wrapped.finish_grad_sync()
            grads[fusion] = {n: p.grad.full_tensor() for n, p in wrapped.sharded_model.named_parameters()}
            if fusion:
                left = [getattr(p, "main_grad", None) for p in compute_parameters(wrapped.sharded_model)]
        return grads, len(calls), left
    finally:
        parallel_state.destroy_model_parallel()
        layers._grad_accum_fusion_available = available


@pytest.mark.parametrize("face", FACES)
def test_gradient_accumulation_fusion_through_megatrons_layers(face):
    for grads, calls, left in run_distributed(_fused_wgrad, 2, face):
        assert calls == 2 * 2  # both weights, both micro-batches wrote through get_main_grad()
        assert all(m is None for m in left)  # no full gradient outlives its reduction
        plain, fused = grads[False], grads[True]
        assert plain.keys() == fused.keys()
        for name in plain:
            torch.testing.assert_close(fused[name], plain[name], rtol=1e-6, atol=0)


# ------------------------------------------------------------------ check_for_nan_in_grad
def _nan_check(face, check: bool):
    pg = build_process_groups()
    wrapped = _wrap(face, TransformerConfig(), _ddp(check_for_nan_in_grad=check), TinyLM(TinyConfig()), pg)
    tokens, targets = batch(0, 4, TinyConfig())
    wrapped(tokens.to(device()), targets.to(device())).backward()
    wrapped.finish_grad_sync()  # finite: passes
    if dist.get_rank() == 0:  # one rank's shard only
        bad = next(p for p in wrapped.sharded_model.parameters() if p.grad is not None and p.grad.to_local().numel())
        bad.grad.to_local().view(-1)[0] = float("nan")
    try:
        wrapped.finish_grad_sync()
    except RuntimeError as err:
        return str(err)
    return None


@pytest.mark.parametrize("face", FACES)
def test_check_for_nan_in_grad_raises_on_every_rank(face):
    messages = run_distributed(_nan_check, 2, face, True)
    assert all(m is not None and "check_for_nan_in_grad=True" in m and "--no-check-for-nan-in-loss-and-grad" in m
               for m in messages), messages
    assert "this rank" in messages[0] and "another rank" in messages[1]
    assert run_distributed(_nan_check, 2, face, False) == [None, None]
