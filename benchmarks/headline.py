"""README's performance tables, generated from the stored headline runs: every number in them comes from the
one run whose file the table names, and a test fails when README.md and those files disagree.

The runs: docs/benchmarks/gpu.json (`python -m benchmarks.gpu --headline`); the step's,
docs/benchmarks/trl-step/trl-step-M-step4.json (`python -m benchmarks.trl_step --model M --headline`, M = 0.5B,
1.5B, 7B: 4-micro-batch steps, checkpointed, with the peers); docs/benchmarks/fp32-head/gpu.json (`python -m
benchmarks.gpu --shapes H896-fp32,H3584-fp32,H4096-fp32`), docs/benchmarks/verl/verl.json (`python -m
benchmarks.verl_head`) and docs/benchmarks/sft-step/*.json (`python -m benchmarks.sft_step`).

    python -m benchmarks.headline          # rewrites the tables between README.md's markers
    python -m benchmarks.headline --check  # exits 1 when README.md's tables differ from the stored runs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.gpu_methods import HEADLINE

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- performance tables: written by `python -m benchmarks.headline` from docs/benchmarks; edit the runs -->"
END = "<!-- end of the performance tables -->"
STEP_MODELS = ("0.5B", "1.5B", "7B")
FP32_METHODS = {
    "floor: three lm_head GEMMs in float32": "float32 GEMMs alone",
    "TRL 1.16 fused head + loss, float32 GEMMs": "TRL 1.16, float32",
    "TRL 1.16 fused head + loss, TF32": "TRL 1.16, TF32",
    "compiled_grpo auto, compiled": "compiled_grpo auto",
    "compiled_grpo primitive + loss, compiled": "compiled_grpo primitive + loss",
}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def timed(row: dict | None) -> str:
    """`ms (peak GiB)` of a measured row; `-` for a row that did not run (its reason is in the run's own table)."""
    if row is None or "ms" not in row:
        return "-"
    return f"{row['ms']:.1f} ({row['peak_gib']:.2f})" if row.get("peak_gib") is not None else f"{row['ms']:.1f}"


def about(*runs: dict) -> str:
    """The runs' versions (one set: runs of other versions are refused in one table), dates and notes."""
    shared = [{k: v for k, v in run["versions"].items() if k != "repeats"} for run in runs]
    if any(v != shared[0] for v in shared):
        raise ValueError(f"one table's runs ran under different versions: {shared}")
    text = "; ".join(f"{k} {v}" for k, v in shared[0].items())
    dates = sorted({run["date"] for run in runs if "date" in run})
    if dates:
        text += f"; run {' to '.join(dict.fromkeys((dates[0], dates[-1])))}"
    return text + "".join(f"; {note}" for note in dict.fromkeys(run["note"] for run in runs if "note" in run))


def grid(rows: list[dict], names: dict, corner: str) -> list[str]:
    """A table with one line per method (`names`: method -> label, in order) and one column per shape."""
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    lines = [f"| {corner} | " + " | ".join(shapes) + " |", "|---|" + "---|" * len(shapes)]
    for method, label in names.items():
        mine = {r["shape"]: r for r in rows if r["method"] == method}
        if any("ms" in r for r in mine.values()):
            lines.append(f"| {label} | " + " | ".join(timed(mine.get(s)) for s in shapes) + " |")
    return lines


def grid_table(root: Path, run_file: str, title: str, names: dict | None, corner: str, link: str) -> list[str]:
    """One stored run as a grid (methods in `names`, or every method of the run, by shape) under its caption."""
    run = load(root / run_file)
    names = names or {m: m for m in dict.fromkeys(r["method"] for r in run["rows"])}
    page = run_file.removesuffix(".json") + ".md"
    caption = f"{title}; {about(run)}; [{link}]({page})):"
    return [caption, "", *grid(run["rows"], names, corner)]


def head_table(root: Path) -> list[str]:
    title = "**The fused head and the loss** (forward + backward, ms (peak GiB); bf16, dapo"
    return grid_table(root, "docs/benchmarks/gpu.json", title, {m: m for m in HEADLINE}, "method",
                      "every row and the reasons for `-`")  # fmt: skip


def fp32_table(root: Path) -> list[str]:
    title = ("**The fp32 head** (`cast_lm_head_to_fp32`: a float32 lm_head against bf16 hidden states, 8192 tokens; "
             "ms (peak GiB)")  # fmt: skip
    return grid_table(root, "docs/benchmarks/fp32-head/gpu.json", title, FP32_METHODS, "method", "the run")


def verl_table(root: Path) -> list[str]:
    title = ("**verl's fused head** (`use_fused_kernels`; 16 sequences of 1024 tokens, a third prompt, half the "
             "groups at advantage 0, and a dense batch; ms (peak GiB)")  # fmt: skip
    return grid_table(root, "docs/benchmarks/verl/verl.json", title, None, "head", "the run")


def speedup_cell(mine: dict, name: str, base: str) -> str:
    """`ms (peak GiB)` of `name`'s row, with its speed-up over `base`'s row of the same shape."""
    row, against = mine.get(name), mine.get(base, {})
    text = timed(row)
    if name != base and text != "-" and "ms" in against:
        text += f", {against['ms'] / row['ms']:.2f}x"
    return text


def speedup_table(caption: str, rows: list[dict], trainers: dict) -> list[str]:
    """`caption`, then a row per shape of `rows`: each of `trainers` (method: label) with its time, peak memory and
    speed-up over GRPOTrainer."""
    lines = [caption, "", "| model, batch | " + " | ".join(trainers.values()) + " |", "|---|" + "---|" * len(trainers)]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = {r["method"]: r for r in rows if r["shape"] == shape}
        lines.append(f"| {shape} | " + " | ".join(speedup_cell(mine, t, "grpo") for t in trainers) + " |")
    return lines


def checkpointing(rows: list[dict]) -> str:
    """Whether the rows' steps ran with gradient checkpointing, which `trainer.train()` turns on by GRPOConfig's
    default (rows from before the benchmark recorded it ran without)."""
    on = {bool(r.get("gradient_checkpointing")) for r in rows}
    if on == {True}:
        return "gradient checkpointing on, as `trainer.train()` runs"
    if on == {False}:
        return "**gradient checkpointing off** (`trainer.train()` turns it on: these runs predate that measurement)"
    return "gradient checkpointing on except in the rows marked `no checkpointing`"


# the headline step run (`trl_step --headline`: 4-micro-batch steps, checkpointed, four batches, the peers)
TRAIN_STEP_TRAINERS = {"grpo": "GRPOTrainer", "grpo-compiled-layers": "GRPOTrainer on compiled layers",
                       "grpo-liger": "GRPOTrainer with Liger's kernels", "auto": "CompiledGRPOTrainer (defaults)",
                       "skip-all": "skip_zero_advantage='all'"}  # fmt: skip


def train_step_table(root: Path) -> list[str]:
    """The step as `trainer.train()` runs it, every batch of the headline runs (docs/benchmarks/trl-step/
    trl-step-<M>-step4.json for every model): one row per model and batch."""
    runs = [load(root / f"docs/benchmarks/trl-step/trl-step-{m}-step4.json") for m in STEP_MODELS]
    rows = [r for run in runs for r in run["rows"]]
    caption = (
        "**The training step, generation excluded** (a whole optimizer step of `trainer.train()` after its completions "
        "are generated: TRL's `_prepare_inputs`, 4 micro-batches "
        "of 8 completions after 64-token prompts, their losses and backwards, AdamW; Qwen2.5 shapes, random bf16 "
        "weights; `dense`: 1024-token completions, `both`: q 0.2 with half the groups at advantage 0, `tail`: "
        "long-tailed lengths with one at the maximum, `tail-half0`: both at once; "
        f"{checkpointing(rows)}; ms (peak GiB), speed-up over GRPOTrainer; {about(*runs)}; rerun: `python -m "
        "benchmarks.trl_step --model M --headline`; [the table](docs/benchmarks/trl-step/trl-step.md)):"
    )
    present = {t: label for t, label in TRAIN_STEP_TRAINERS.items() if any(r["method"] == t for r in rows)}
    return speedup_table(caption, rows, present)


def sft_table(root: Path) -> list[str]:
    runs = [load(p) for m in STEP_MODELS if (p := root / f"docs/benchmarks/sft-step/sft-step-{m}.json").exists()]
    rows = [r for run in runs for r in run["rows"]]
    caption = (
        "**TRL's SFT step** on TRL's fused head and on `compiled_fused_head()` (the model included; ms (peak GiB), "
        f"speed-up over TRL's head; {about(*runs)}; "
        "[the table](docs/benchmarks/sft-step/sft-step.md)):"
    )
    lines = [caption, "", "| model, batch | TRL's fused head | compiled_fused_head() |", "|---|---|---|"]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = {r["method"]: r for r in rows if r["shape"] == shape}
        lines.append(f"| {shape} | {timed(mine.get('trl'))} | {speedup_cell(mine, 'compiled', 'trl')} |")
    return lines


def render(root: Path = ROOT) -> str:
    tables = [
        head_table(root),
        train_step_table(root),
        fp32_table(root),
        verl_table(root),
        sft_table(root),
    ]
    return "\n".join([BEGIN, "", *(line for t in tables for line in (*t, "")), END])


def with_tables(readme: str, tables: str) -> str:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no '{BEGIN}' ... '{END}' block")
    return readme[:start] + tables + readme[end + len(END) :]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare, write nothing; exit 1 on a difference")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    args = ap.parse_args(argv)
    readme = args.readme.read_text()
    wanted = with_tables(readme, render())
    if args.check:
        if wanted != readme:
            print(f"{args.readme}'s performance tables differ from the stored runs: run python -m benchmarks.headline")
            return 1
        return 0
    args.readme.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
