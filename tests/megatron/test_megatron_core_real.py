"""shardwise.megatron against Megatron-Core's own objects, not look-alikes written here.

- The config mirror against Megatron-Core's source, per release (0.16.1 and 0.19.2,
  ``tests/helpers/data/megatron_core_fields.json`` from ``scripts/megatron_core_fields.py``):
  the same declared types, every real default accepted, wrong types refused.
- The installed Megatron-Core (CI: 0.16.1, the newest that installs on Python 3.11):
  its ``TransformerConfig``, ``DistributedDataParallelConfig`` and a ``ProcessGroupCollection``
  from ``parallel_state`` on gloo through both wrappers, on 2 and 4 processes, trained against one
  process; V2's rules on the real fields; ``use_in_megatron()`` as Megatron's own
  ``unwrap_model`` sees it.
Megatron's GPTModel, schedules and optimizer need CUDA: ``scripts/megatron_lm_step.py`` runs
those on a GPU (``docs/benchmarks.md``).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import megatron.core
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig as RealDDPConfig
from megatron.core.process_groups_config import ProcessGroupCollection as RealProcessGroups
from megatron.core.transformer import TransformerConfig as RealTransformerConfig

import shardwise
from shardwise.megatron import (
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    FullyShardedDataParallelV1,
    FullyShardedDataParallelV2,
    TransformerConfig,
    as_ddp_config,
    as_transformer_config,
    use_in_megatron,
)
from shardwise.megatron.config import _declared_kind
from shardwise.megatron.options import DDP, OPTIONS, TC, V2, Verdict
from shardwise.models import GPT, GPTConfig

from tests.helpers import DATA
from tests.helpers.distributed import device, run_distributed
from tests.helpers.megatron_mirrors import mirrored_fields
from tests.helpers.parity import compare, megatron_hooks, train_both

RECORD = json.loads((DATA / "megatron_core_fields.json").read_text())
MIRRORS = {"TransformerConfig": TransformerConfig, "DistributedDataParallelConfig": DistributedDataParallelConfig}
INSTALLED = megatron.core.__version__
VOCAB, SEQ, GLOBAL_BATCH = 64, 12, 8


def _value(source: str):
    """A default from its source text (``torch.float32``, literals); ``...`` when it is not a plain value."""
    if source is None or source == "<factory>":
        return ...
    if source.startswith("torch."):
        return getattr(torch, source[len("torch."):])
    try:
        return ast.literal_eval(source)
    except ValueError:
        return ...


# ---------------------------------------------------------------- the mirror vs the source
@pytest.mark.parametrize("cls_name", sorted(MIRRORS))
@pytest.mark.parametrize("version", sorted(RECORD))
def test_mirror_declares_megatrons_types_and_takes_its_defaults(version, cls_name):
    real = RECORD[version][cls_name]
    mine = mirrored_fields(MIRRORS[cls_name])
    shared = [name for name in mine if name in real]
    assert len(shared) >= 20, shared
    for name in shared:
        assert _declared_kind(mine[name][0]) == _declared_kind(real[name][0]) or mine[name][0] == real[name][0], (
            f"{cls_name}.{name}: shardwise declares {mine[name][0]}, Megatron-Core {version} {real[name][0]}"
        )
    defaults = {name: _value(real[name][1]) for name in shared}
    built = MIRRORS[cls_name](**{k: v for k, v in defaults.items() if v is not ...})  # every real default is accepted
    assert all(getattr(built, k) == v for k, v in defaults.items() if v is not ...)


def test_every_ddp_field_of_the_newest_release_is_mirrored():
    # an option Megatron adds must be read (and V2 must be able to refuse it), not dropped unseen
    newest = max(RECORD, key=lambda v: tuple(int(x) for x in v.split(".")))
    missing = set(RECORD[newest]["DistributedDataParallelConfig"]) - set(mirrored_fields(DistributedDataParallelConfig))
    assert not missing, f"Megatron-Core {newest} DistributedDataParallelConfig fields not mirrored: {sorted(missing)}"


def test_the_record_matches_the_installed_release():
    assert INSTALLED in RECORD, f"record Megatron-Core {INSTALLED} with scripts/megatron_core_fields.py"
    for cls_name, cls in (("TransformerConfig", RealTransformerConfig), ("DistributedDataParallelConfig", RealDDPConfig)):
        assert {f.name for f in dataclasses.fields(cls)} == set(RECORD[INSTALLED][cls_name]), cls_name


def test_real_objects_pass_and_wrong_types_are_refused():
    real = RealTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2)
    assert as_transformer_config(real).num_layers == 2
    assert as_ddp_config(RealDDPConfig()).data_parallel_sharding_strategy == "no_shard"
    real.bf16 = "false"  # truthy: Megatron itself would compute in bf16
    with pytest.raises(TypeError, match=r"bf16='false' must be bool"):
        as_transformer_config(real)
    ddp = RealDDPConfig(use_megatron_fsdp=True)
    ddp.num_distributed_optimizer_instances = "2"
    with pytest.raises(TypeError, match="num_distributed_optimizer_instances='2' must be int"):
        as_ddp_config(ddp)


_FLAG_VALUES = {"fp8": "e4m3", "fp4": "e2m1", "cuda_graph_impl": "local", "pipeline_model_parallel_size": 2,
                "context_parallel_size": 2}


def _real_has(source: str, field: str) -> bool:
    cls = RealTransformerConfig if source == TC else RealDDPConfig
    return field in {f.name for f in dataclasses.fields(cls)}


# the rules on the fields the installed release has (all rows, both faces: tests/megatron/test_megatron_options.py)
@pytest.mark.parametrize("source,field", [(o.source, o.name) for o in OPTIONS if o.source in (DDP, TC)
                                          and o.handling(V2).verdict is Verdict.REFUSED and _real_has(o.source, o.name)],
                         ids=lambda x: x)
def test_v2_refuses_each_unsupported_real_field(source, field):
    config = RealTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2)
    ddp = RealDDPConfig(use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params")
    setattr(config if source == TC else ddp, field, _FLAG_VALUES.get(field, True))
    with pytest.raises(ValueError, match=re.escape(field)):
        FullyShardedDataParallelV2._validate_config(config, ddp, nn.Linear(2, 2), RealProcessGroups(dp_cp=object()))


# -------------------------------------------------------- training with the real objects
def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    start = torch.randint(0, VOCAB, (GLOBAL_BATCH, 1), generator=g)
    data = (start + torch.arange(SEQ + 1)) % VOCAB
    return data[:, :-1], data[:, 1:]


def _real_configs(version: int, strategy: str, outer: str, instances: int):
    config = RealTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=2)
    ddp = RealDDPConfig(
        use_megatron_fsdp=True, use_distributed_optimizer=True, data_parallel_sharding_strategy=strategy,
        outer_dp_sharding_strategy=outer, num_distributed_optimizer_instances=instances,
    )
    ddp.megatron_fsdp_version = version  # Megatron-Core's next release adds this field
    return config, ddp


def _train_with_real_objects(version, strategy, outer, instances):
    parallel_state.initialize_model_parallel(num_distributed_optimizer_instances=instances)
    try:
        pg = RealProcessGroups.use_mpu_process_groups()
        config, ddp = _real_configs(version, strategy, outer, instances)
        names = use_in_megatron() if version == 1 else None  # build through Megatron's own name
        try:
            def wrap(model):
                if names is not None:
                    from megatron.core.distributed import FullyShardedDataParallel as MegatronsName
                    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
                    from megatron.core.utils import unwrap_model

                    wrapped = MegatronsName(config=config, ddp_config=ddp, module=model, device=device(),
                                            pg_collection=pg)
                    assert isinstance(wrapped, mcore_fsdp_adapter.FullyShardedDataParallel)
                    # Megatron unwraps it as its own adapter: down to the Megatron-FSDP level, whose .module is the model
                    assert unwrap_model(wrapped) is wrapped.module and wrapped.module.module is model
                else:
                    wrapped = FullyShardedDataParallel(config, ddp, model, device=device(), pg_collection=pg)
                assert isinstance(wrapped, FullyShardedDataParallelV1 if version == 1 else FullyShardedDataParallelV2)
                assert wrapped.config is config and wrapped.ddp_config is ddp
                assert all(getattr(p, "__fsdp_param__", False) for p in wrapped.parameters())
                return wrapped

            def build():
                torch.manual_seed(0)
                return GPT(GPTConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, ffn_hidden=64, max_seq_len=16))

            # Megatron's optimizer rebuilds the compute weights through param_and_grad_buffer after its step
            hooks = megatron_hooks(param_sync=False)
            hooks.after_step = lambda w: w.param_and_grad_buffer.copy_main_weights_to_model_weights()
            dp = pg.dp_cp
            sharded, reference = train_both(
                build, wrap, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6),
                _batch, 3, data_rank=dist.get_rank(dp), data_ranks=dist.get_world_size(dp), micro_batches=2,
                hooks=hooks, loss_group=dp, full_state=lambda w: shardwise.full_state_dict(w.sharded_model),
            )
            compare(sharded, reference, trained_by=0.05)
            wrapped = sharded.model
            state = wrapped.state_dict()
            assert set(state) == {f"module.{k}" for k in reference.model.state_dict()}  # Megatron's adapter's keys
            wrapped.load_state_dict(state)  # its own DTensors back in
            if names is not None:
                names.restore()
                from megatron.core.distributed.fsdp import mcore_fsdp_adapter

                assert not isinstance(wrapped, mcore_fsdp_adapter.FullyShardedDataParallel)
        finally:
            if names is not None:
                names.restore()
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize(
    "world,version,strategy,outer,instances",
    [
        (2, 1, "optim_grads_params", "no_shard", 1),  # V2: the HFSDP case below (ZeRO-1/2: the GPU runs)
        (4, 1, "optim_grads_params", "no_shard", 2),  # HSDP over Megatron's intra/inter groups
        (4, 2, "optim_grads_params", "optim", 2),  # HFSDP
    ],
)
def test_real_configs_and_groups_train_like_one_process(world, version, strategy, outer, instances):
    run_distributed(_train_with_real_objects, world, version, strategy, outer, instances)


# ------------------------------------------------ docs/megatron.md's Megatron-LM recipe
def _readme_recipe() -> tuple[str, str]:
    """(the one added line's block, the runnable block) of docs/megatron.md's "From Megatron-LM" part."""
    from tests.helpers import REPO

    part = (REPO / "docs" / "megatron.md").read_text().split("\n## From Megatron-LM", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    assert len(blocks) == 2, f"expected the recipe and its runnable block, found {len(blocks)} python blocks"
    return blocks[0], blocks[1]


def _run_recipe(code: str) -> str:
    namespace = {"__name__": "__readme__"}
    exec(compile(code, "docs/megatron.md", "exec"), namespace)
    return type(namespace["chunk"]).__name__


def test_readme_megatron_lm_recipe_runs_as_written():
    line, runnable = _readme_recipe()
    assert "use_in_megatron()" in line and "use_in_megatron()" in runnable
    assert run_distributed(_run_recipe, 2, runnable) == ["FullyShardedDataParallelV1"] * 2


def _wrap_without_use_megatron_fsdp() -> list[str]:
    import warnings

    from shardwise.megatron import build_process_groups

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        FullyShardedDataParallel(TransformerConfig(), DistributedDataParallelConfig(use_megatron_fsdp=False),
                                 GPT(GPTConfig(vocab_size=VOCAB, dim=16, n_layers=1, n_heads=2, max_seq_len=16)),
                                 device=device(), pg_collection=build_process_groups())
    return [str(w.message) for w in seen if "use_megatron_fsdp" in str(w.message)]


def test_use_megatron_fsdp_false_is_said():
    # Megatron's optimizer and finalize_model_grads take their DDP paths unless it is True
    (messages,) = run_distributed(_wrap_without_use_megatron_fsdp, 1)
    assert len(messages) == 1 and "use_megatron_fsdp=False" in messages[0], messages
