"""The benchmark picture: per shape, grouped horizontal bars of time and of peak memory, one bar per method,
the floor drawn as a line and each time bar labelled with its ratio to the floor.

Rows are the benchmarks' JSON rows ({"shape", "method", "ms", "peak_gib", ...}; rows without "ms" did not run).
Redraw a stored run:

    python -m benchmarks.plots docs/benchmarks/gpu.json [--out docs/benchmarks/gpu.png] [--title "..."]
"""

from __future__ import annotations

import argparse
import json
import textwrap
from pathlib import Path

FLOOR = "floor"  # the method whose name starts with this is the floor of its shape


def draw(rows: list[dict], path: Path, title: str) -> Path:
    """Write the picture of `rows` to `path` (PNG): one row of panels per shape that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if "ms" in r]
    shapes = list(dict.fromkeys(r["shape"] for r in ran))
    if not shapes:
        raise ValueError("no row has a time: nothing to draw")
    methods = list(dict.fromkeys(r["method"] for r in ran))
    has_memory = any(r.get("peak_gib") is not None for r in ran)
    height = sum(0.32 * sum(r["shape"] == s for r in ran) + 0.9 for s in shapes)
    fig, axes = plt.subplots(len(shapes), 2 if has_memory else 1, figsize=(13 if has_memory else 9, height + 1.0),
                             squeeze=False, gridspec_kw={"height_ratios": [sum(r["shape"] == s for r in ran) + 1
                                                                          for s in shapes]})  # fmt: skip
    colors = {m: plt.cm.tab20(i % 20) for i, m in enumerate(methods)}
    for row_axes, shape in zip(axes, shapes, strict=True):
        mine = [r for r in ran if r["shape"] == shape]
        _panel(row_axes[0], mine, "ms", colors, f"{shape}: forward + backward (ms)", ratio_labels=True)
        if has_memory:
            _panel(row_axes[1], mine, "peak_gib", colors, f"{shape}: peak memory above inputs (GiB)")
            row_axes[1].set_yticklabels([])
    fig.suptitle(textwrap.fill(title, 150 if has_memory else 100), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _panel(ax, rows: list[dict], key: str, colors: dict, title: str, ratio_labels: bool = False) -> None:
    values = [r.get(key) or 0.0 for r in rows]
    labels = [r["method"] for r in rows]
    y = list(range(len(rows)))[::-1]  # first method on top
    ax.barh(y, values, color=[colors[m] for m in labels], height=0.7)
    ax.set_yticks(y, labels, fontsize=7)
    ax.set_title(title, fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    floor = next((r.get(key) for r in rows if r["method"].startswith(FLOOR)), None)
    if floor:
        ax.axvline(floor, color="k", ls="--", lw=0.8)
    top = max(values, default=1.0)
    ax.set_xlim(0, top * 1.22)
    for yi, v in zip(y, values, strict=True):
        text = f"{v:.1f}" if key == "ms" else f"{v:.2f}"
        if ratio_labels and floor:
            text += f"  ({v / floor:.2f}x)"
        ax.text(v + top * 0.01, yi, text, va="center", fontsize=6.5)


def run_title(prefix: str, rows: list[dict]) -> str:
    """`prefix`, then the shapes that ran (never a shape that did not)."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows if "ms" in r))
    return f"{prefix}: {', '.join(shapes)} (dashed line: the floor; ratios against it)"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", type=Path, help="a benchmark's JSON ({'versions': ..., 'rows': [...]})")
    ap.add_argument("--out", type=Path, default=None, help="the PNG (default: beside the JSON, same stem)")
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    data = json.loads(args.json.read_text())
    versions = data.get("versions", {})
    where = versions.get("gpu") or versions.get("cpu") or "benchmark"
    title = args.title or run_title(f"{where}, torch {versions.get('torch', '?')}", data["rows"])
    print(draw(data["rows"], args.out or args.json.with_suffix(".png"), title))


if __name__ == "__main__":
    main()
