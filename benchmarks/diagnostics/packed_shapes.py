"""How many shapes a `train()` run's packed micro-batches take on fixed capacities, and what they pad: the number of
graphs a graphed stack (`compile_backbone="stack-graphs"`) records, step by step, against the padding its
capacities add, for `CAPACITIES_PER_OCTAVE` choices. No model runs: the library's own packing (`packing.pack` on
fixed shapes) is applied to micro-batches of `benchmarks.train`'s workloads, drawn on the host.

A step holds 4 prompts x 8 completions in micro-batches of 8, as `benchmarks.train` runs them: prompts of 20-200
tokens (`mixed`) or 512 (`long`); completion lengths as a random model's end-of-sequence token gives them there
(each token ends it with probability 1/95, at most 256). Shared (the default), each micro-batch is one group, its
prompt packed once; `--no-share` packs 8 rows drawn from the step's 32, each apart. A shape is what a compiled call
of the packed layers sees: the packed row's length and segment slots, and with shared prompts the keys' length and
slots. Per `CAPACITIES_PER_OCTAVE`: the distinct shapes over `--steps` steps (for each of `--seeds` runs), the new
shapes met per step (the first seed), and the padding (capacity over real tokens, less one).

    python -m benchmarks.diagnostics.packed_shapes [--workload mixed|long] [--steps 50] [--seeds 5]
        [--per-octave 1,2,4,8] [--no-share] [--out DIR]

Writes `packed-shapes-<workload>.json` and a plot of the distinct shapes met by each step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from unittest import mock

import torch

from benchmarks.train import EOS_SHARE, GENERATIONS, LONG_PROMPT, MAX_COMPLETION, MICRO_BATCH, PROMPTS
from compiled_grpo.integrations.trl import packing
from compiled_grpo.integrations.trl.plan import Lengths

BUCKET = 256  # CompiledGRPOTrainer's default `packed_bucket`


def completion_length(rng: random.Random) -> int:
    """Tokens until the end-of-sequence token (itself included), each one ending it with probability 1/EOS_SHARE."""
    n = 1
    while n < MAX_COMPLETION and rng.random() >= 1 / EOS_SHARE:
        n += 1
    return n


def step_rows(rng: random.Random, workload: str) -> list[tuple[int, int, int]]:
    """One optimizer step's rows: (group, prompt length, completion length), a group's rows side by side."""
    rows = []
    for group in range(PROMPTS):
        prompt = LONG_PROMPT if workload == "long" else rng.randint(20, 200)
        rows += [(group, prompt, completion_length(rng)) for _ in range(GENERATIONS)]
    return rows


def micro_batches(rng: random.Random, rows: list, share: bool) -> list[list]:
    """The step's micro-batches: whole groups in order where prompts are shared (as the trainer regroups them), TRL's
    shuffle otherwise."""
    if not share:
        rows = rng.sample(rows, len(rows))
    return [rows[i : i + MICRO_BATCH] for i in range(0, len(rows), MICRO_BATCH)]


def lengths_of(rows: list, share: bool) -> Lengths:
    """The rows' `Lengths` as the trainer reads them (every row's real tokens one span; a group's rows naming its
    first row where prompts are shared)."""
    P, C = max(r[1] for r in rows), max(r[2] for r in rows)
    prompt, completion = torch.tensor([r[1] for r in rows]), torch.tensor([r[2] for r in rows])
    masks = (torch.ones(len(rows), P), torch.ones(len(rows), C))
    groups = torch.tensor([[r[0] for r in rows].index(r[0]) for r in rows]) if share else None
    return Lengths(prompt, completion, True, masks, (), groups)


def shape(rows: list, share: bool) -> tuple:
    """What the packed layers see of these rows on fixed capacities: (length, segment slots[, keys, key slots])."""
    lengths = lengths_of(rows, share)
    ids = torch.zeros(len(rows), sum(m.shape[1] for m in lengths.masks), dtype=torch.long)
    packed = packing.pack(ids, lengths, torch.arange(len(rows)), packing.Shapes(BUCKET, fixed=True), lengths.groups)
    found = (packed.input_ids.shape[1], len(packed.cu_seqlens))
    if packed.keys is not None:
        found += (len(packed.keys.index), len(packed.keys.cu_seqlens))
    return found


def real_tokens(rows: list, share: bool) -> int:
    """The tokens the packed row forwards before its padding (a shared prompt once)."""
    lengths = lengths_of(rows, share)
    alone = int(lengths.prompt.sum() + lengths.completion.sum())
    return alone - packing.saved_tokens(lengths, torch.arange(len(rows)), lengths.groups)


def run(per_octave: int, workload: str, steps: int, seed: int, share: bool) -> dict:
    """One run's distinct shapes, the new ones per step, and its padding."""
    rng, seen, new, real, padded = random.Random(seed), set(), [], 0, 0
    with mock.patch.object(packing, "CAPACITIES_PER_OCTAVE", per_octave):
        for _ in range(steps):
            before = len(seen)
            for rows in micro_batches(rng, step_rows(rng, workload), share):
                found = shape(rows, share)
                seen.add(found)
                padded += found[0]
                real += real_tokens(rows, share)
            new.append(len(seen) - before)
    return {"shapes": len(seen), "new_per_step": new, "padding": padded / real - 1}


def sweep(args) -> dict:
    found = {"workload": args.workload, "share": args.share, "steps": args.steps, "bucket": BUCKET, "rows": []}
    for per_octave in args.per_octave:
        runs = [run(per_octave, args.workload, args.steps, seed, args.share) for seed in range(args.seeds)]
        found["rows"].append({"per_octave": per_octave, "shapes": [r["shapes"] for r in runs],
                              "new_per_step": runs[0]["new_per_step"],
                              "padding": statistics.mean(r["padding"] for r in runs)})  # fmt: skip
    return found


def table(found: dict) -> str:
    lines = ["| capacities per octave | distinct shapes (each seed) | new shapes per step (first seed) | padding |",
             "|---|---|---|---|"]  # fmt: skip
    for row in found["rows"]:
        new = " ".join(map(str, row["new_per_step"][:20])) + (" ..." if len(row["new_per_step"]) > 20 else "")
        lines.append(f"| {row['per_octave']} | {', '.join(map(str, row['shapes']))} | {new} | "
                     f"{100 * row['padding']:.1f}% |")  # fmt: skip
    return "\n".join(lines)


def draw(found: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in found["rows"]:
        total, cumulative = 0, []
        for n in row["new_per_step"]:
            total += n
            cumulative.append(total)
        ax.step(range(1, len(cumulative) + 1), cumulative, where="post",
                label=f"{row['per_octave']} per octave (padding {100 * row['padding']:.0f}%)")  # fmt: skip
    ax.set(xlabel="optimizer step", ylabel="distinct packed shapes met",
           title=f"{found['workload']} workload, {'shared' if found['share'] else 'unshared'} prompts")  # fmt: skip
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("mixed", "long"), default="mixed")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--per-octave", default="1,2,4,8", help="CAPACITIES_PER_OCTAVE values, comma-separated")
    parser.add_argument("--no-share", dest="share", action="store_false", help="rows packed apart, TRL's shuffle")
    parser.add_argument("--out", default="benchmark-results")
    args = parser.parse_args(argv)
    try:
        args.per_octave = [int(v) for v in args.per_octave.split(",")]
    except ValueError:
        parser.error(f"--per-octave: expected comma-separated positive ints, got {args.per_octave!r}")
    if min(args.per_octave) < 1 or args.steps < 1 or args.seeds < 1:
        parser.error("--per-octave, --steps and --seeds must be positive")
    found = sweep(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"packed-shapes-{args.workload}{'' if args.share else '-unshared'}"
    (out / f"{name}.json").write_text(json.dumps(found, indent=1))
    draw(found, out / f"{name}.png")
    print(table(found))


if __name__ == "__main__":
    main()
