"""benchmarks/offline_site.py: which wheels it asks for, and the folder it packs (no download here)."""

from __future__ import annotations

import importlib
import tarfile
import zipfile

import pytest

from test_benchmarks_smoke import BENCH, ROOT


@pytest.fixture
def offline_site(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    return importlib.import_module("offline_site")


def test_every_pin_but_the_hosts_own_is_asked_for_at_its_pin(offline_site):
    wanted = offline_site.requirements(ROOT / "pyproject.toml", {"torch", "numpy", "Pillow"}, "3.12")
    assert "av==18.1.0" in wanted and "sphn==0.2.1" in wanted and "aiortc==1.16.0" in wanted
    assert "nvidia-ml-py==13.615.71" in wanted and not any(w.startswith("matplotlib") for w in wanted)  # bench: NVML only
    names = [w.split("==")[0] for w in wanted]
    assert not {"torch", "numpy", "pillow", "tomli"} & set(names)  # the host's, and tomli only before 3.11
    assert len(names) == len(set(names)) and all("==" in w for w in wanted)
    default = offline_site.requirements(ROOT / "pyproject.toml", set(offline_site.HAVE), "3.12")
    hosts = [w.split("==")[0] for w in default]
    assert "huggingface-hub" not in hosts and "diffusers" in hosts  # names compare as pip compares them
    assert "tomli==2.5.0" in offline_site.requirements(ROOT / "pyproject.toml", {"torch", "numpy"}, "3.10")


def test_an_unpinned_dependency_is_refused_by_name(offline_site, tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\ndependencies = ["av==18.1.0", "starlette>=1"]\n')
    with pytest.raises(SystemExit, match="starlette>=1"):
        offline_site.requirements(pyproject, set(), "3.12")
    assert offline_site.requirements(pyproject, {"starlette"}, "3.12")[0] == "av==18.1.0"


def test_the_wheels_are_unpacked_into_one_folder(offline_site, tmp_path):
    wheels = []
    for name in ("alpha", "beta"):
        wheel = tmp_path / f"{name}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{name}/__init__.py", f"NAME = {name!r}\n")
            archive.writestr(f"{name}-1.0.dist-info/METADATA", f"Name: {name}\n")
        wheels.append(wheel)
    out = tmp_path / "site.tar.xz"
    assert offline_site.pack(wheels, out) == 4
    with tarfile.open(out) as tar:
        assert sorted(tar.getnames()) == ["alpha", "alpha-1.0.dist-info", "alpha-1.0.dist-info/METADATA",
                                          "alpha/__init__.py", "beta", "beta-1.0.dist-info",
                                          "beta-1.0.dist-info/METADATA", "beta/__init__.py"]
        assert tar.extractfile("beta/__init__.py").read() == b"NAME = 'beta'\n"
