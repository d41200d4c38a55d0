#!/usr/bin/env python3
"""Draws BENCHMARKS.md's plots from the numbers in bench/results.json (one grouped bar chart per
figure) into docs/img/<id>.png, where BENCHMARKS.md and the documentation site show them.

    python bench/plot_results.py                  # all figures
    python bench/plot_results.py --out DIR engine  # one figure, elsewhere

Needs matplotlib (a benchmark-only dependency: pip install matplotlib). It draws what the file
holds and measures nothing: after a benchmark run, put its figures into BENCHMARKS.md and
results.json, then run this.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results.json"
OUT = ROOT / "docs" / "img"


def draw(figure: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: list[str] = figure["groups"]
    series: dict[str, list[float | None]] = figure["series"]
    for name, values in series.items():
        if len(values) != len(groups):
            raise ValueError(f"{figure['id']}: {name!r} has {len(values)} values for "
                             f"{len(groups)} groups")
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(7.0, 1.2 * len(groups) * max(1, len(series) / 2)), 3.8),
                           dpi=100)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        pairs = [(x, v) for x, v in zip(xs, values) if v is not None]
        bars = ax.bar([x for x, _ in pairs], [v for _, v in pairs], width * 0.95, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    if "line" in figure:
        ax.axhline(figure["line"]["at"], color="black", linewidth=0.8, linestyle="--",
                   label=figure["line"]["label"])
    ax.set_xticks(range(len(groups)), [textwrap.fill(g, 16) for g in groups], fontsize=8)
    ax.set_ylabel(figure["unit"], fontsize=8)
    ax.set_title(figure["title"], fontsize=9)
    ax.tick_params(axis="y", labelsize=8)
    ax.spines[["top", "right"]].set_visible(False)
    ax.legend(fontsize=7, frameon=False, ncol=2 if len(series) > 4 else 1)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{figure['id']}.png"
    # No timestamps in the file, so that redrawing the same numbers changes nothing.
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ids", nargs="*", help="figures to draw (default: all)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    figures = json.loads(args.results.read_text())["figures"]
    known = {f["id"] for f in figures}
    unknown = sorted(set(args.ids) - known)
    if unknown:
        parser.error(f"no figure {', '.join(unknown)} in {args.results} (known: "
                     f"{', '.join(sorted(known))})")
    for figure in figures:
        if not args.ids or figure["id"] in args.ids:
            print(draw(figure, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
