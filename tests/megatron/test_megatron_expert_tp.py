"""Expert tensor parallelism with Megatron-Core's own MoE GPTModel (4 gloo processes) against one process.

Megatron-LM's default ``--expert-tensor-parallel-size`` follows TP: at TP2 EP2 each expert's linears are
split over the ``expt_tp`` group, and its expert mesh is Megatron-FSDP's ``[expt_dp, expt_tp]`` (here
``(expert_dp, ep, tp)``, the ``ep`` axis left out of each local expert's DTensor). Expert TP 1 next to
TP 2 keeps each expert whole (its linears built with a one-rank ``expt_tp``). For both, and for V1 and
V2: the chunk trains like Megatron-Core's TP1/EP1 model in one process on the whole global batch (fp32:
losses and every weight within rtol 1e-5, ``tests.helpers.parity``), and Megatron-LM's ``fsdp_dtensor``
state (experts renamed to their global index) saves through DCP and loads into a fresh chunk bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import assert_close_states, relative_error
from tests.megatron.test_megatron_moe_checkpoint import _router_without_transformer_engine

pytest.importorskip("megatron.core", reason="megatron-core is a test requirement of the Megatron face")

VOCAB, SEQ, EXPERTS, GLOBAL_BATCH, STEPS = 64, 8, 4, 4, 3
FSDP_DTENSOR = {"distrib_optim_sharding_type": "fsdp_dtensor"}


def _config(tp: int, ep: int, etp: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=16, num_attention_heads=4, ffn_hidden_size=32, params_dtype=torch.float32,
        use_cpu_initialization=True, gradient_accumulation_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=False, num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=24,
        moe_shared_expert_intermediate_size=24, moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


class _SequenceParallelNorm(torch.nn.LayerNorm):
    """torch's LayerNorm marked as Megatron's ``FusedLayerNorm`` marks its weights under sequence
    parallelism (``sequence_parallel``: their gradients sum over TP). Megatron needs sequence
    parallelism for MoE with TP in training, and its local spec's torch norm refuses it (without Apex)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)
        for param in (self.weight, self.bias):
            param.sequence_parallel = config.sequence_parallel


def _gpt(config, seed: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = _SequenceParallelNorm
    block = TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=_SequenceParallelNorm)
    return GPTModel(config, block, vocab_size=VOCAB, max_sequence_length=SEQ)


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (GLOBAL_BATCH, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    position_ids = torch.arange(SEQ).unsqueeze(0)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    return model(tokens[:, :-1], position_ids, mask, labels=tokens[:, 1:]).float().mean()


def _adamw(params):
    # lr 1e-3 as tests/megatron/test_megatron_tp_ep.py: TP sums partial products in another order than TP 1
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


class _State:
    """Megatron's parallel state over this gloo group, torn down after (CUDA calls on the CPU)."""

    def __init__(self, tp: int = 1, ep: int = 1, etp: int | None = None):
        self.sizes = tp, ep, etp

    def __enter__(self):
        from megatron.core import parallel_state

        from tests.helpers.megatron_cpu import megatron_on_the_cpu

        self.cpu = megatron_on_the_cpu()
        self.cpu.__enter__()
        _router_without_transformer_engine()
        tp, ep, etp = self.sizes
        parallel_state.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        return self

    def __exit__(self, *exc):
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        self.cpu.__exit__(*exc)


def _reference() -> dict:
    """Megatron-Core's TP1/EP1 model in one process on the whole global batch."""
    with _State():
        model = _gpt(_config(1, 1, 1), seed=3)
        initial = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        optimizer, losses = _adamw(model.parameters()), []
        for step in range(STEPS):
            optimizer.zero_grad()
            loss = _loss(model, _batch(step))
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
        return {"initial": initial, "losses": losses,
                "final": {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}}


def _global_key(key: str, local_experts: int, ep_rank: int) -> str:
    if "local_experts." not in key:
        return key
    head, tail = key.split("local_experts.", 1)
    index, rest = tail.split(".", 1)
    return f"{head}local_experts.{int(index) + ep_rank * local_experts}.{rest}"


def _full(value):
    return value.full_tensor() if isinstance(value, DTensor) else value


def _chunk(version: int, tp: int, ep: int, etp: int, initial: dict):
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from shardwise.megatron import DistributedDataParallelConfig, FullyShardedDataParallel

    config = _config(tp, ep, etp)
    ddp = DistributedDataParallelConfig(use_megatron_fsdp=True, megatron_fsdp_version=version,
                                        data_parallel_sharding_strategy="optim_grads_params")
    chunk = FullyShardedDataParallel(config, ddp, _gpt(config, seed=11),
                                     pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    own = [k for k, v in chunk.sharded_model.state_dict().items() if torch.is_tensor(v)]
    # the one-process model's weights, each local expert its global one: full tensors, cut here by TP and DP
    chunk.load_state_dict({k: initial[_global_key(k, EXPERTS // ep, ep_rank)] for k in own}, strict=False)
    return chunk, ep_rank


def _sharded(version: int, tp: int, ep: int, etp: int, initial: dict, folder: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from megatron.core import parallel_state
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )
    from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

    with _State(tp, ep, etp):
        chunk, ep_rank = _chunk(version, tp, ep, etp, initial)
        expert_fc1 = chunk.sharded_model.decoder.layers[0].mlp.experts.local_experts[0].linear_fc1.weight
        mesh = (expert_fc1.device_mesh.mesh_dim_names, tuple(expert_fc1.shape))
        dp_rank = parallel_state.get_data_parallel_rank()
        dp = parallel_state.get_data_parallel_world_size()
        rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
        optimizer, losses = _adamw(chunk.parameters()), []
        for step in range(STEPS):
            chunk.zero_grad_buffer()
            optimizer.zero_grad()
            loss = _loss(chunk, _batch(step)[rows])
            loss.backward()
            chunk.finish_grad_sync()
            optimizer.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean, group=parallel_state.get_data_parallel_group())
            losses.append(mean.item() / dp)
        local = EXPERTS // ep
        final = {_global_key(k, local, ep_rank): _full(v).clone()
                 for k, v in chunk.sharded_model.state_dict().items() if torch.is_tensor(v)}
        # Megatron-LM's fsdp_dtensor state of this chunk through DCP, into a fresh chunk
        state = {"model": handle_experts_in_state_dict(chunk.module.state_dict_for_save_checkpoint(), EXPERTS)}
        preprocess_state_dict_for_uneven_dtensor(state)
        dcp.save(state, checkpoint_id=folder)
        fresh, _ = _chunk(version, tp, ep, etp, {k: torch.zeros_like(v) for k, v in initial.items()})
        raw = fresh.module.state_dict_for_save_checkpoint()
        state = {"model": handle_experts_in_state_dict(raw, EXPERTS)}
        preprocess_state_dict_for_uneven_dtensor(state)
        dcp.load(state, checkpoint_id=folder)
        fresh.load_state_dict(raw, strict=True)
        resumed = {_global_key(k, local, ep_rank): _full(v)
                   for k, v in fresh.sharded_model.state_dict().items() if torch.is_tensor(v)}
        wrong = [k for k, v in resumed.items() if not torch.equal(v, final[k])]
        return {"losses": losses, "final": final, "mesh": mesh, "wrong": wrong}


CASES = [  # (V, TP, EP, expert TP, expert DTensor mesh, one local expert's fc1 shape)
    (1, 2, 2, 2, ("tp", "expert_dp"), (24, 16)),  # expert TP following TP (Megatron-LM's default)
    (2, 2, 2, 1, ("expert_dp",), (24, 16)),  # expert TP 1 next to TP 2
    (1, 2, 1, 1, ("expert_dp",), (24, 16)),  # one EP rank, experts whole next to TP 2
]


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_reference, 1)[0]


@pytest.mark.slow
@pytest.mark.parametrize("version,tp,ep,etp,mesh,shape", CASES)
def test_expert_tensor_parallel_trains_like_one_process_and_checkpoints(version, tp, ep, etp, mesh, shape, reference,
                                                                       tmp_path):
    ranks = run_distributed(_sharded, 4, version, tp, ep, etp, reference["initial"], str(tmp_path))
    final = {}
    for rank, got in enumerate(ranks):
        assert got["mesh"] == (mesh, shape), rank
        assert not got["wrong"], (rank, got["wrong"])
        torch.testing.assert_close(torch.tensor(got["losses"], dtype=torch.float64),
                                   torch.tensor(reference["losses"], dtype=torch.float64), rtol=1e-5, atol=0)
        final.update(got["final"])
    assert_close_states(final, reference["final"])
    # and it trained: every weight (each expert's too) moved by far more than the tolerance
    moved = {k: relative_error(reference["final"][k], v) for k, v in reference["initial"].items()}
    assert min(moved.values()) > 100 * 1e-5, min(moved.items(), key=lambda kv: kv[1])
