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


# The edge's rooms (realtime/ROOM/): server/ builds the engine and its pools and hands the doors the
# engine client (realtime/engine_client.py); every other room reaches the engine through that module only.
ENGINE_BUILDERS = ("realtime/server/", "realtime/cli.py", "realtime/engine_client.py")


def room_of(where: str) -> str | None:
    """`realtime/chat/protocol.py` -> "chat"; a top-level module (cli.py, engine_client.py) -> None."""
    parts = where.split("/")
    return parts[1] if len(parts) > 2 else None


def engine_bypasses(found) -> list[str]:
    """Imports of parley.engine from a file that is neither the engine client nor a builder of the engine."""
    return [f"{where}:{line}: imports {module}; go through realtime/engine_client.py"
            for where, line, module, _ in found
            if below(module, "parley.engine") and not where.startswith(ENGINE_BUILDERS)]


def private_crossings(found) -> list[str]:
    """Imports of another room's private names (a leading underscore: a module or a name)."""
    wrong = []
    for where, line, module, names in found:
        if not below(module, "parley.realtime"):
            continue
        parts = module.split(".")[2:]  # parley.realtime.ROOM.module...
        if not parts or parts[0] == room_of(where):
            continue
        private = [p for p in parts if p.startswith("_") and p != "__init__"] + [n for n in names if n.startswith("_")]
        if private:
            wrong.append(f"{where}:{line}: imports {', '.join(private)} from {module} (another room's internals)")
    return wrong


def test_doors_reach_the_engine_only_through_the_engine_client():
    assert not (wrong := engine_bypasses(imports("realtime"))), "\n".join(wrong)


def test_no_room_imports_another_rooms_private_names():
    assert not (wrong := private_crossings(imports("realtime"))), "\n".join(wrong)


def test_the_room_checks_catch_what_they_forbid():
    """The two checks above, on imports made up to break them (so neither passes by finding nothing)."""
    found = [("realtime/chat/protocol.py", 3, "parley.engine", ("Engine",)),
             ("realtime/server/services.py", 4, "parley.engine", ("Engine",)),  # server/ builds the engine
             ("realtime/engine_client.py", 5, "parley.engine", ("FrameOut",)),
             ("realtime/live/session.py", 6, "parley.realtime.calls.frame_output", ("_pace",)),
             ("realtime/live/session.py", 7, "parley.realtime.calls._secret", ("thing",)),
             ("realtime/live/session.py", 8, "parley.realtime.live.config", ("_own_room",)),  # its own room: fine
             ("realtime/live/session.py", 9, "parley.realtime.calls.frame_output", ("FrameSender",))]
    assert [w.split(":")[1] for w in engine_bypasses(found)] == ["3"]
    assert [w.split(":")[1] for w in private_crossings(found)] == ["6", "7"]


DOORS = ("chat", "realtime_api", "live", "calls", "webrtc", "http", "kyutai")
REACHES = {"engine": "the engine (use the engine client)", "manager": "the session manager (use the edge's parts)"}


def reaches_in(where: str, source: str) -> list[str]:
    """Attribute reads in a door's room that reach through a connection to what lies behind its
    parts (`edge.manager.metrics`, `manager.engine`): a door talks to the parts it composes."""
    if room_of(where) not in DOORS:
        return []
    return [f"{where}:{node.lineno}: .{node.attr} reaches {REACHES[node.attr]}"
            for node in ast.walk(ast.parse(source, where)) if isinstance(node, ast.Attribute) and node.attr in REACHES]


def test_doors_never_reach_through_their_parts():
    wrong = [w for path in sorted((ROOT / "realtime").rglob("*.py"))
             for w in reaches_in(str(path.relative_to(ROOT)), path.read_text())]
    assert not wrong, "\n".join(wrong)
    made_up = "edge.manager.metrics.refused.inc()\nclient.engine.counters()\nedge.counters.refused()\n"
    assert sorted(w.split(":")[1] for w in reaches_in("realtime/chat/protocol.py", made_up)) == ["1", "2"]
    assert reaches_in("realtime/server/app.py", made_up) == []  # server/ builds and holds the engine
