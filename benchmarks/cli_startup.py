"""How long the `parley` command takes to answer --help and --version (issue: 7.5-9 s each,
when torch, diffusers and transformers loaded before argparse ran; target: under 1 s).

    python benchmarks/cli_startup.py              # 5 runs of each, the median and the slowest
    python benchmarks/cli_startup.py --runs 1     # then the server's start (second table)

Each run is a fresh interpreter (`python -m parley.realtime.cli ...`, what the `parley` script
runs), timed from spawn to exit, so the figure is what a person waits for. The last column
says which of torch / diffusers / transformers the command imported (should be none).

A second table times what `parley serve` does before it serves, each run a fresh interpreter:
importing the server module, and building a CPU server's app (a tiny PersonaPlex with a paired
tiny STT, written to a temporary folder first; no image model, whose diffusers brings its own).
Its last column says which of the modules loaded only where used were imported: Triton (and
torch._dynamo, which imports it), aiortc, pyloudnorm (scipy.signal) (should be none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = (("--help",), ("--version",), ("serve", "--help"), ("offline", "--help"), ("tts", "--help"),
            ("transcribe", "--help"), ("launch", "--help"))
HEAVY = ("torch", "diffusers", "transformers")
# The CLI's own entry point, then which heavy modules it imported (on stderr, after its output).
PROBE = ("import json, sys\nfrom parley.realtime.cli import main\n"
         "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)")


LAZY = ("triton", "torch._dynamo", "aiortc", "pyloudnorm", "scipy.signal")
SERVER_BUILD = ("from parley.realtime.server.serve import ServeConfig, build_app\n"
                "build_app(ServeConfig(model=sys.argv[1], stt_model=sys.argv[2], device='cpu', max_sessions=1))")


def time_code(code: str, *argv: str) -> tuple[float, list[str]]:
    """Seconds a fresh interpreter takes to run `code`, and which of LAZY it imported."""
    probe = f"import json, sys\n{code}\nprint(json.dumps([m for m in {LAZY!r} if m in sys.modules]))"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", probe, *argv], check=True, capture_output=True, text=True)
    return time.perf_counter() - started, json.loads(done.stdout.splitlines()[-1])


def server_start(runs: int) -> None:
    from parley.models.synthetic import write_tiny_checkpoint, write_tiny_stt_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = write_tiny_checkpoint(Path(tmp) / "personaplex", kind="personaplex")
        stt = Path(tmp) / "stt"
        write_tiny_stt_checkpoint(stt, mimi_from=model)
        print("\n| server start | median (s) | slowest (s) | loaded only where used, imported |")
        print("|---|---|---|---|")
        for what, code in (("import parley.realtime.server.serve", "import parley.realtime.server.serve"),
                           ("import it, build a CPU server's app", SERVER_BUILD)):
            timed = [time_code(code, str(model), str(stt)) for _ in range(runs)]
            seconds = [t for t, _ in timed]
            imported = ", ".join(timed[-1][1]) or "none"
            print(f"| {what} | {statistics.median(seconds):.2f} | {max(seconds):.2f} | {imported} |")


def time_command(argv: tuple[str, ...]) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "parley.realtime.cli", *argv], check=True, capture_output=True)
    return time.perf_counter() - started


def heavy_imports(argv: tuple[str, ...]) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], check=True, capture_output=True, text=True)
    return json.loads(done.stderr.splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs of each command")
    args = ap.parse_args()
    if args.runs < 1:
        ap.error("--runs must be at least 1")
    print(f"{args.runs} run(s) of each command, each a fresh interpreter")
    print("| command | median (s) | slowest (s) | heavy imports |")
    print("|---|---|---|---|")
    for argv in COMMANDS:
        seconds = [time_command(argv) for _ in range(args.runs)]
        heavy = ", ".join(heavy_imports(argv)) or "none"
        print(f"| parley {' '.join(argv)} | {statistics.median(seconds):.2f} | {max(seconds):.2f} | {heavy} |")
    server_start(args.runs)


if __name__ == "__main__":
    main()
