"""Parley's runtime dependencies as one compressed folder, for a GPU host with no package index.

A stock CUDA PyTorch image already holds torch, numpy, transformers, huggingface_hub and a few more;
what it lacks (PyAV, sphn, aiortc, uvicorn, the benchmark clients' httpx2, ...) is downloaded here as
wheels for the host's Python and platform, unpacked into one folder and packed as a .tar.xz (about
two thirds the size of the wheels, so it travels where they would not fit).

    python benchmarks/offline_site.py --out site.tar.xz                     # for a Python 3.12 x86-64 host
    # on the host, from a checkout (the benchmarks import the installed package's three folders):
    mkdir -p /tmp/site && tar xJf site.tar.xz -C /tmp/site
    mkdir -p /tmp/shim/parley && for d in models engine realtime; do ln -sfn $PWD/$d /tmp/shim/parley/$d; done
    export PYTHONPATH=/tmp/site:/tmp/shim:$PWD/benchmarks

Every name pyproject.toml pins is taken at its pin, unless `--have` names it (the host's own copy is
used); the names pyproject.toml leaves to the resolver (what aiortc, soundfile, uvicorn[standard] and
the clients need) are pinned in `UNPINNED` below, at the versions this was last run with.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
# What a CUDA PyTorch image holds already (its transformers wants huggingface_hub < 2: keep the host's)
HAVE = ("torch", "numpy", "transformers", "huggingface_hub", "sentencepiece", "tqdm", "pillow")
# What the pinned dependencies pull in and the image lacks, at the versions the test suite resolves
UNPINNED = ("aioice==0.13.0", "pyee==13.0.1", "pylibsrtp==1.0.0", "pyopenssl==26.4.0", "cryptography==50.0.2",
            "google-crc32c==1.9.0", "dnspython==2.9.2", "ifaddr==0.2.0", "cffi==2.1.1", "pycparser==3.12",
            "importlib-metadata==10.2.0", "lazy-importer==0.1.0", "httptools==0.9.0", "websockets==16.1.1",
            "watchfiles==1.3.0", "httpcore2==2.17.0", "truststore==0.10.5", "sniffio==1.3.1",
            "pydantic==2.14.4", "pydantic-core==2.50.5", "jiter==0.19.0", "annotated-types==0.8.0",
            "typing-inspection==0.4.5")
# From the `bench` extra, at its pin: what the benchmarks need on the GPU host (mixed_load.py --gpu-busy)
FROM_BENCH = ("nvidia-ml-py",)
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
             "manylinux1_x86_64")


def requirements(pyproject: Path, have: set[str], python: str) -> list[str]:
    """`name==version` for every pinned runtime dependency of `pyproject` that applies on `python`
    (markers evaluated) and is not in `have`, and the `bench` extra's `FROM_BENCH`, then `UNPINNED`;
    a dependency left unpinned is refused."""
    project = tomllib.loads(pyproject.read_text())["project"]
    bench = project.get("optional-dependencies", {}).get("bench", [])
    declared = project["dependencies"] + [line for line in bench
                                          if canonicalize_name(Requirement(line).name) in FROM_BENCH]
    have = {canonicalize_name(n) for n in have}
    wanted = []
    for line in declared:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        if name in have or (req.marker is not None and not req.marker.evaluate({"python_version": python})):
            continue
        pins = [s.version for s in req.specifier if s.operator == "=="]
        if not pins:
            raise SystemExit(f"offline_site.py: {line!r} is not pinned in {pyproject}: name it in --have")
        wanted.append(f"{name}=={pins[0]}")
    return wanted + list(UNPINNED)


def download(wanted: list[str], into: Path, python: str) -> list[Path]:
    """The wheels of `wanted` for `python` on x86-64 Linux, no dependency resolution (all are named)."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--implementation", "cp", *platforms, "--dest", str(into),
                    *wanted], check=True)
    return sorted(into.glob("*.whl"))


def pack(wheels: list[Path], out: Path) -> int:
    """Unpack `wheels` into one site folder and write it to `out` (.tar.xz); returns the files packed."""
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp)
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(site)
        files = [p for p in site.rglob("*") if p.is_file()]
        with tarfile.open(out, "w:xz") as tar:
            for path in sorted(site.iterdir()):
                tar.add(path, arcname=path.name)
    return len(files)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="the .tar.xz to write")
    p.add_argument("--python", default="3.12", help="the host's Python, X.Y (default %(default)s)")
    p.add_argument("--have", default=",".join(HAVE),
                   help="comma-separated names the host holds already (default %(default)s)")
    args = p.parse_args(argv)
    if not args.out.name.endswith(".tar.xz"):
        p.error(f"--out {args.out}: the archive is written as .tar.xz; name it so")
    have = {n.strip() for n in args.have.split(",") if n.strip()}
    wanted = requirements(ROOT / "pyproject.toml", have, args.python)
    with tempfile.TemporaryDirectory() as tmp:
        wheels = download(wanted, Path(tmp), args.python)
        size = sum(w.stat().st_size for w in wheels)
        files = pack(wheels, args.out)
    print(f"{len(wheels)} wheels ({size / 1e6:.1f} MB) -> {args.out} ({args.out.stat().st_size / 1e6:.1f} MB, "
          f"{files} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
