"""The audit's report: a table in the terminal, and a Markdown report with PNG plots."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .results import CellResult


def _fmt(x: float) -> str:
    return "nan" if x != x else f"{x:.1e}"


def print_table(results: list[CellResult], console: Console) -> None:
    table = Table(title="compiled-grpo numerics audit", show_lines=False)
    for col in ("group", "cell", "result", "worst check", "error", "tolerance"):
        table.add_column(col, no_wrap=col != "worst check")
    for r in results:
        w = r.worst
        verdict = "[green]pass[/]" if r.passed else "[bold red]FAIL[/]"
        table.add_row(r.group, r.name, verdict, w.what, _fmt(w.error), _fmt(w.tolerance))
    console.print(table)


def summary(results: list[CellResult]) -> str:
    by_group = defaultdict(lambda: [0, 0])
    for r in results:
        by_group[r.group][0] += r.passed
        by_group[r.group][1] += 1
    parts = [f"{g}: {p}/{n} pass" for g, (p, n) in by_group.items()]
    failed = sum(not r.passed for r in results)
    verdict = "PASS" if failed == 0 else f"FAIL ({failed} cell{'s' * (failed != 1)})"
    return f"{verdict}. " + "; ".join(parts)


def write_markdown(results: list[CellResult], out: Path, header: list[str], plots: list[str]) -> Path:
    lines = ["# compiled-grpo numerics audit", "", *header, "", f"**{summary(results)}**", ""]
    failing = [r for r in results if not r.passed]
    if failing:
        lines += ["## Failing cells", ""]
        for r in failing:
            bad = "; ".join(f"{c.what} {_fmt(c.error)} > {_fmt(c.tolerance)}" for c in r.checks if not c.passed)
            lines.append(f"- {r.group} `{r.name.strip()}`: {bad}")
        lines.append("")
    notes = [(r, n) for r in results for n in r.notes]
    if notes:
        lines += ["## Notes", ""] + [f"- `{r.name.strip()}`: {n}" for r, n in notes] + [""]
    for p in plots:
        lines += [f"![{p}]({p})", ""]
    lines += [
        "## Every cell",
        "",
        "| group | cell | result | worst check | error | tolerance |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        w = r.worst
        lines.append(
            f"| {r.group} | `{r.name.strip()}` | {'pass' if r.passed else '**FAIL**'} | {w.what} | "
            f"{_fmt(w.error)} | {_fmt(w.tolerance)} |"
        )
    path = out / REPORT
    path.write_text("\n".join(lines) + "\n")
    return path


PLOTS = ("loss_error_heatmap.png", "entropy_error_vs_vocab.png", "bf16_error_distribution.png")
REPORT = "audit.md"


def clean_folder(out: Path) -> Path:
    """`out`, created if needed, without a previous run's report and plots (other files are left alone), so a
    report never sits beside plots of another run."""
    out.mkdir(parents=True, exist_ok=True)
    for name in (REPORT, *PLOTS):
        (out / name).unlink(missing_ok=True)
    return out


def write_plots(results: list[CellResult], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    loss = [r for r in results if r.group == "loss"]
    if loss:
        written.append(_heatmaps(plt, loss, out))
    entropy = [r for r in results if r.group == "entropy"]
    if entropy:
        written.append(_entropy_vs_vocab(plt, entropy, out))
    bf16 = [r for r in loss if r.params.get("dtype") == "bfloat16"]
    if bf16:
        written.append(_bf16_distribution(plt, bf16, out))
    return written


def _save(plt, fig, out: Path, name: str) -> str:
    fig.tight_layout()
    fig.savefig(out / name, dpi=110)
    plt.close(fig)
    return name


def _heatmaps(plt, loss: list[CellResult], out: Path) -> str:
    dtypes = sorted({r.params["dtype"] for r in loss})
    types = list(dict.fromkeys(r.params["loss_type"] for r in loss))
    qs = sorted({r.params["q"] for r in loss}, reverse=True)
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4.8), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        grid = [[-math.inf] * len(qs) for _ in types]
        for r in loss:
            if r.params["dtype"] != dtype:
                continue
            worst = max((c.error for c in r.checks if c.what in ("loss", "d hidden", "d weight", "d bias")), default=0)
            i, j = types.index(r.params["loss_type"]), qs.index(r.params["q"])
            grid[i][j] = max(grid[i][j], math.log10(max(worst, 1e-16)))
        im = ax.imshow(grid, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(qs)), [f"q={q}" for q in qs])
        ax.set_yticks(range(len(types)), types)
        for i in range(len(types)):
            for j in range(len(qs)):
                ax.text(j, i, f"{grid[i][j]:.1f}", ha="center", va="center", color="w", fontsize=8)
        ax.set_title(f"{dtype}: log10 worst relative error\n(loss and gradients, all levels, modes, schedules)")
        fig.colorbar(im, ax=ax)
    return _save(plt, fig, out, PLOTS[0])


def _entropy_vs_vocab(plt, entropy: list[CellResult], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for case in dict.fromkeys(r.params["case"] for r in entropy):
        pts = sorted(
            (r.params["V"], max(r.params["entropy_error"], 1e-12)) for r in entropy if r.params["case"] == case
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=case)
    tol = next(c.tolerance for c in entropy[0].checks if c.what == "entropy")
    ax.axhline(tol, color="r", ls="--", label="tolerance")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("vocabulary size")
    ax.set_ylabel("|entropy - scipy| (nats, floor 1e-12)")
    ax.set_title("Streaming entropy error against scipy (float64)")
    ax.legend(fontsize=7)
    return _save(plt, fig, out, PLOTS[1])


def _bf16_distribution(plt, bf16: list[CellResult], out: Path) -> str:
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for what in ("d hidden", "d weight", "d bias"):
        errs = [c.error for r in bf16 for c in r.checks if c.what == what]
        bounds = [c.tolerance for r in bf16 for c in r.checks if c.what == what]
        ax.hist([math.log10(max(e, 1e-16)) for e in errs], bins=30, alpha=0.6, label=f"{what}, fused")
        if what == "d weight":
            ax.hist([math.log10(max(b, 1e-16)) for b in bounds], bins=30, histtype="step", color="k",
                    label="bound per cell: min(naive bf16 error + slack, ceiling)")  # fmt: skip
    ax.set_xlabel("log10 relative error against float64 (per cell)")
    ax.set_ylabel("cells")
    ax.set_title("bf16 gradient errors across cells")
    ax.legend(fontsize=7)
    return _save(plt, fig, out, PLOTS[2])
