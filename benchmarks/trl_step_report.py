"""`benchmarks.trl_step --report`: the stored rows joined into a table (`trl-step.md`) and pictures."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import plots
from benchmarks.trl_step_batches import LONG_NOTE, TAIL_NOTE
from benchmarks.trl_step_rows import BOUND, LABELS, TRAINERS


def one_bound_per_shape(rows: list[dict]) -> list[dict]:
    """The rows with each shape's first bound row alone: a run of one trainer per process measures the bound in each
    file, and the table and the picture show one (the first file's)."""
    seen = set()
    kept = []
    for row in rows:
        if row["method"] == BOUND:
            if row["shape"] in seen:
                continue
            seen.add(row["shape"])
        kept.append(row)
    return kept


def report(args) -> None:
    rows, versions, repeats = [], {}, {}
    for name in args.report:
        data = json.loads(Path(name).read_text())
        rows += data["rows"]
        versions = data["versions"]
        repeats.update(dict.fromkeys((r["model"] for r in data["rows"]), versions.get("repeats", "?")))
    rows = one_bound_per_shape(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    present = [name for name in TRAINERS if any(r["method"] == name for r in rows)]
    lines = [
        "# The TRL step: GRPOTrainer against CompiledGRPOTrainer",
        "",
        f"{versions.get('gpu')}; torch {versions.get('torch')}, transformers {versions.get('transformers')}, TRL "
        f"{versions.get('trl')}. {checkpointing_note(rows)} Random bf16 weights of each model's shape; completions "
        "of 1024 tokens after 64-token prompts (`varied`: four micro-batches taking turns, their longest completions "
        "1024, 819, 614 and 921 tokens), dapo; `_compute_loss` (the model's forward included) + backward, "
        f"median of {', '.join(f'{n} ({m})' for m, n in repeats.items())} steps after every micro-batch ran twice; "
        "peak memory above the model and inputs; a captured row's footprint adds what it holds between steps (its "
        "static buffers, the pool's live tensors) and the pool's free part (older runs: the pool's size and what "
        "the row held). The bound: the backbone's forward and backward, eager and padded as GRPOTrainer runs it, "
        "with a trivial loss on its final hidden states (no lm_head): the floor of any head on that backbone, which "
        "compiled layers and packing go below (`below the bound`). `gain reached`: the share of the possible gain "
        "over GRPOTrainer (its time minus the bound's) that a row above the bound achieves. A `step/N` row times "
        "a whole optimizer step over a generation batch of N micro-batches (`--generation N`: TRL's "
        "`_prepare_inputs`, each micro-batch's loss and backward, fused AdamW); its bound is the backbone on every "
        "micro-batch plus the same optimizer step. `GPU busy`: the device time of one more step under the profiler "
        "(each kernel, copy and set once): a row's own floor, which its wall clock meets where the host keeps up."
        + (TAIL_NOTE if any(r["batch"].startswith("tail") for r in rows) else "")
        + (LONG_NOTE if any(r["batch"] == "longprompt" for r in rows) else ""),
        "",
        "| model, batch, sequences | bound | " + " | ".join(LABELS[name] for name in present) + " |",
        "|---|---|" + "---|" * len(present),
    ]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = {r["method"]: r for r in rows if r["shape"] == shape}
        cells = [cell(mine, name) for name in (BOUND, *present)]
        lines.append(f"| {shape} | {' | '.join(cells)} |")
    lines += ["", "![step time and peak memory](trl-step.png)", ""]
    (out / "trl-step.md").write_text("\n".join(lines))
    named = [{**r, "method": LABELS.get(r["method"], r["method"])} for r in rows]
    title = f"TRL step, {versions.get('gpu')}: _compute_loss + backward (dashed line: the backbone alone)"
    plots.draw(named, out / "trl-step.png", title)
    if any(r.get("real_tokens") and r.get("micro_batches") for r in rows):
        lines += ["![step time against real tokens per step](trl-step-tokens.png)", ""]
        (out / "trl-step.md").write_text("\n".join(lines))
        draw_against_tokens([r for r in rows if r.get("micro_batches")], out / "trl-step-tokens.png", versions)
    print("\n".join(lines))


def checkpointing_note(rows: list[dict]) -> str:
    """How the rows ran gradient checkpointing (rows from before it was recorded ran without it)."""
    on = {r.get("gradient_checkpointing", False) for r in rows}
    if on == {True}:
        return "Gradient checkpointing on in every row, as `trainer.train()` runs GRPOConfig's default."
    if on == {False}:
        return "Gradient checkpointing OFF in every row (`trainer.train()` turns it on by GRPOConfig's default)."
    return "Gradient checkpointing on (as `trainer.train()` runs) except in the rows that say `no checkpointing`."


def draw_against_tokens(rows: list[dict], path: Path, versions: dict) -> None:
    """Optimizer-step time against the real (prompt and completion) tokens per step, one panel per model: a colour
    per method (the same in every panel), a marker per batch kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    models = list(dict.fromkeys(r["model"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    kinds = list(dict.fromkeys(r["batch"] for r in rows))
    colours = {m: plt.cm.tab10(i % 10) for i, m in enumerate(methods)}
    markers = dict(zip(kinds, "o^sDvP*X", strict=False))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        for r in rows:
            if r["model"] == model and "ms" in r:
                ax.scatter(r["real_tokens"] / 1e3, r["ms"], color=colours[r["method"]], marker=markers[r["batch"]])
        ax.set(title=model, xlabel="real tokens per optimizer step (thousands)", ylabel="ms per optimizer step")
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colours[m], marker="o", ls="", label=LABELS.get(m, m)) for m in methods]
    handles += [Line2D([], [], color="grey", marker=markers[k], ls="", label=k) for k in kinds]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=7)
    fig.suptitle(f"Optimizer step against real tokens, {versions.get('gpu')}")
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cell(mine: dict, name: str) -> str:
    """One table cell: time and peak memory, and for this library's trainers the speed-up over GRPOTrainer and
    the share of the possible gain (GRPOTrainer's time minus the bound's) it reaches."""
    r, grpo, bound = mine.get(name), mine.get("grpo", {}), mine.get(BOUND, {})
    if r is None or "ms" not in r:
        return "-" if r is None else r.get("status", "-")
    memory = "" if r.get("peak_gib") is None else f", {r['peak_gib']:.2f} GiB"
    if r.get("capture_stopped"):
        memory += " (capture stopped: its pool outgrew the budget)"
    elif r.get("pool_free_gib") is not None and r.get("replays"):
        memory += f" (footprint {r['footprint_gib']:.2f})"
    elif r.get("pool_gib"):  # runs before the footprint was measured: the pool, and what the row held
        memory += f" + {r['pool_gib']:.2f} pool, {r.get('held_gib', 0):.2f} held"
    busy = f" (GPU busy {r['busy_ms']:.1f})" if r.get("busy_ms") else ""
    text = f"{r['ms']:.1f} ms{busy}{memory}"
    if name != "grpo" and name in TRAINERS and "ms" in grpo:
        text += f" ({grpo['ms'] / r['ms']:.2f}x"
        # the share of the possible gain, where the bound leaves one (an eager, padded, host-bound backbone may not)
        if "ms" in bound and r["ms"] < bound["ms"]:
            text += "; below the bound"
        elif "ms" in bound and grpo["ms"] - bound["ms"] > 0.05 * grpo["ms"]:
            text += f"; gain reached {(grpo['ms'] - r['ms']) / (grpo['ms'] - bound['ms']):+.0%}"
        text += ")"
    return text
