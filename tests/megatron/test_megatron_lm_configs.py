"""The configs Megatron-LM itself passes a Megatron-FSDP chunk, through shardwise (CI: no Megatron-LM tree).

``tests/helpers/data/megatron_lm_configs.json`` holds, per Megatron-LM release
(core_r0.16, core_r0.19) and command line, the ``TransformerConfig`` and
``DistributedDataParallelConfig`` field values ``pretrain_gpt.py``'s own
``parse_args`` / ``validate_args`` / ``core_transformer_config_from_args`` and
``training.py``'s DDP-config construction handed the chunk (recorded by
``scripts/megatron_lm_check.py --record``, which runs that entry point; unset
flags are ``None`` there, e.g. ``use_cpu_initialization``). Here they become the
installed Megatron-Core's real objects (fields it does not have are set as
attributes after construction, as the mirror reads them by name) and wrap a
model through ``use_in_megatron()``'s name (V1) and through V2: nothing a release
passes is refused, and what it asks for is what the chunk does.
``tests/megatron/test_megatron_lm_entry.py`` runs the entry point itself where a
tree is given.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig as RealDDPConfig
from megatron.core.process_groups_config import ProcessGroupCollection as RealProcessGroups
from megatron.core.transformer import TransformerConfig as RealTransformerConfig

from shardwise.megatron import (
    FullyShardedDataParallelV1,
    FullyShardedDataParallelV2,
    TransformerConfig,
    as_ddp_config,
    as_transformer_config,
    use_in_megatron,
)
from shardwise.models import GPT, GPTConfig
from shardwise.engine.placements import OUTER_STRATEGY_PLACEMENTS, STRATEGY_PLACEMENTS

from tests.helpers import DATA
from tests.helpers.distributed import device, run_distributed

RECORD = json.loads((DATA / "megatron_lm_configs.json").read_text())
CASES = [(release, case) for release in sorted(RECORD) for case in sorted(RECORD[release]["cases"])]
VOCAB, SEQ = 64, 8


def _value(recorded):
    """A recorded value back as Megatron-LM passed it (``"torch.bfloat16"`` -> the dtype, tuples)."""
    if isinstance(recorded, str) and recorded.startswith("torch.") and isinstance(
            getattr(torch, recorded[len("torch."):], None), torch.dtype):
        return getattr(torch, recorded[len("torch."):])
    if isinstance(recorded, dict) and set(recorded) == {"tuple"}:
        return tuple(recorded["tuple"])
    return recorded


def real_config(cls, recorded: dict):
    """The installed release's ``cls`` from a recorded release's values (unknown fields set afterwards)."""
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    values = {name: _value(v) for name, v in recorded.items()}
    config = cls(**{k: v for k, v in values.items() if k in known})
    for name, value in values.items():
        if name not in known:
            setattr(config, name, value)
    return config


def test_the_record_has_both_releases_and_every_case():
    assert {release.rsplit(".", 1)[0] for release in RECORD} >= {"0.16", "0.19"}, sorted(RECORD)
    for release, entry in RECORD.items():
        cmdlines = {case: c["cmdline"] for case, c in entry["cases"].items()}
        strategies = {c["DistributedDataParallelConfig"]["data_parallel_sharding_strategy"] for c in entry["cases"].values()}
        assert strategies == {"no_shard", "optim", "optim_grads", "optim_grads_params"}, (release, strategies)
        assert any("--use-cpu-initialization" in c for c in cmdlines.values()), release
        assert any("--use-cpu-initialization" not in c for c in cmdlines.values()), release
        assert any("--num-distributed-optimizer-instances 2" in c for c in cmdlines.values()), release
        assert any("--overlap-grad-reduce --overlap-param-gather" in c for c in cmdlines.values()), release
        # Megatron-LM passes None for the flags left unset: the case the type check once refused
        assert any(c["TransformerConfig"]["use_cpu_initialization"] is None for c in entry["cases"].values())


def test_none_in_a_bool_field_reads_as_false_and_elsewhere_is_still_refused():
    real = RealTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2)
    real.use_cpu_initialization = None  # Megatron-LM's value for the flag left unset
    assert as_transformer_config(real).use_cpu_initialization is False and real.use_cpu_initialization is None
    assert TransformerConfig(use_cpu_initialization=None).use_cpu_initialization is False
    ddp = RealDDPConfig(use_megatron_fsdp=True)
    ddp.num_distributed_optimizer_instances = None  # an int Megatron-Core would compare: not Megatron-LM's value
    with pytest.raises(TypeError, match="num_distributed_optimizer_instances=None must be int"):
        as_ddp_config(ddp)


def _placements_asked(ddp) -> tuple:
    """The parameters' DTensor placements (the main weights') over the data-parallel axes the strategy asks for."""
    inner = Replicate() if ddp.data_parallel_sharding_strategy == "no_shard" else Shard(0)
    return (Replicate(), inner) if ddp.num_distributed_optimizer_instances > 1 else (inner,)


def _rows_asked(ddp) -> list:
    """The strategy table's rows (parameter, gradient, optimizer) for the (outer,) inner data-parallel axes."""
    inner = STRATEGY_PLACEMENTS[ddp.data_parallel_sharding_strategy]
    if ddp.num_distributed_optimizer_instances > 1:
        return [OUTER_STRATEGY_PLACEMENTS[ddp.outer_dp_sharding_strategy], inner]
    return [inner]


def _wrap_recorded(release: str, case: str) -> list[str]:
    recorded = RECORD[release]["cases"][case]
    ddp_values = recorded["DistributedDataParallelConfig"]
    instances = ddp_values["num_distributed_optimizer_instances"]
    parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=instances)
    names = use_in_megatron()
    built = []
    try:
        from megatron.core.distributed import FullyShardedDataParallel as MegatronsName
        from megatron.core.utils import unwrap_model

        pg = RealProcessGroups.use_mpu_process_groups()
        for version in (1, 2):
            config = real_config(RealTransformerConfig, recorded["TransformerConfig"])
            ddp = real_config(RealDDPConfig, ddp_values)
            ddp.megatron_fsdp_version = version  # the adapter's next API picks V1 / V2 by it
            torch.manual_seed(0)
            model = GPT(GPTConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, ffn_hidden=64, max_seq_len=16))
            chunk = MegatronsName(config=config, ddp_config=ddp, module=model, device=device(), pg_collection=pg)
            assert type(chunk) is (FullyShardedDataParallelV1 if version == 1 else FullyShardedDataParallelV2)
            # unwrap_model stops at the Megatron-FSDP level, as at Megatron's adapter's MegatronFSDP
            assert unwrap_model(chunk) is chunk.module and chunk.module.module is model is chunk.sharded_model
            assert chunk.config is config and chunk.ddp_config is ddp
            # what the release asked for: the sharding, the gather prefetch, bf16 compute
            for name, param in chunk.sharded_model.named_parameters():
                assert isinstance(param, DTensor) and param.placements[-len(_placements_asked(ddp)):] == \
                    _placements_asked(ddp), (name, param.placements, ddp.data_parallel_sharding_strategy)
            # V1 prefetches the next gather under overlap_param_gather; V2's hooks always do
            assert list(chunk.sharded_state.plan.placements.values()) == _rows_asked(ddp)
            assert chunk.sharded_state.prefetch == (bool(ddp.overlap_param_gather) if version == 1 else True)
            tokens = (torch.arange(2 * SEQ, device=device()).view(2, SEQ) + dist.get_rank()) % VOCAB
            logits = chunk(tokens)
            assert logits.dtype == (torch.bfloat16 if config.bf16 else torch.float32), logits.dtype
            logits.float().square().mean().backward()
            chunk.finish_grad_sync()
            assert all(p.grad is not None for p in chunk.sharded_model.parameters())
            built.append(type(chunk).__name__)
    finally:
        names.restore()
        parallel_state.destroy_model_parallel()
    return built


@pytest.mark.parametrize("release,case", CASES, ids=[f"{r}-{c}" for r, c in CASES])
def test_what_megatron_lm_passes_wraps_and_is_honoured(release, case):
    world = 2  # HSDP: two replicas of one rank each (its 4-rank layout: the entry-point run)
    assert run_distributed(_wrap_recorded, world, release, case) == [
        ["FullyShardedDataParallelV1", "FullyShardedDataParallelV2"]] * world
