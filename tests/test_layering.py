"""The import rules of docs/design.md ("Layers"), read from the source with ``ast``.

- imports point down the layers, and no module imports itself back through others (no import circle);
- the faces (``megatron/``, ``checkpoint/``, ``hf/``, ``app/``, and the stand-alone ``benchmarks/``) reach the
  engine through its surface only: :data:`SURFACE_MODULES` below; nothing they import or read is an engine
  private (what counts as one: :func:`door_violations`);
- no underscore name is imported across a package boundary; ``megatron/`` does not import ``models/``.

The door scan and the circle check also run on bad cases written here, so a scan that stopped seeing what it
looks for fails.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import shardwise
from shardwise.engine import model_ops

from tests.helpers import REPO
from tests.helpers.imports import (PACKAGE, Import, all_imports, enclosing_functions, imports_in, imports_of, is_package,
                                   source_files)

ENGINE = "shardwise.engine"

# docs/design.md's layers; a module imports only from its own layer or lower ones (an import under
# ``if TYPE_CHECKING:`` counts: the module depends on what it names).
ENGINE_LAYERS = {
    1: "placements layout mesh spmd_mesh tp_submesh resolution precision offload replaced_params teardown launch_hint "
       "registry graph_safe device owner_layout",
    2: "collectives nccl_buffers process_group_alloc backward_steps fully_shard_options rank_consistency watchdog",
    3: "sharded_param distributed_buffer quantized_gather gather_extensions grad_presence unsynced_grads grad_window "
       "param_group param_adoption post_forward_shard unit weight_origin shard_placement owner_state",
    4: "step_checks fully_shard arguments construct step_controller sharded_module torch_fsdp_state model_ops compile "
       "cuda_graphs",
    5: "fp8 optim pipeline state_dict materialize rng",
}
PACKAGE_LAYERS = {"shardwise": 5, "shardwise.engine": 5, "shardwise.models": 6, "shardwise.checkpoint": 7,
                  "shardwise.hf": 7, "shardwise.megatron": 7, "shardwise.app": 8, "shardwise.__main__": 8}
LAYERS = {f"{ENGINE}.{m}": n for n, names in ENGINE_LAYERS.items() for m in names.split()}
# The one upward import allowed: the top-level package's ``__getattr__`` loads the app's entry points on first use.
APP_ENTRY_POINTS = {("shardwise", "shardwise.app.plan")}

# The engine's surface for the faces: the names in these modules' ``__all__``. ``model_ops`` is the door
# for per-model operations; the others are helpers that hold tables, rules and tools, not a model's state.
SURFACE_MODULES = {
    "model_ops": "the per-model operations (the one door to a wrapped model's state)",
    "placements": "the strategy table",
    "layout": "row arithmetic: torch.chunk's pieces",
    "mesh": "meshes, ShardingPlan, the default plan_fn",
    "device": "the device rule",
    "registry": "module roles",
    "materialize": "meta-device materialization",
    "rng": "the RNG tracker and RNG state dicts",
    "precision": "MixedPrecisionPolicy",
    "fp8": "convert_to_fp8 and its recipes",
    "optim": "clipping and the global gradient norm",
    "pipeline": "pipeline stages and schedules",
    "state_dict": "full state dicts",
    "teardown": "destroy_process_groups",
    "rank_consistency": "raise_together: every rank raises when one does",
    "nccl_buffers": "NcclUserBuffers: a Collectives whose buffers come from NCCL's registered pool",
    "owner_layout": "Owned(): matrices whole on one owner rank (Muon), the owners' balance",
}
# Attributes of the engine's state objects (StepController, its units, parameter groups): a face neither reads nor
# writes them, whatever the object; model_ops answers for them.
STATE_ATTRS = {"sharded_state", "groups", "all_units", "units", "sharded_params", "unsharded_params", "grad_attr",
               "grad_aliases"}
FACES = [PACKAGE / "megatron", PACKAGE / "checkpoint", PACKAGE / "hf", PACKAGE / "app", REPO / "benchmarks"]


def _public(module: str) -> set[str]:
    return set(getattr(importlib.import_module(module), "__all__", ()))


@functools.lru_cache(maxsize=None)
def _surface() -> dict[str, set[str]]:
    """``{module: names a face may import from it}``."""
    top = set(shardwise.__all__)
    names = {f"{ENGINE}.{m}": _public(f"{ENGINE}.{m}") for m in SURFACE_MODULES}
    names[ENGINE] = set()  # the package itself: its modules are imported by name
    names["shardwise"] = top
    for name in top:  # a public name may come from its own module too
        names.setdefault(getattr(shardwise, name).__module__, set()).add(name)
    return names


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _is_state_call(node: ast.AST) -> bool:
    """``sharded_state(model)`` or ``model_ops.sharded_state(model)``: the engine's state object."""
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == "sharded_state")
        or (isinstance(node.func, ast.Attribute) and node.func.attr == "sharded_state"))


def _state_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Attribute reads of engine state: a name in :data:`STATE_ATTRS`, or any attribute of a value that
    ``sharded_state(...)`` returned (directly, or through a name bound to it in the same function)."""
    around = enclosing_functions(tree)
    nodes = list(ast.walk(tree))
    bound = {(id(around[id(n)]), t.id) for n in nodes if isinstance(n, ast.Assign) and _is_state_call(n.value)
             for t in n.targets if isinstance(t, ast.Name)}
    found = []
    for node in nodes:
        if not isinstance(node, ast.Attribute):
            continue
        if node.attr in STATE_ATTRS and not _dotted(node).endswith("model_ops.sharded_state"):
            found.append((node.lineno, f".{node.attr}"))
        if _is_state_call(node.value) or (isinstance(node.value, ast.Name)
                                          and (id(around[id(node)]), node.value.id) in bound):
            found.append((node.lineno, f"sharded_state(...).{node.attr}"))
    return sorted(set(found))


def door_violations(path: Path, source: str | None = None) -> list[str]:
    """What one face file reads from the engine beyond its surface. A private read is:

    1. ``from shardwise.engine.<m> import name`` where ``name`` is not in :func:`_surface` (so any name of a
       module outside :data:`SURFACE_MODULES`: ``param_group.ParamGroup``, anything of ``sharded_state``,
       ``construct``, ``unit``, ...; any name outside a surface module's ``__all__``; any underscore name);
    2. ``import shardwise.engine.<m>`` or an attribute chain ``shardwise.engine.<m>.x`` of a module outside it;
    3. reading or writing an attribute named in :data:`STATE_ATTRS` (``.groups``, ``.grad_attr``, ...);
    4. reading any attribute of what ``model_ops.sharded_state(model)`` returned: the state is opaque to a face.
    """
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    surface = _surface()
    where = path.relative_to(REPO) if path.is_absolute() else path
    found = []
    imports = imports_of(path) if source is None else imports_in(tree, path, "face", "")
    for imp in imports:
        if not (imp.target == ENGINE or imp.target.startswith(ENGINE + ".") or imp.target == "shardwise"):
            continue
        allowed = surface.get(imp.target)
        if allowed is None:
            found.append(f"{where}:{imp.line}: imports {imp.target} {list(imp.names)}")
        elif bad := [n for n in imp.names if n not in allowed]:
            found.append(f"{where}:{imp.line}: imports {bad} from {imp.target}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Del):
            dotted = _dotted(node)
            if dotted.startswith(ENGINE + ".") and dotted.count(".") == 3:
                module = dotted.rpartition(".")[0]
                if module not in surface or (node.attr not in surface[module] and not is_package(dotted)):
                    found.append(f"{where}:{node.lineno}: reads {dotted}")
    found += [f"{where}:{line}: reads {what}" for line, what in _state_reads(tree)]
    return found


def _layer(module: str) -> int:
    if module in LAYERS:
        return LAYERS[module]
    for package in sorted(PACKAGE_LAYERS, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return PACKAGE_LAYERS[package]
    raise KeyError(module)


def _graph(imports: list[Import]) -> dict[str, set[str]]:
    """Module -> modules it imports, with the packages a target's import runs (their ``__init__``)."""
    graph = defaultdict(set)
    for imp in imports:
        own = set(_ancestors(imp.importer))
        graph[imp.importer] |= {a for a in _ancestors(imp.target) if a not in own}
    return graph


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for start in list(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


# ------------------------------------------------------------------------------------------ the scanner
def test_scan_sees_relative_lazy_and_submodule_imports():
    found = {(imp.importer, imp.target, imp.lazy) for imp in all_imports(PACKAGE)}
    assert ("shardwise.megatron.v1", "shardwise.megatron.base", False) in found
    assert ("shardwise.checkpoint.full", "shardwise.engine.model_ops", False) in found
    assert ("shardwise.checkpoint.rng_state", "shardwise.engine.rng", True) in found  # inside a function


# ------------------------------------------------------------------------------------------ layers, circles
def test_every_engine_module_has_a_layer():
    modules = {p.stem for p in (PACKAGE / "engine").glob("*.py") if p.stem != "__init__"}
    named = {m.rpartition(".")[2] for m in LAYERS}
    assert modules == named, f"no layer: {sorted(modules - named)}; gone: {sorted(named - modules)}"


def _design_md_layers() -> dict[int, set[str]]:
    """The engine modules (```name.py```) each of docs/design.md's numbered layers 1 to 5 names."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text[text.index("## Layers (imports point down)"):]
    section = section[:section.index("\n## ", 1)]
    modules = {p.stem for p in (PACKAGE / "engine").glob("*.py")}
    items = re.split(r"\n(\d)\. ", section)
    return {int(n): set(re.findall(r"`(\w+)\.py`", body)) & modules for n, body in zip(items[1::2], items[2::2])
            if int(n) in ENGINE_LAYERS}


def test_design_md_has_this_layer_table():
    table = {n: set(names.split()) for n, names in ENGINE_LAYERS.items()}
    assert _design_md_layers() == table


def _is_app_entry_point(imp: Import) -> bool:
    return imp.lazy and (imp.importer, imp.target) in APP_ENTRY_POINTS


def test_imports_point_down_the_layers():
    upward = [f"{imp.where()}: {imp.importer} (layer {_layer(imp.importer)}) imports {imp.target} "
              f"(layer {_layer(imp.target)})" for imp in all_imports(PACKAGE)
              if _layer(imp.target) > _layer(imp.importer) and not _is_app_entry_point(imp)]
    assert not upward, "\n".join(upward)


def test_the_app_entry_points_load_on_first_use():
    found = {(imp.importer, imp.target) for imp in all_imports(PACKAGE) if _is_app_entry_point(imp)}
    assert found == APP_ENTRY_POINTS  # each one is there, inside a function
    run = subprocess.run([sys.executable, "-c", "import sys, shardwise; print('shardwise.app' in sys.modules); "
                          "from shardwise.app.plan import plan; print(shardwise.plan is plan)"],
                         capture_output=True, text=True, cwd=REPO, check=True)
    assert run.stdout.split() == ["False", "True"], run.stdout + run.stderr


def test_no_import_circle():
    imports = [imp for imp in all_imports(PACKAGE) if not _is_app_entry_point(imp)]
    assert not _cycles(_graph([i for i in imports if not i.lazy]))  # what loading a module runs
    assert not _cycles(_graph(imports))  # with the imports inside functions too


def test_the_circle_and_layer_checks_see_a_bad_case():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _layer("shardwise.engine.param_group") < _layer("shardwise.megatron.v1") < _layer("shardwise.app.cli")


# ------------------------------------------------------------------------------------------ the faces' door
def test_faces_reach_the_engine_through_its_surface():
    found = [line for path in source_files(*[f for f in FACES if f.exists()]) for line in door_violations(path)]
    assert not found, "\n".join(found)


def test_the_door_scan_sees_each_kind_of_private_read(tmp_path):
    bad = """
from shardwise.engine.param_group import ParamGroup
from shardwise.engine.fully_shard import _STATE_ATTR
from shardwise.engine.mesh import ShardingPlan, _chunk_rows
from shardwise.engine.model_ops import sharded_state, refresh_model_weights
import shardwise.engine.unit
from shardwise import fully_shard, engine

def f(model):
    for group in sharded_state(model).groups:
        group.grad_attr = "decoupled_grad"
    state = sharded_state(model)
    plan = state.plan
    return shardwise.engine.construct.Ownership, model.sharded_state
"""
    found = "\n".join(door_violations(Path("face.py"), bad))
    for expected in ["face.py:2: imports shardwise.engine.param_group ['ParamGroup']",
                     "face.py:3: imports ['_STATE_ATTR'] from shardwise.engine.fully_shard",
                     "face.py:4: imports ['_chunk_rows'] from shardwise.engine.mesh",
                     "face.py:6: imports shardwise.engine.unit []",
                     "face.py:10: reads .groups", "face.py:10: reads sharded_state(...).groups",
                     "face.py:11: reads .grad_attr", "face.py:13: reads sharded_state(...).plan",
                     "face.py:14: reads shardwise.engine.construct.Ownership", "face.py:14: reads .sharded_state"]:
        assert expected in found, (expected, found)
    assert "face.py:5" not in found and "face.py:7" not in found  # the surface itself is fine


def test_the_surface_is_documented():
    design = (REPO / "docs" / "design.md").read_text()
    undocumented = [n for n in model_ops.__all__ if f"`{n}`" not in design]
    assert not undocumented, f"model_ops names docs/design.md does not mention: {undocumented}"
    assert all((PACKAGE / "engine" / f"{m}.py").exists() for m in SURFACE_MODULES)
    assert all(getattr(importlib.import_module(f"{ENGINE}.{m}"), "__all__", None) for m in SURFACE_MODULES)


# ------------------------------------------------------------------------------------------ package rules
def _package_of(module: str) -> str:
    return module if is_package(module) else module.rpartition(".")[0]


def test_no_underscore_name_crosses_a_package_boundary():
    crossing = [f"{imp.where()}: from {imp.target} import {', '.join(imp.names)}"
                for imp in all_imports(PACKAGE)
                if _package_of(imp.target) != _package_of(imp.importer)
                and (any(n.startswith("_") for n in imp.names)
                     or any(p.startswith("_") and p not in ("__init__", "__main__") for p in imp.target.split(".")))]
    assert not crossing, "\n".join(crossing)


def test_megatron_does_not_import_models():
    found = [f"{imp.where()}: {imp.target}" for imp in all_imports(PACKAGE / "megatron")
             if imp.target == "shardwise.models" or imp.target.startswith("shardwise.models.")]
    assert not found, found
