"""V1's expert classes for fine-grained hooks: a Megatron without a module or class is skipped, any other
error while importing Megatron-Core surfaces (it used to be swallowed with the rest)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest

from shardwise.megatron import FullyShardedDataParallelV1

OVERLAP = SimpleNamespace(overlap_moe_expert_parallel_comm=True)
ZERO3 = SimpleNamespace(data_parallel_sharding_strategy="optim_grads_params")
EXPERTS_MODULE = "megatron.core.transformer.moe.experts"


def _types():
    return FullyShardedDataParallelV1._fine_grained_recurse_module_types(OVERLAP, ZERO3)


def _importing(monkeypatch, error):
    real = importlib.import_module

    def fake(name, *args, **kwargs):
        if name == EXPERTS_MODULE:
            raise error
        return real(name, *args, **kwargs)

    monkeypatch.setattr(importlib, "import_module", fake)


def test_real_megatron_core_classes_are_found():
    from megatron.core.transformer.moe.experts import TEGroupedMLP
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP

    assert {TEGroupedMLP, SharedExpertMLP} <= set(_types())


def test_a_megatron_without_the_module_is_skipped(monkeypatch):
    _importing(monkeypatch, ModuleNotFoundError(f"No module named {EXPERTS_MODULE!r}", name=EXPERTS_MODULE))
    names = {t.__name__ for t in _types()}
    assert "TEGroupedMLP" not in names and "SharedExpertMLP" in names


def test_any_other_import_error_surfaces(monkeypatch):
    _importing(monkeypatch, RuntimeError("broken Megatron install"))
    with pytest.raises(RuntimeError, match="broken Megatron install"):
        _types()


def test_a_missing_dependency_of_megatron_surfaces(monkeypatch):
    _importing(monkeypatch, ModuleNotFoundError("No module named 'einops'", name="einops"))
    with pytest.raises(ModuleNotFoundError, match="einops"):
        _types()
