"""Record Megatron-Core's config fields (name, annotation, default) from its source, per release.

shardwise.megatron.config mirrors Megatron-Core's ``TransformerConfig`` (with its
``ModelParallelConfig`` base) and ``DistributedDataParallelConfig``. The tests
hold the mirror to every supported release: the installed one through its real
objects, the others through this record, read from each release's own source
(its wheel unpacked; no import, so a release built for another Python works):

    pip download --no-deps megatron-core==0.19.2 --python-version 3.12 --only-binary=:all: -d w
    unzip -q w/*.whl -d mc19
    python scripts/megatron_core_fields.py mc19 0.19.2 tests/helpers/data/megatron_core_fields.json

The output file keeps the releases already in it and replaces this one.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

SOURCES = {
    "ModelParallelConfig": "megatron/core/model_parallel_config.py",
    "TransformerConfig": "megatron/core/transformer/transformer_config.py",
    "DistributedDataParallelConfig": "megatron/core/distributed/distributed_data_parallel_config.py",
}


def _default_source(value: ast.expr | None) -> str | None:
    """The default's source text; for ``field(default=X, ...)`` that of ``X`` (``default_factory``: ``<factory>``)."""
    if value is None:
        return None
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
        for kw in value.keywords:
            if kw.arg == "default":
                return ast.unparse(kw.value)
            if kw.arg == "default_factory":
                return "<factory>"
        return None
    return ast.unparse(value)


def class_fields(root: Path, cls: str) -> dict[str, list]:
    tree = ast.parse((root / SOURCES[cls]).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {
                st.target.id: [ast.unparse(st.annotation), _default_source(st.value)]
                for st in node.body
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
            }
    raise SystemExit(f"{cls} not found in {root / SOURCES[cls]}")


def record(root: Path) -> dict:
    model_parallel = class_fields(root, "ModelParallelConfig")
    return {
        # TransformerConfig inherits ModelParallelConfig's fields (its own win where both declare one)
        "TransformerConfig": {**model_parallel, **class_fields(root, "TransformerConfig")},
        "DistributedDataParallelConfig": class_fields(root, "DistributedDataParallelConfig"),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    root, version, out = Path(argv[0]), argv[1], Path(argv[2])
    data = json.loads(out.read_text()) if out.exists() else {}
    data[version] = record(root)
    out.write_text(json.dumps(dict(sorted(data.items())), indent=1, sort_keys=True) + "\n")
    print(f"{out}: {version} ({', '.join(f'{k} {len(v)} fields' for k, v in data[version].items())})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
