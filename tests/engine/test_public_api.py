"""``shardwise``'s top-level names: the small user set, each documented, README's all there."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import shardwise

USER_NAMES = {
    "fully_shard", "ShardedModule", "MixedPrecisionPolicy", "OffloadPolicy", "AxisPlacements", "Collectives",
    "MetaInitializer", "build_dp_mesh", "build_expert_mesh", "clip_grad_norm_", "BackwardOptimizer",
    "check_optimizer_params", "compile_units", "capture_step", "CapturedStep", "convert_to_fp8", "full_state_dict",
    "destroy_process_groups", "StallWatchdog",
}
README = Path(shardwise.__file__).parent.parent / "README.md"


def test_exports_are_the_user_set():
    assert set(shardwise.__all__) == USER_NAMES
    assert len(shardwise.__all__) == len(USER_NAMES)  # no name listed twice
    public = {n for n, v in vars(shardwise).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert public == USER_NAMES, public ^ USER_NAMES  # nothing importable from shardwise beyond __all__ but modules


def test_every_export_has_its_own_docstring():
    missing = [n for n in shardwise.__all__ if not (inspect.getdoc(getattr(shardwise, n)) or "").strip()
               or (inspect.isclass(getattr(shardwise, n)) and "__doc__" not in vars(getattr(shardwise, n)))]
    assert not missing, missing


def test_sharded_module_methods_are_documented():
    undocumented = [n for n, v in vars(shardwise.ShardedModule).items()
                    if not n.startswith("_") and not (inspect.getdoc(v) or "").strip()]
    assert not undocumented, undocumented


def test_every_name_the_readme_uses_is_exported():
    used = set(re.findall(r"\bshardwise\.([A-Za-z_]\w*)", README.read_text()))
    modules = {n for n in used if importlib.util.find_spec(f"shardwise.{n}") is not None}  # shardwise.models, ...
    offered = USER_NAMES | set(shardwise._APP_ENTRY_POINTS)  # shardwise.plan: the app's, loaded on first use
    assert used - modules <= offered, (used - modules) - offered
    assert all(callable(getattr(shardwise, n)) for n in shardwise._APP_ENTRY_POINTS)
