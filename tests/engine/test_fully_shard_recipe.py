"""``fully_shard`` reads in one screen: its body (docstring excluded) is at most 40 lines,
and the construction steps live in ``shardwise.engine.construct``."""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

MAX_BODY_LINES = 40


def _body_lines(fn) -> int:
    node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]  # the docstring
    return body[-1].end_lineno - body[0].lineno + 1


def test_fully_shard_body_fits_one_screen():
    module = importlib.import_module("shardwise.engine.fully_shard")
    lines = _body_lines(module.fully_shard)
    assert lines <= MAX_BODY_LINES, f"fully_shard's body is {lines} lines (at most {MAX_BODY_LINES})"


def test_fully_shard_has_no_nested_functions():
    module = importlib.import_module("shardwise.engine.fully_shard")
    node = ast.parse(textwrap.dedent(inspect.getsource(module.fully_shard))).body[0]
    nested = [n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n is not node]
    assert not nested, f"fully_shard defines {nested}; construction steps belong in shardwise.engine.construct"
