"""Dependencies point one way, realtime -> engine -> models, and the edge uses only the packages'
public names: `realtime/` imports from `parley.engine` and `parley.models` exactly the names in
their `__all__` (never a submodule, never a private name), `engine/` never imports `realtime/`,
and `models/` neither. Read from the source with ast, so a function-local import counts too."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"realtime": "parley.realtime", "engine": "parley.engine", "models": "parley.models"}


def imports(folder: str) -> list[tuple[str, int, str, tuple[str, ...]]]:
    """(file, line, absolute module, names) of every `import` / `from ... import` under `folder`."""
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        package = PACKAGES[folder] + "".join(f".{p}" for p in path.relative_to(ROOT / folder).parent.parts)
        where = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), where)):
            if isinstance(node, ast.Import):
                found += [(where, node.lineno, a.name, ()) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:  # relative: resolved against the file's package
                    base = package.split(".")[:len(package.split(".")) - node.level + 1]
                    module = ".".join([*base, module] if module else base)
                found.append((where, node.lineno, module, tuple(a.name for a in node.names)))
    return found


def below(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("package", ["parley.engine", "parley.models"])
def test_realtime_imports_only_the_public_names_of_engine_and_models(package):
    public = set(importlib.import_module(package).__all__)
    wrong = []
    for where, line, module, names in imports("realtime"):
        if not below(module, package):
            continue
        if module != package:
            wrong.append(f"{where}:{line}: imports {module} (a submodule; use {package}'s names)")
        elif missing := [n for n in names if n not in public]:
            wrong.append(f"{where}:{line}: {', '.join(missing)} not in {package}.__all__")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("folder, above", [("engine", ("parley.realtime",)),
                                           ("models", ("parley.realtime", "parley.engine"))])
def test_lower_layers_never_import_upper_ones(folder, above):
    wrong = [f"{where}:{line}: imports {module}" for where, line, module, _ in imports(folder)
             if any(below(module, pkg) for pkg in above)]
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("package", ["parley.engine", "parley.models"])
def test_every_public_name_resolves(package):
    """A name in `__all__` whose module lost it would fail only when the edge first asks for it."""
    module = importlib.import_module(package)
    assert [n for n in module.__all__ if getattr(module, n, None) is None] == []


def test_the_packages_load_their_names_lazily():
    """`parley --help` reads engine defaults through `parley.engine`: importing the packages, and
    a torch-free name, must not load torch (tests/test_lazy_imports.py times the commands)."""
    code = ("import sys\nfrom parley.engine import SamplingOptions, DEFAULT_STALL_TIMEOUT_S, KvSettings\n"
            "from parley.models import SAMPLE_RATE\nimport parley.realtime.cli\nprint('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stderr


def test_every_package_folder_is_installed():
    """pyproject.toml lists the packages by hand (the folders install under other names): a room
    missing there would work from a checkout and be absent from an installed copy."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {PACKAGES[top] + "".join(f".{p}" for p in init.parent.relative_to(ROOT / top).parts)
               for top in PACKAGES for init in (ROOT / top).rglob("__init__.py")}
    assert folders - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"
