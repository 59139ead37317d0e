"""Where the time goes: torch.profiler's CUDA kernel table for this library's compiled schedules on S1.

python -m benchmarks.profile_gpu [--schedule memory] [--rows 20]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.gpu import SHAPES, make_inputs
from compiled_grpo import FusedLinearGRPOLoss


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="memory")
    ap.add_argument("--shape", default="S1")
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args(argv)
    x = make_inputs(SHAPES[args.shape])
    loss_fn = FusedLinearGRPOLoss(compiled=True, schedule=args.schedule, validate=False)

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


if __name__ == "__main__":
    main()
