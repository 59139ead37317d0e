"""Where the time goes: torch.profiler's CUDA kernel table for this library's compiled schedules on a shape
of benchmarks.gpu (its loss settings included), and
the GPU's idle gaps between kernels (time the GPU waits on the host), largest first.

python -m benchmarks.profile_gpu [--schedule memory] [--shape S1] [--rows 20]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu import SHAPES, loss_settings, make_inputs
from compiled_grpo import FusedLinearGRPOLoss


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="memory")
    ap.add_argument("--shape", default="S1")
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    x = make_inputs(shape)
    loss_fn = FusedLinearGRPOLoss(compiled=True, schedule=args.schedule, validate=False, **loss_settings(shape))

    def run():
        h = x["hidden"].detach().requires_grad_()
        loss_fn(h, x["weight"], x["ids"], x["mask"], x["advantages"]).loss.backward()
        x["weight"].grad = None

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    print(f"{args.schedule} schedule on {args.shape}, 3 runs")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70))
    print_gaps(prof, runs=3)


def print_gaps(prof, runs: int, shown: int = 8, min_us: float = 20.0) -> None:
    """Idle time between consecutive GPU kernels and copies: where the GPU waited for the host."""
    kernels = sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    gaps, end, before = [], None, None
    for e in kernels:
        if end is not None and e.time_range.start - end > min_us:
            gaps.append((e.time_range.start - end, before, e.name))
        if end is None or e.time_range.end > end:
            end, before = e.time_range.end, e.name
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    kinds = {"GEMM": 0.0, "Inductor": 0.0, "other": 0.0}
    counts = dict.fromkeys(kinds, 0)
    for e in kernels:
        kind = (
            "GEMM"
            if ("gemm" in e.name or "nvjet" in e.name)
            else "Inductor"
            if e.name.startswith("triton")
            else "other"
        )
        kinds[kind] += e.time_range.elapsed_us()
        counts[kind] += 1
    print(
        "per run: "
        + ", ".join(f"{k} {v / runs / 1e3:.2f} ms in {counts[k] / runs:.0f} kernels" for k, v in kinds.items())
    )
    print(
        f"GPU busy {busy / runs / 1e3:.2f} ms per run; idle gaps over {min_us:.0f} us: "
        f"{sum(g for g, _, _ in gaps) / runs / 1e3:.2f} ms per run (between runs included)"
    )
    for gap, a, b in sorted(gaps, reverse=True)[:shown]:
        print(f"  {gap / 1e3:7.3f} ms  after {a[:60]}  before {b[:60]}")


if __name__ == "__main__":
    main()
