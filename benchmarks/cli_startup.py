"""How long the `parley` command takes to answer --help and --version (issue: 7.5-9 s each,
when torch, diffusers and transformers loaded before argparse ran; target: under 1 s).

    python benchmarks/cli_startup.py              # 5 runs of each, the median and the slowest
    python benchmarks/cli_startup.py --runs 1

Each run is a fresh interpreter (`python -m parley.realtime.cli ...`, what the `parley` script
runs), timed from spawn to exit, so the figure is what a person waits for. The last column
says which of torch / diffusers / transformers the command imported (should be none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

COMMANDS = (("--help",), ("--version",), ("serve", "--help"), ("offline", "--help"), ("tts", "--help"),
            ("transcribe", "--help"), ("launch", "--help"))
HEAVY = ("torch", "diffusers", "transformers")
# The CLI's own entry point, then which heavy modules it imported (on stderr, after its output).
PROBE = ("import json, sys\nfrom parley.realtime.cli import main\n"
         "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
         f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)")


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


if __name__ == "__main__":
    main()
