"""Captured calls against uncaptured ones: the speed and memory schedules with `capture=True` and without, on one
GPU, bf16, 8192 tokens, V=151936, dapo, forward + backward, beside the three lm_head GEMMs (the floor) in the same
run.

    python -m benchmarks.diagnostics.capture [--hidden 896,1536,4096] [--repeats 20] [--out benchmark-results/capture]

Per method: the median time per call (synchronized), and the host's time to issue its forward and its backward
(each returns before the GPU has finished; the forward's plan waits for the GPU once, which starts each call
idle), in ms. "validate=False": no value checks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from compiled_grpo import FusedLinearGRPOLoss

TOKENS, VOCAB = 8192, 151936


def batch(H: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, T = 8, TOKENS // 8
    hidden = torch.randn(B, T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = (torch.randn(VOCAB, H, device="cuda", generator=g) / H**0.5).to(torch.bfloat16).requires_grad_()
    ids = torch.randint(0, VOCAB, (B, T), device="cuda", generator=g)
    mask = torch.ones(B, T, device="cuda", dtype=torch.long)
    advantages = torch.randn(B, device="cuda", generator=g)
    old = -torch.rand(B, T, device="cuda", generator=g) * 5
    return hidden, weight, ids, mask, advantages, old


def timed(forward, repeats: int, backward=torch.Tensor.backward):
    """Median (wall, host time of the forward, host time of the backward) of `backward(forward())`."""
    for _ in range(3):
        backward(forward())
    torch.cuda.synchronize()
    walls, forwards, backwards = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loss = forward()
        t1 = time.perf_counter()
        backward(loss)
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        forwards.append((t1 - t0) * 1e3)
        backwards.append((t2 - t1) * 1e3)
        walls.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(walls), statistics.median(forwards), statistics.median(backwards)


METHODS = {  # name: (schedule, options)
    "speed": ("speed", {}),
    "speed, captured": ("speed", {"capture": True}),
    "memory": ("memory", {}),
    "memory, captured": ("memory", {"capture": True}),
    "memory, captured, validate=False": ("memory", {"capture": True, "validate": False}),
}


def run(H: int, repeats: int) -> dict:
    hidden, weight, ids, mask, advantages, old = batch(H)
    rows = {}

    def floor():
        x = hidden.reshape(-1, H).requires_grad_()
        return x @ weight.T

    rows["floor (3 GEMMs)"] = timed(floor, repeats, lambda z: z.backward(torch.ones_like(z)))
    for name, (schedule, options) in METHODS.items():
        loss_fn = FusedLinearGRPOLoss(schedule=schedule, **options)

        def forward(loss_fn=loss_fn):
            weight.grad = None
            return loss_fn(hidden.detach().requires_grad_(), weight, ids, mask, advantages,
                           old_per_token_logps=old).loss  # fmt: skip

        rows[name] = timed(forward, repeats)
        if loss_fn.captures is not None:
            rows[name] += (loss_fn.captures.replays,)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", default="896,1536,4096")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default="benchmark-results/capture")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    lines = ["| H | method | time per call (ms) | host: forward (ms) | host: backward (ms) |", "|---|---|---|---|---|"]
    for H in (int(h) for h in args.hidden.split(",")):
        rows = run(H, args.repeats)
        results[H] = rows
        for name, (wall, forward, backward, *_) in rows.items():
            lines.append(f"| {H} | {name} | {wall:.2f} | {forward:.2f} | {backward:.2f} |")
            print(lines[-1], flush=True)
    env = f"{torch.cuda.get_device_name()}, torch {torch.__version__}; medians of {args.repeats}"
    (out / "capture.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    (out / "capture.md").write_text(f"# Captured calls\n\n{env}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
