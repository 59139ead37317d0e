"""Where the time goes: torch.profiler's CUDA kernel table for this library's compiled schedules on a shape
of benchmarks.gpu (its loss settings included), the GPU's idle gaps between kernels (time the GPU waits on the
host), largest first, and what the host was doing during them: the library's phases (plan, statistics pass,
objective, gradient passes, metrics...) are wrapped in profiler ranges for the profiled runs only, and each
gap's time is charged to the innermost phase the host was in.

python -m benchmarks.diagnostics.profile_gpu [--schedule memory] [--shape S1] [--rows 20]

`--schedule` is one of the GRPO loss's schedules, or `primitive` (`fused_linear_logprobs` with the loss on top),
`primitive-rounded` (the same with `round_logits=True`) or `trl` (TRL 1.16's fused head with the same loss), as
benchmarks.gpu runs them.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import reference
from benchmarks import gpu_methods
from benchmarks.gpu import SHAPES, make_inputs
from benchmarks.gpu_methods import loss_settings
from compiled_grpo import FusedLinearGRPOLoss, batch_objective, checks, logprobs, quantile, tiling
from compiled_grpo.schedules import passes, recompute, sparse_gradients, speed, whole_forward

# (owner, attribute) of the phases charged with idle time
PHASES = (
    (speed, "plan"), (recompute, "plan"), (speed, "tile_gradients"), (tiling, "positions_and_lengths"),
    (passes, "gather_slots"), (passes, "statistics_pass"), (passes, "vocab_outer_gradients"),
    (passes.TokenOuterGradients, "add"), (passes.TokenOuterGradients, "result"),
    (sparse_gradients, "rows_with_gradient"), (sparse_gradients, "gradients_of_rows"),
    (batch_objective.Objective, "loss_and_metrics"), (batch_objective, "metrics"),
    (batch_objective.Objective, "normalizers"), (quantile, "high_entropy_mask"), (checks, "statistics_faults"),
    (speed.PrecomputedGradients, "backward"), (recompute.StatisticsThenRecompute, "backward"),
    (sparse_gradients.StatisticsThenSparseGradients, "gradients"), (whole_forward, "forward_work"),
    (whole_forward.LossOfSlots, "backward"), (logprobs, "prepare"), (reference, "grpo_objective"),
)  # fmt: skip
# heads with the loss on top, as benchmarks.gpu runs them
HEADS = {
    "primitive": gpu_methods.primitive(),
    "primitive-rounded": gpu_methods.primitive(round_logits=True),
    "trl": gpu_methods.trl_fused_head,
}


@contextlib.contextmanager
def phases_recorded(phases=PHASES):
    """Each phase, (owner, attribute) or (owner, attribute, label), wrapped in a profiler range named after it
    (or its label), for the duration of the block."""
    saved = []
    for owner, name, *label in phases:
        original = owner.__dict__[name]
        function = original.__func__ if isinstance(original, staticmethod) else original
        label = label[0] if label else f"{getattr(owner, '__name__', '')}.{name}"
        wrapped = in_range(function, f"phase:{label}")
        setattr(owner, name, staticmethod(wrapped) if isinstance(original, staticmethod) else wrapped)
        saved.append((owner, name, original))
    try:
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def in_range(function, label: str):
    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        with record_function(label):
            return function(*args, **kwargs)

    return wrapped


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="memory")
    ap.add_argument("--shape", default="S1")
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    x = make_inputs(shape)
    run = method(args.schedule, shape, x)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with phases_recorded(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            with record_function("phase:call"):
                run()
            torch.cuda.synchronize()
    print(f"{args.schedule} schedule on {args.shape}, 3 runs")
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70)
    print(table)
    print_gaps(prof, runs=3)


def method(name: str, shape, x):
    """One forward and backward of `name` on the inputs `x`, as a closure."""
    if name in HEADS:
        step = HEADS[name](shape, x)
        if isinstance(step, str):  # a baseline that is not installed
            raise SystemExit(step)
    else:
        loss_fn = FusedLinearGRPOLoss(compiled=True, schedule=name, validate=False, **loss_settings(shape))

        def step():
            h = x["hidden"].detach().requires_grad_()
            loss_fn(h, x["weight"], x["ids"], x["mask"], x["advantages"]).loss.backward()

    def run():
        step()
        x["weight"].grad = None

    return run


def kind(name: str) -> str:
    if "gemm" in name or "nvjet" in name:
        return "GEMM"
    return "Inductor" if name.startswith("triton") else "other"


def print_gaps(prof, runs: int, shown: int = 8, min_us: float = 20.0) -> None:
    """Idle time between consecutive GPU kernels and copies, inside the profiled calls (from each call's start
    on the host to its last kernel): where the GPU waited for the host, charged to the host's phase."""
    events = prof.events()
    on_gpu = (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    kernels = sorted((e for e in on_gpu if not e.name.startswith("phase:")), key=start_of)  # ranges mirrored
    ranges = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("phase:")]
    calls = sorted((e for e in ranges if e.name == "phase:call"), key=start_of)
    gaps = []
    for call, following in zip(calls, [*calls[1:], None], strict=True):  # each call ends in a synchronize
        last = math.inf if following is None else following.time_range.start
        inside = [k for k in kernels if call.time_range.start <= k.time_range.start < last]
        end, before = call.time_range.start, "the call's start on the host"
        for k in inside:
            if k.time_range.start - end > min_us:
                gaps.append((end, k.time_range.start, before, k.name))
            if k.time_range.end > end:
                end, before = k.time_range.end, k.name
    busy = sum(k.time_range.elapsed_us() for k in kernels)
    totals, counts = {"GEMM": 0.0, "Inductor": 0.0, "other": 0.0}, {"GEMM": 0, "Inductor": 0, "other": 0}
    for k in kernels:
        totals[kind(k.name)] += k.time_range.elapsed_us()
        counts[kind(k.name)] += 1
    per_run = ", ".join(f"{k} {v / runs / 1e3:.2f} ms in {counts[k] / runs:.0f} kernels" for k, v in totals.items())
    print(f"per run: {per_run}; {sum(counts.values()) / runs:.0f} kernels launched")
    idle = sum(b - a for a, b, _, _ in gaps)
    print(f"GPU busy {busy / runs / 1e3:.2f} ms per run; idle gaps over {min_us:.0f} us inside the calls: "
          f"{idle / runs / 1e3:.2f} ms per run")  # fmt: skip
    charged: dict[str, float] = {}
    for a, b, _, _ in gaps:
        for name, us in phase_overlaps(ranges, a, b).items():
            charged[name] = charged.get(name, 0.0) + us
    print("idle time by the host's innermost phase during it (ms per run):")
    for name, us in sorted(charged.items(), key=lambda item: -item[1]):
        print(f"  {us / runs / 1e3:7.3f}  {name.removeprefix('phase:')}")
    for a, b, before, after in sorted(gaps, key=lambda g: g[0] - g[1])[:shown]:
        print(f"  {(b - a) / 1e3:7.3f} ms  after {before[:60]}  before {after[:60]}")


def start_of(event) -> float:
    return event.time_range.start


def phase_overlaps(ranges, a: float, b: float) -> dict[str, float]:
    """Microseconds of [a, b] spent in each innermost phase range (the latest-starting range covering a moment)."""
    covering = sorted((r for r in ranges if r.time_range.start < b and r.time_range.end > a), key=start_of)
    out: dict[str, float] = {}
    points = sorted({a, b, *(max(a, min(b, t)) for r in covering for t in (r.time_range.start, r.time_range.end))})
    for lo, hi in zip(points, points[1:], strict=False):
        mid = (lo + hi) / 2
        inner = [r for r in covering if r.time_range.start <= mid < r.time_range.end]
        name = inner[-1].name if inner else "phase:outside the library's phases"
        out[name] = out.get(name, 0.0) + (hi - lo)
    return out


if __name__ == "__main__":
    main()
