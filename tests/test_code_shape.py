"""The product code's shape, read with ast: no function over MAX_FUNCTION_LINES lines in the checked
packages, and the classes the engine reads through kept under their limits. Their comments say why,
never what a benchmark measured on some GPU (figures go stale; they belong in docs/benchmarks.md).

Lines count from the `def` (or `class`) line to the last line of the body, docstring and comments
included, decorators not. Exempt: Triton kernel bodies, functions decorated with `triton.jit` (with
or without arguments), whose one body is one GPU program and reads best whole.
The folders are a list so that another package joins the rule by its name.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("engine", "models")  # packages held to the function rule (folders of the repository)
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = {("engine/engine.py", "Engine"): 300, ("engine/backend.py", "ModelBackend"): 300}

# What marks a measured figure: a GPU's name or a bandwidth.
MEASURED = re.compile(r"\b(?:[ABH]100|H200|B200|L40S?)\b|\b[0-9.]+ ?[GT]i?B/s\b")
Function = ast.FunctionDef | ast.AsyncFunctionDef


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def is_triton_kernel(fn: Function) -> bool:
    """Decorated `@triton.jit` or `@triton.jit(...)`."""
    for decorator in fn.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if isinstance(target, ast.Attribute) and target.attr == "jit" and \
                isinstance(target.value, ast.Name) and target.value.id == "triton":
            return True
    return False


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """`name:line (n lines)` for every function of `source`, nested ones and methods included, longer
    than `limit` and not a Triton kernel."""
    return [f"{node.name}:{node.lineno} ({lines(node)} lines)" for node in ast.walk(ast.parse(source))
            if isinstance(node, Function) and lines(node) > limit and not is_triton_kernel(node)]


def product_files() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_no_function_is_longer_than_the_limit() -> None:
    found = {str(p.relative_to(ROOT)): long for p in product_files() if (long := long_functions(p.read_text()))}
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them): {found}"


@pytest.mark.parametrize(("path", "name"), sorted(MAX_CLASS_LINES), ids=lambda v: v)
def test_the_engine_classes_stay_short(path: str, name: str) -> None:
    tree = ast.parse((ROOT / path).read_text())
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name]
    assert classes, f"{path} no longer defines {name}: update MAX_CLASS_LINES"
    limit = MAX_CLASS_LINES[path, name]
    assert lines(classes[0]) <= limit, f"{name} is {lines(classes[0])} lines, over its {limit}"


def test_the_rule_counts_what_it_says() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES - 1))
    fits = f"def fits():\n{body}"  # the def line and 59 more: exactly the limit
    over = f"class A:\n    def over(self):\n        y = 0\n{body.replace('    ', '        ')}"
    kernel = f"import triton\n\n@triton.jit\ndef kernel(x):\n    y = 0\n{body}"
    called = f"import triton\n\n@triton.jit(debug=True)\ndef kernel(x):\n    y = 0\n{body}"
    other = f"import numba\n\n@numba.jit\ndef not_triton(x):\n    y = 0\n{body}"
    assert long_functions(fits) == []
    assert long_functions(over) == [f"over:2 ({MAX_FUNCTION_LINES + 1} lines)"]
    assert long_functions(kernel) == long_functions(called) == []
    assert long_functions(other) == [f"not_triton:4 ({MAX_FUNCTION_LINES + 1} lines)"]


def test_no_measured_figures_in_comments() -> None:
    files = product_files() + sorted((ROOT / "realtime").rglob("*.py"))  # the edge too (its functions: not yet)
    found = [f"{p.relative_to(ROOT)}:{i}" for p in files
             for i, line in enumerate(p.read_text().splitlines(), 1) if MEASURED.search(line)]
    assert not found, f"measured figures in product code (say why; figures go in docs/benchmarks.md): {found}"
    assert MEASURED.search("4.5 TB/s at full windows") and MEASURED.search("on an H200 host")
