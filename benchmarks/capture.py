"""Captured calls against uncaptured ones: the speed schedule with `capture=True` and without, on one GPU, bf16,
8192 tokens, V=151936, dapo, forward + backward, beside the three lm_head GEMMs (the floor) in the same run.

    python -m benchmarks.capture [--hidden 896,1536,4096] [--repeats 20] [--out benchmark-results/capture]

Per method: the median time per call (synchronized), and the host's time to issue the call (the call returns
before the GPU has finished; its planning waits for the GPU once), both in ms.
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


def timed(step, repeats: int):
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    walls, hosts = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        hosts.append((t1 - t0) * 1e3)
        walls.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(walls), statistics.median(hosts)


def run(H: int, repeats: int) -> dict:
    hidden, weight, ids, mask, advantages, old = batch(H)
    rows = {}

    def floor():
        x = hidden.reshape(-1, H).requires_grad_()
        z = x @ weight.T
        z.backward(torch.ones_like(z))

    rows["floor (3 GEMMs)"] = timed(floor, repeats)
    for name, capture in (("speed", False), ("speed, captured", True)):
        loss_fn = FusedLinearGRPOLoss(schedule="speed", capture=capture)

        def step(loss_fn=loss_fn):
            h = hidden.detach().requires_grad_()
            weight.grad = None
            loss_fn(h, weight, ids, mask, advantages, old_per_token_logps=old).loss.backward()

        rows[name] = timed(step, repeats)
        if capture:
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
    lines = ["| H | method | time per call (ms) | host time to issue (ms) |", "|---|---|---|---|"]
    for H in (int(h) for h in args.hidden.split(",")):
        rows = run(H, args.repeats)
        results[H] = rows
        for name, (wall, host, *_) in rows.items():
            lines.append(f"| {H} | {name} | {wall:.2f} | {host:.2f} |")
            print(lines[-1], flush=True)
    env = f"{torch.cuda.get_device_name()}, torch {torch.__version__}; medians of {args.repeats}"
    (out / "capture.json").write_text(json.dumps({"env": env, "results": results}, indent=1))
    (out / "capture.md").write_text(f"# Captured calls\n\n{env}\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
