"""Frame time against batch size, one panel per KV window, from frame_latency.py's JSON.

    pip install -e '.[bench]'
    python benchmarks/plot_frames.py frames_bf16.json [frames_fp8.json ...] --out docs/frames.png

Each input file is one `frame_latency.py --json` run (its KV dtype labels its lines). Lines:
Parley p50 (and p99 as a band), the reference p50, the memory-bandwidth floor, and the 80 ms
real-time budget. Batches that ran out of memory are left out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

WINDOWS = ("empty", "spread", "full")
BUDGET_MS = 80.0


def series(rows: list[dict], window: str) -> dict[str, list[tuple[int, float]]]:
    out: dict[str, list[tuple[int, float]]] = {"p50": [], "p99": [], "floor": [], "reference": []}
    for row in rows:
        par, ref = row.get("parley"), row.get("reference")
        if isinstance(par, dict) and window in par:
            for key in ("p50", "p99", "floor"):
                out[key].append((row["B"], par[window][key]))
        if isinstance(ref, dict):
            out["reference"].append((row["B"], ref["p50"]))
    return out


def plot(runs: list[tuple[str, list[dict]]], out: Path) -> None:
    fig, axes = plt.subplots(1, len(WINDOWS), figsize=(5 * len(WINDOWS), 4.2), sharey=True)
    for ax, window in zip(axes, WINDOWS):
        reference_drawn = False
        for label, rows in runs:
            s = series(rows, window)
            if s["p50"]:
                bs, p50 = zip(*s["p50"])
                line, = ax.plot(bs, p50, marker="o", label=f"Parley p50, p99 band ({label})")
                ax.fill_between(bs, p50, [v for _, v in s["p99"]], color=line.get_color(), alpha=0.15)
                ax.plot(*zip(*s["floor"]), linestyle=":", color=line.get_color(), label=f"bandwidth floor ({label})")
            if s["reference"] and not reference_drawn:
                ax.plot(*zip(*s["reference"]), marker="s", color="black", label="reference moshi 0.2.13 p50")
                reference_drawn = True
        ax.axhline(BUDGET_MS, color="red", linewidth=1, label="80 ms budget")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{window} window")
        ax.set_xlabel("live sessions B")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("frame time (ms)")
    axes[-1].legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help="frame_latency.py --json files")
    parser.add_argument("--out", type=Path, default=Path("frames.png"))
    args = parser.parse_args()
    runs = []
    for path in args.inputs:
        data = json.loads(path.read_text())
        runs.append((data["meta"]["kv_dtype"] + " KV", data["rows"]))
    plot(runs, args.out)


if __name__ == "__main__":
    main()
