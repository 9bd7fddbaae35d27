"""``use_in_megatron()`` replaces Megatron's class by identity, whatever name a ``megatron.*`` module gave it.

Megatron-LM's ``training.py`` (core_r0.16 .. core_r0.19) binds the class as
``FullyShardedDataParallel as megatron_FSDP``; 0.16's ``get_model`` builds with
that name and both releases check ``isinstance(chunk, megatron_FSDP)`` before
installing the sync functions. Real modules under the ``megatron.`` namespace
(written to a temporary directory, as the installed ``megatron`` is a namespace
package) bind it the same way, one imported before the line and one after.
"""

from __future__ import annotations

import logging
import sys

import pytest

from megatron.core.distributed.fsdp import mcore_fsdp_adapter

from shardwise.megatron import FullyShardedDataParallelV2, use_in_megatron
from shardwise.megatron.install import ShardwiseFSDPType

# training.py's binding (0.16.1 .. 0.19.x) and dist_utils.py's (0.19), and an isinstance check like theirs
ALIAS_SOURCE = '''
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel as megatron_FSDP
from megatron.core.distributed import (
    FullyShardedDataParallel,
)


def recognises(chunk):
    return isinstance(chunk, megatron_FSDP)
'''


@pytest.fixture
def megatron_modules(tmp_path, monkeypatch):
    """``import_module(name)`` for modules ``megatron.<name>`` written from :data:`ALIAS_SOURCE`."""
    import importlib

    (tmp_path / "megatron").mkdir()
    names = ("shardwise_probe_before", "shardwise_probe_after")
    for name in names:
        (tmp_path / "megatron" / f"{name}.py").write_text(ALIAS_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield lambda name: importlib.import_module(f"megatron.{name}")
    for name in names:
        sys.modules.pop(f"megatron.{name}", None)


def test_every_binding_of_megatrons_class_is_replaced_and_restored(megatron_modules, caplog):
    megatrons = mcore_fsdp_adapter.FullyShardedDataParallel
    before = megatron_modules("shardwise_probe_before")
    assert before.megatron_FSDP is megatrons
    with caplog.at_level(logging.INFO, logger="shardwise.megatron.install"):
        names = use_in_megatron()
    try:
        after = megatron_modules("shardwise_probe_after")
        chunk = FullyShardedDataParallelV2.__new__(FullyShardedDataParallelV2)  # a chunk's type, unbuilt
        for module in (before, after):
            assert module.megatron_FSDP is ShardwiseFSDPType and module.FullyShardedDataParallel is ShardwiseFSDPType
            assert module.recognises(chunk)
        assert {"megatron.shardwise_probe_before.megatron_FSDP", "megatron.core.distributed.FullyShardedDataParallel",
                "megatron.core.distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel"} <= set(names.names)
        (said,) = [r.getMessage() for r in caplog.records if "use_in_megatron" in r.getMessage()]
        assert "megatron.shardwise_probe_before.megatron_FSDP" in said and caplog.records[0].levelno == logging.INFO
    finally:
        names.restore()
    for module in (before, after):  # the one imported after the line too
        assert module.megatron_FSDP is megatrons and module.FullyShardedDataParallel is megatrons
        assert not module.recognises(chunk)
    assert mcore_fsdp_adapter.FullyShardedDataParallel is megatrons


def test_a_second_call_replaces_nothing_and_the_first_restores(megatron_modules):
    megatrons = mcore_fsdp_adapter.FullyShardedDataParallel
    with use_in_megatron() as first:
        with use_in_megatron() as second:
            assert second.replaced == [] and first.replaced
            assert megatron_modules("shardwise_probe_before").megatron_FSDP is ShardwiseFSDPType
        assert mcore_fsdp_adapter.FullyShardedDataParallel is ShardwiseFSDPType  # the inner exit restored nothing
    assert megatron_modules("shardwise_probe_before").megatron_FSDP is megatrons
