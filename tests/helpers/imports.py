"""Every import of ``shardwise`` code, read from the source with ``ast``: what the layering tests check.

An ``Import`` is one imported module and the names taken from it, resolved to absolute module names
(relative imports included; ``from pkg import submodule`` counts as an import of the submodule), with
whether it runs when the module loads (``lazy``: inside a function, run when that is called).
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

from . import REPO

PACKAGE = REPO / "shardwise"


@dataclass(frozen=True)
class Import:
    path: Path  # the importing file
    line: int
    importer: str  # its module name, ``shardwise.megatron.base``
    target: str  # the imported module, ``shardwise.engine.model_ops``
    names: tuple[str, ...]  # the names taken from it (empty for ``import x``)
    lazy: bool  # inside a function body

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def module_name(path: Path) -> str:
    parts = path.resolve().relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(module: str) -> bool:
    return (REPO / module.replace(".", "/") / "__init__.py").is_file()


@functools.lru_cache(maxsize=None)
def _is_module(module: str) -> bool:
    base = REPO / module.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def source_files(*roots: Path) -> list[Path]:
    return sorted(p for root in roots for p in root.rglob("*.py"))


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def enclosing_functions(tree: ast.AST) -> dict[int, ast.AST | None]:
    """``{id(node): the innermost function around it, or None}`` for every node, in one walk."""
    around: dict[int, ast.AST | None] = {id(tree): None}
    stack = [tree]
    while stack:
        node = stack.pop()
        inner = node if isinstance(node, FUNCTIONS) else around[id(node)]
        for child in ast.iter_child_nodes(node):
            around[id(child)] = inner
            stack.append(child)
    return around


@functools.lru_cache(maxsize=None)
def imports_of(path: Path, prefix: str = "shardwise") -> tuple[Import, ...]:
    """The imports in ``path`` of modules named ``prefix`` or under it (read once per session)."""
    importer = module_name(path)
    package = importer if path.name == "__init__.py" else importer.rpartition(".")[0]
    return tuple(imports_in(ast.parse(path.read_text(), str(path)), path, importer, package, prefix))


def imports_in(tree: ast.AST, path: Path, importer: str, package: str, prefix: str = "shardwise") -> list[Import]:
    """The imports in a parsed module ``importer`` (in ``package``) of modules named ``prefix`` or under it."""
    around = enclosing_functions(tree)
    found = []

    def add(node, target, names):
        if target == prefix or target.startswith(prefix + "."):
            found.append(Import(path, node.lineno, importer, target, tuple(names), around[id(node)] is not None))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, alias.name, ())
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            plain = [a.name for a in node.names if not _is_module(f"{target}.{a.name}")]
            for alias in node.names:
                if _is_module(f"{target}.{alias.name}"):  # ``from . import submodule``
                    add(node, f"{target}.{alias.name}", ())
            if plain or not node.names:
                add(node, target, plain)
    return found


def all_imports(*roots: Path, prefix: str = "shardwise") -> list[Import]:
    return [imp for path in source_files(*roots) for imp in imports_of(path, prefix)]
