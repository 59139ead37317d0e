"""How many CUDA graphs a training run's captured calls need, and how many of its calls replay one: the captured
loss's own bucketing (`captured_call.padded_length`, the plan's slots rounded to `passes.CAPTURE_SLOT_BUCKET`) and its
own graph cache (`capture.Captures`: a key's first call runs uncaptured, its second captures, at most `--limit`
graphs kept, least recently used dropped), driven by the layouts of simulated batches. Host arithmetic only (no
GPU, nothing captured): the graph keys are those of a memory-schedule call on a GPU (the whole forward, keyed by
the padded length and the slots; the gradient pass, by the slots; the value and statistics checks, by [B, T],
where T is a multiple of 128).

Completion lengths per batch (TRL pads a batch to its longest completion, capped at --max-length):
  uniform: each completion uniform in [max_length / 8, max_length];
  capped: log-normal around half the cap (sigma 0.6), cut at the cap (a share of completions hit it, as when
    generation stops at max_completion_length);
  cycle4: the four micro-batches of `benchmarks.trl_step --batches varied`, taking turns.

    python -m benchmarks.diagnostics.capture_layouts [--steps 500] [--batch 8] [--max-length 1024] [--limits 16,64]
        [--out docs/benchmarks/archive/capture/layouts]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from compiled_grpo import capture, tiling
from compiled_grpo.schedules import captured_call, passes

DISTRIBUTIONS = ("uniform", "capped", "cycle4")


class CountingCaptures(capture.Captures):
    """The loss's graph cache, with a capture that records nothing (counted) and no pool."""

    def __init__(self, limit: int):
        super().__init__(limit=limit)
        self.captures = 0

    def _capture(self, key, work, tensors):
        self.captures += 1
        return self._keep(key, capture.Graph(NoGraph, [], capture.StaticOutputs.of(None)))

    def pool_reserved(self) -> int:
        return 0


class NoGraph:
    @staticmethod
    def replay():
        pass


def lengths_of(distribution: str, step: int, batch: int, cap: int, g: torch.Generator) -> torch.Tensor:
    if distribution == "uniform":
        return torch.randint(cap // 8, cap + 1, (batch,), generator=g)
    if distribution == "capped":
        drawn = torch.exp(torch.randn(batch, generator=g) * 0.6) * (cap / 2)
        return drawn.clamp(1, cap).long()
    fraction = (1.0, 0.8, 0.6, 0.9)[step % 4]  # benchmarks.trl_step.VARIED_LONGEST
    longest = int(cap * fraction)
    inner = torch.Generator().manual_seed(100 + step % 4)
    lengths = torch.randint(longest // 2, longest + 1, (batch,), generator=inner)
    lengths[0] = longest
    return lengths


def call_keys(lengths: torch.Tensor) -> list[tuple]:
    """The graph keys one memory-schedule call on a GPU uses, in order."""
    T = int(lengths.max())
    mask = torch.arange(T) < lengths[:, None]
    tiles = tiling.Tiles.for_device(torch.device("cuda"), captured=True)
    plan = tiling.plan_mask(mask, tiles.token_tile, tiles.tail_tile, passes.CAPTURE_SLOT_BUCKET)
    keys = []
    if T % captured_call.LENGTH_BUCKET == 0:  # `captured_call.checks_captures`
        keys += [("value checks", mask.shape), ("statistics checks", mask.shape)]
    keys.append(("whole forward", captured_call.padded_length(T), plan.tiles))
    keys.append(("vocabulary-outer gradients", plan.tiles))
    return keys


def simulate(distribution: str, steps: int, batch: int, cap: int, limit: int) -> dict:
    g = torch.Generator().manual_seed(0)
    captures = CountingCaptures(limit)
    calls, distinct = 0, set()
    for step in range(steps):
        for key in call_keys(lengths_of(distribution, step, batch, cap, g)):
            captures.run(key, lambda: None, [])
            calls += 1
            distinct.add(key)
    # a capture call replays its new graph too (`Captures._run`): "replayed" counts the calls that found one
    return {"distribution": distribution, "steps": steps, "batch": batch, "max_length": cap, "limit": limit,
            "graph_calls": calls, "distinct_keys": len(distinct), "uncaptured": calls - captures.replays,
            "captures": captures.captures, "replayed": captures.replays - captures.captures}  # fmt: skip


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--limits", default="16,64", help="graphs kept (Captures.limit, 16 in the loss), comma-separated")
    ap.add_argument("--out", default="benchmark-results")
    args = ap.parse_args(argv)
    rows = [simulate(d, args.steps, args.batch, args.max_length, int(limit))
            for limit in args.limits.split(",") for d in DISTRIBUTIONS]  # fmt: skip
    lines = [f"{args.steps} steps of {args.batch} completions (at most {args.max_length} tokens), one memory-schedule "
             "call each; graph calls: the graphs the calls use (whole forward, gradient pass, checks).", "",
             "| lengths | graphs kept at most | graph calls | distinct keys | run uncaptured (first sight) | "
             "captures | replays of a kept graph |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        shares = " | ".join(f"{r[k]} ({r[k] / r['graph_calls']:.0%})" for k in ("uncaptured", "captures", "replayed"))
        lines.append(f"| {r['distribution']} | {r['limit']} | {r['graph_calls']} | {r['distinct_keys']} | {shares} |")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capture-layouts.json").write_text(json.dumps(rows, indent=1))
    (out / "capture-layouts.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
