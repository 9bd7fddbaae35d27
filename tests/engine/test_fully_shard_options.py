"""``fully_shard``'s option list is written once, in ``FullyShardOptions``: the signature must name the same
options with the same defaults, and the call must copy every argument it was given into them."""

from __future__ import annotations

import dataclasses
import inspect

import torch.nn as nn

import shardwise
from shardwise.engine import fully_shard as fully_shard_module
from shardwise.engine.fully_shard_options import TRANSLATED_ARGUMENTS, FullyShardOptions


def test_the_signature_names_the_dataclass_fields_with_their_defaults():
    signature = inspect.signature(shardwise.fully_shard).parameters
    arguments = [name for name in signature if name != "module"]
    fields = {f.name: f for f in dataclasses.fields(FullyShardOptions)}
    assert sorted(set(arguments) - set(TRANSLATED_ARGUMENTS)) == sorted(fields)
    for name, field in fields.items():
        assert signature[name].default == field.default, name


def test_the_call_stores_each_argument_under_its_field(monkeypatch):
    """A value for every stored option reaches FullyShardOptions unchanged (the ones the call resolves first
    are checked by their own tests): the copy misses none and swaps none."""
    seen = {}

    def stop(module, options):
        seen["options"] = options
        raise RuntimeError("stop after the options are built")

    monkeypatch.setattr(fully_shard_module, "take_spmd_parameters", lambda *a: None)
    monkeypatch.setattr(fully_shard_module, "check_rank_consistency", stop)
    resolved = {"mesh", "placements", "tp_axis", "mixed_precision", "offload_policy", "ignored_params",
                "check_module_states"}
    given = {f.name: object() for f in dataclasses.fields(FullyShardOptions) if f.name not in resolved}
    given["unit_modules"] = None  # check_call reads it before the options are built
    monkeypatch.setattr(fully_shard_module, "resolve_spmd_mesh", lambda modules, mesh, *a: (None, mesh, None, "tp"))
    try:
        shardwise.fully_shard(nn.Linear(2, 2), **given)
    except RuntimeError as error:
        assert "stop after" in str(error)
    options = seen["options"]
    for name, value in given.items():
        assert getattr(options, name) is value, name


def test_the_options_every_rank_must_pass_alike_are_the_marked_fields():
    agreed = FullyShardOptions().must_agree()
    assert list(agreed) == ["mixed_precision", "reshard_after_forward", "prefetch", "gradient_reduction",
                            "bucket_size", "graph_safe", "sync_module_states", "check_module_states"]
