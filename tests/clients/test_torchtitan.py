"""torchtitan's own llama3 model and FSDP recipe, with only ``fully_shard`` rebound to shardwise's.

``torchtitan.distributed.fsdp`` imports ``fully_shard`` from torch; the test rebinds that one name and runs
torchtitan's ``parallelize_llama`` (per-block calls, ``[norm, lm_head]`` or the tied
``[tok_embeddings, norm, lm_head]`` list, the root call, ``disable_fsdp_gradient_division``) on a model built
on the meta device, then its trainer's ``to_empty`` + ``init_weights``, its ``ChunkedLossWrapper`` (which
calls ``unshard``/``reshard``, ``set_reshard_after_*`` and ``set_requires_gradient_sync(recurse=False)`` on
the lm_head unit), its ``clip_grad_norm_``, and accumulation with ``set_requires_gradient_sync``. The same
worker runs torch's FSDP2 first, so the comparison is within one test. The only other rebinding is
torchtitan's device type (it assumes CUDA where none is found): ``cpu`` so gloo runs it. Two settings differ
from torchtitan's defaults because of the CPU: attention is torchtitan's causal SDPA module (its flex attention
has no CPU backward), and every unit gets ``set_force_sum_reduction_for_comms(True)`` (FSDP2 turns a divide
factor of 1.0 into ``ReduceOp.PREMUL_SUM``, which gloo lacks; a SUM is the same reduction).
"""

from __future__ import annotations

import pytest
import torchtitan.distributed.fsdp as tt_fsdp  # scripts/setup.sh installs torchtitan (see pyproject.toml)

from tests.helpers.counting import CollectiveLaunches
from tests.helpers.distributed import run_distributed

STEPS = 3
MICRO = 2  # micro-batches per step (accumulation)
BATCH, SEQ, VOCAB, DIM = 2, 32, 128, 64


def _config(tied: bool, backend: str = "partial_dtensor", tp: int = 1):
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import _EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.model import Llama3Model

    n_heads = 4
    layers = _build_llama3_layers(
        n_layers=2, dim=DIM, n_heads=n_heads, n_kv_heads=2, hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=32),
        rope=ComplexRoPE.Config(dim=DIM // n_heads, max_seq_len=SEQ, theta=500000, scaling="none"),
        attn_backend="flex",
    )
    for layer in layers:  # flex attention has no CPU backward: torchtitan's SDPA attention (causal) instead
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=layers,
    )
    if backend != "partial_dtensor" or tp > 1:  # the trainer's update_from_config: the modules' sharding configs
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(config, enable_sp=False)
    return config


def _train(impl: str, tied: bool, param_dtype: str, dp_replicate: int, backend: str = "partial_dtensor",
           tp: int = 1) -> dict:
    import torch
    import torch.distributed as dist
    import torchtitan.distributed.parallel_dims as tt_dims
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import full_dtensor
    from torchtitan.distributed import utils as tt_utils
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    import shardwise

    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    # A pooled worker ran earlier tests: DTensor's sharding-propagation cache hands back their (equal) meshes,
    # and FSDP2 under dp_mesh_dims insists on the very mesh object its parameters carry
    _clear_sharding_prop_cache()
    world = dist.get_world_size()
    tt_dims.device_type = "cpu"
    tt_utils.set_spmd_backend(backend)  # the trainer's: the loss reads it
    dims = ParallelDims(dp_replicate=dp_replicate, dp_shard=world // dp_replicate // tp, cp=1, tp=tp, pp=1, ep=1,
                        world_size=world, spmd_backend=backend)
    dims.build_mesh()
    with torch.device("meta"):
        model = _config(tied, backend, tp).build()
    torch_fully_shard = tt_fsdp.fully_shard
    wrapper = shardwise.fully_shard if impl == "shardwise" else torch_fully_shard
    dp_mesh_dims = []  # what torchtitan passed, call by call

    def recording(*args, **kwargs):
        dp_mesh_dims.append(kwargs.get("dp_mesh_dims"))
        return wrapper(*args, **kwargs)

    tt_fsdp.fully_shard = recording
    try:
        parallelize_llama(
            model, parallel_dims=dims,
            training=TrainingConfig(mixed_precision_param=param_dtype, mixed_precision_reduce="float32"),
            parallelism=ParallelismConfig(data_parallel_replicate_degree=dp_replicate,
                                          spmd_backend=backend),
            compile_config=CompileConfig(), ac_config=None, dump_folder="",
        )
    finally:
        tt_fsdp.fully_shard = torch_fully_shard
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:  # FSDP2's divide factor 1.0 is ReduceOp.PREMUL_SUM, which gloo lacks; a SUM, as on NCCL
        unit.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=4, loss_fn=CrossEntropyLoss.Config(
        global_vocab_size=VOCAB)))
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    batch_ranks = dist.get_world_size() // tp  # the TP ranks of a data rank read its rows
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS, MICRO, batch_ranks, BATCH, SEQ + 1), generator=gen)
    rank = dist.get_rank() // tp
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    losses, norms, counts = [], [], []
    for step in range(STEPS):
        counter = CollectiveLaunches(impl)
        opt.zero_grad()
        tokens = data[step, :, rank]
        global_tokens = torch.tensor(float(data[step, :, :, :, 1:].numel()))
        step_loss = torch.zeros(())
        for micro in range(MICRO):
            model.set_requires_gradient_sync(micro == MICRO - 1)
            inputs, labels = tokens[micro, :, :-1], tokens[micro, :, 1:]
            extra = {"positions": positions}
            if backend == "full_dtensor":  # the trainer's post_dataloading_process: DTensors on the storage mesh
                inputs, labels, extra = full_dtensor.parallelize_inputs(dims, inputs, labels, extra)
            pred = model(inputs, **extra)
            loss, _ = loss_fn(pred, labels, global_tokens)
            loss.backward()
            step_loss += loss.detach().full_tensor() if hasattr(loss, "full_tensor") else loss.detach()
        counts.append(counter.close())
        norm = tt_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        opt.step()
        dist.all_reduce(step_loss)
        losses.append(step_loss.item())
        norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
    params = {n: p.detach().full_tensor().float() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "params": params, "counts": counts, "units": len(units),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "dp_mesh_dims": [None if d is None else (d.shard, d.replicate) for d in dp_mesh_dims]}


def _both(tied: bool, param_dtype: str, dp_replicate: int, world: int, backend: str = "partial_dtensor", tp: int = 1):
    ref = run_distributed(_train, world, "fsdp2", tied, param_dtype, dp_replicate, backend, tp)[0]
    got = run_distributed(_train, world, "shardwise", tied, param_dtype, dp_replicate, backend, tp)[0]
    return ref, got


def _max_diffs(a: dict, b: dict) -> dict:
    """The largest absolute difference of the losses, the grad norms and all parameters."""
    import torch

    return {"losses": (torch.tensor(a["losses"]) - torch.tensor(b["losses"])).abs().max().item(),
            "norms": (torch.tensor(a["norms"]) - torch.tensor(b["norms"])).abs().max().item(),
            "params": max((a["params"][n] - b["params"][n]).abs().max().item() for n in a["params"])}


def _assert_same(ref: dict, got: dict) -> None:
    """fp32: losses, grad norms and every final parameter to rtol 1e-5."""
    import torch

    assert got["units"] == ref["units"] and got["dtypes"] == ref["dtypes"]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
    assert got["params"].keys() == ref["params"].keys()
    for name in ref["params"]:  # atol: Adam's updates of weights near zero (lr 1e-2, summation order)
        torch.testing.assert_close(got["params"][name], ref["params"][name], rtol=1e-5, atol=1e-6, msg=name)
    assert len(set(ref["norms"])) == STEPS and ref["losses"][0] != ref["losses"][-1]  # it trains


def _assert_counts(ref: dict, got: dict) -> None:
    """Per step, as many all-gathers as FSDP2, and one reduce-scatter (and, under HSDP, one all-reduce)
    fewer per micro-batch. The reason is torchtitan's chunked loss: it turns gradient sync back on for the
    lm_head unit at its last chunk (``recurse=False``, in every micro-batch) and the unit also holds ``norm``
    (and, tied, the embedding). FSDP2 reduces at every post-backward that finds sync on: once after the last
    chunk's backward, again when the decoder's backward reaches ``norm`` (or at the end of backward, tied).
    shardwise reduces a unit once every forward of it has had its backward, so both gradients go in one
    reduce-scatter, with the same sums (the fp32 results agree)."""
    for r, g in zip(ref["counts"], got["counts"], strict=True):
        assert g["gather"] == r["gather"]
        assert g["reduce_scatter"] == (r["reduce_scatter"] - MICRO if r["reduce_scatter"] else 0)  # 1-rank shard
        assert g["all_reduce"] == (r["all_reduce"] - MICRO if r["all_reduce"] else 0)


def test_torchtitan_fsdp_fp32_matches_fsdp2():
    """fp32 parameters, untied, 2 ranks: losses, grad norms and final weights equal FSDP2's."""
    ref, got = _both(tied=False, param_dtype="float32", dp_replicate=1, world=2)
    _assert_same(ref, got)
    _assert_counts(ref, got)


def test_torchtitan_tied_embeddings_match_fsdp2():
    """Tied weights: torchtitan makes ``[tok_embeddings, norm, lm_head]`` one unit. The embedding's input
    needs no grad, so no hook sees its backward; the unit must reduce at the end of backward, after the
    embedding's gradient has landed in the shared weight."""
    ref, got = _both(tied=True, param_dtype="float32", dp_replicate=1, world=2)
    _assert_same(ref, got)
    _assert_counts(ref, got)


def test_torchtitan_bf16_is_fsdp2s_bit_for_bit():
    """bf16 ``mp_policy`` with fp32 reduction: losses, grad norms and final weights are FSDP2's bit for bit.
    The chunked loss's per-chunk backwards (and the first micro-batch's, without sync) leave the gradients
    unreduced; both accumulate them in fp32 (``reduce_dtype``) in the same order, and the bf16 computations
    are the same kernels on the same bf16 weights."""
    import torch

    ref, got = _both(tied=False, param_dtype="bfloat16", dp_replicate=1, world=2)
    assert got["dtypes"] == ref["dtypes"] and got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
    for name in ref["params"]:
        assert torch.equal(got["params"][name], ref["params"][name]), (name, _max_diffs(ref, got))
    _assert_counts(ref, got)


def test_torchtitan_hsdp_2x2_matches_fsdp2():
    """HSDP on 4 ranks: torchtitan's ("dp_replicate", "fsdp") mesh, replicate across 2, shard across 2."""
    ref, got = _both(tied=False, param_dtype="float32", dp_replicate=2, world=4)
    _assert_same(ref, got)
    _assert_counts(ref, got)


def test_torchtitan_tp_2x2_matches_fsdp2():
    """Tensor parallelism, torchtitan's ``partial_dtensor`` backend on 4 ranks (FSDP 2 x TP 2): the model's TP
    plan makes the parameters DTensors on the ``tp`` submesh, then ``fully_shard(mesh=<the fsdp submesh>)``
    (torch's 2-D recipe; ``tp_submesh.py``)."""
    ref, got = _both(tied=False, param_dtype="float32", dp_replicate=1, world=4, tp=2)
    _assert_same(ref, got)
    _assert_counts(ref, got)


@pytest.mark.parametrize("dp_replicate", [1, 2])
def test_torchtitan_full_dtensor_backend_matches_fsdp2(dp_replicate):
    """torchtitan's ``full_dtensor`` SPMD backend: every parameter a DTensor on its dense storage mesh and
    ``fully_shard(mesh=storage_mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"[, replicate=
    "dp_replicate"]))`` (``resolve_fsdp_mesh``), inputs DTensors too (``parallelize_inputs``). 2 ranks: FSDP,
    and HSDP over 2 replicas of one shard. Its default ``spmd_types`` backend hands fully_shard plain tensors
    with spmd_types annotations, which torch 2.13's FSDP2 itself refuses (no DTensors): nothing to compare."""
    ref, got = _both(tied=False, param_dtype="float32", dp_replicate=dp_replicate, world=2, backend="full_dtensor")
    shard = "dp_shard"
    assert ref["dp_mesh_dims"] == got["dp_mesh_dims"] and set(got["dp_mesh_dims"]) == {
        (shard, "dp_replicate" if dp_replicate > 1 else None)}
    _assert_same(ref, got)
    _assert_counts(ref, got)
