"""Where a TRL step's time goes, between the bound (the backbone alone) and each trainer: torch.profiler over a
few steps of `benchmarks.trl_step`'s methods, with the step's phases wrapped in profiler ranges (the backbone's
forward, TRL's fused head forward and backward, this library's loss call and its backward, the metrics'
read-back, the backward as a whole). Per method and step: wall time, GPU busy time and the idle rest, kernels
launched, and per phase the host's time in it and the GPU time of the kernels it launched.

    python -m benchmarks.diagnostics.profile_step --model 0.5B --batch dense --trainers grpo,auto,memory [--out DIR]
        [--python]

Writes `profile-step-<model>-<batch>.json` and prints a table; with `--python`, also each method's host time by
Python function (cProfile over the same number of steps, without torch.profiler: the functions under
`_compute_loss` that a profiler range does not name) in `python-profile-<model>-<batch>-<method>.txt`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
import trl.kernels.chunked_logprob as trl_head
from torch.profiler import ProfilerActivity, profile, record_function
from trl import GRPOTrainer

from benchmarks import trl_step
from benchmarks.diagnostics import profile_gpu
from compiled_grpo import FusedLinearGRPOLoss, tiling
from compiled_grpo.integrations.trl import packed_attention, packing, padding_free, zero_advantage
from compiled_grpo.integrations.trl import plan as micro_batch_plan
from compiled_grpo.integrations.trl import settings as trl_integration
from compiled_grpo.schedules import recompute, speed, whole_forward

PHASES = (  # (owner, attribute, phase name)
    (GRPOTrainer, "_compute_loss", "compute_loss (TRL's or ours)"),
    (trl_step.CompiledGRPOTrainer, "_compute_loss", "compute_loss (TRL's or ours)"),
    (trl_head.ChunkedLogProbFunction, "forward", "head forward (TRL)"),
    (trl_head.ChunkedLogProbFunction, "backward", "head backward (TRL)"),
    (FusedLinearGRPOLoss, "__call__", "head + loss forward (library)"),
    (trl_integration, "read_back", "metrics read back (library)"),
    (tiling, "positions_and_lengths", "the plan's counts and wait (library)"),
    (speed.PrecomputedGradients, "backward", "head backward (library)"),
    (recompute.StatisticsThenRecompute, "backward", "head backward (library)"),
    (whole_forward.LossOfSlots, "backward", "head backward (library)"),
    # the trainer's own host work around the model and the loss (`_compute_loss`, packed or trimmed)
    (zero_advantage, "row_plan", "row plan (trainer)"),
    (micro_batch_plan, "lengths", "micro-batch lengths (trainer)"),
    (packing, "trimmed", "trim (trainer)"),
    (padding_free, "pack", "pack the rows (trainer)"),
    (padding_free, "targets", "packed targets (trainer)"),
    (packed_attention, "forward_kwargs", "packed attention arguments (trainer)"),
    (padding_free, "forward", "forward, packed or padded, the model's included (trainer)"),
    (zero_advantage, "loss_rows", "loss rows (trainer)"),
    (packing, "per_target", "per-target inputs (trainer)"),
    (trl_step.CompiledGRPOTrainer, "_fused_loss", "fused loss call, the head's included (trainer)"),
)
MODEL_FORWARD, BACKWARD, STEP = "backbone forward", "backward (all)", "step"


@contextlib.contextmanager
def phases_recorded(model):
    """Every phase wrapped in a profiler range named after it, and the backbone's forward, for the block."""
    ranges = []
    backbone = model.model  # the decoder without lm_head (TRL's fused head runs in the outer forward)
    enter = backbone.register_forward_pre_hook(lambda *a: ranges.append(opened(f"phase:{MODEL_FORWARD}")))
    leave = backbone.register_forward_hook(lambda *a: ranges.pop().__exit__(None, None, None))
    try:
        with profile_gpu.phases_recorded(PHASES):
            yield
    finally:
        enter.remove()
        leave.remove()


def opened(label: str):
    r = record_function(label)
    r.__enter__()
    return r


def with_backward_range(step):
    """The trainer's step with its backward in a range of its own."""
    original = torch.Tensor.backward

    def run():
        def backward(self, *args, **kwargs):
            with record_function(f"phase:{BACKWARD}"):
                return original(self, *args, **kwargs)

        torch.Tensor.backward = backward
        try:
            step()
        finally:
            torch.Tensor.backward = original

    return run


def profile_method(step, model, steps: int, reset, warmups: int = 2) -> dict:
    """Per step (mean of `steps`): wall, GPU busy and idle time, kernels, and host and GPU time of each phase."""
    for _ in range(warmups):
        step()
        reset()
    trl_step.sync(torch.cuda.is_available())
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with phases_recorded(model), profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(f"phase:{STEP}"):
                step()
                trl_step.sync(torch.cuda.is_available())
            reset()
    return summarize(prof.events(), steps)


def python_profile(step, steps: int, reset) -> str:
    """The host's time in `steps` steps (already warm) by Python function (cProfile), sorted by cumulative time, then
    by each function's own time: where the host time of a host-bound step goes, the waits on the GPU included (as
    time in the call that waits)."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
        trl_step.sync(torch.cuda.is_available())
        reset()
    profiler.disable()
    text = io.StringIO()
    text.write(f"{steps} steps; cumulative seconds over all of them\n")
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(80)
    text.write("\nThe same, by each function's own time (its callees' excluded): where the host's time is spent\n")
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(50)
    return text.getvalue()


def summarize(events, steps: int) -> dict:
    ranges = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("phase:")]
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("phase:")]
    phases: dict[str, dict] = {}
    for r in ranges:
        p = phases.setdefault(r.name.removeprefix("phase:"), {"host_ms": 0.0, "gpu_ms": 0.0, "kernels": 0})
        p["host_ms"] += r.time_range.elapsed_us() / 1e3 / steps
        p["gpu_ms"] += r.device_time_total / 1e3 / steps
        p["kernels"] += launched(r) / steps
    wall = phases.get(STEP, {}).get("host_ms", 0.0)
    busy = sum(k.time_range.elapsed_us() for k in kernels) / 1e3 / steps
    return {"wall_ms": wall, "gpu_busy_ms": busy, "gpu_idle_ms": wall - busy, "kernels": len(kernels) / steps,
            "phases": phases}  # fmt: skip


def launched(event) -> int:
    return len(event.kernels) + sum(launched(c) for c in event.cpu_children)


def print_table(results: dict) -> None:
    names = list(results)
    print("| | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for key in ("wall_ms", "gpu_busy_ms", "gpu_idle_ms", "kernels"):
        print(f"| {key} | " + " | ".join(f"{results[n][key]:.1f}" for n in names) + " |")
    labels = dict.fromkeys(label for r in results.values() for label in r["phases"] if label != STEP)
    for label in labels:
        cells = []
        for n in names:
            p = results[n]["phases"].get(label)
            cells.append("-" if p is None else f"host {p['host_ms']:.1f}, GPU {p['gpu_ms']:.1f}, {p['kernels']:.0f} k")
        print(f"| {label} | " + " | ".join(cells) + " |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(trl_step.QWEN), default="0.5B")
    ap.add_argument("--batch", choices=list(trl_step.BATCHES), default="dense")
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--trainers", default="grpo,auto,memory")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="benchmark-results")
    ap.add_argument("--python", action="store_true", help="also each method's host time by Python function")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a smoke test (--model tiny)
    model, vocab, completion = trl_step.make_model(args.model, device)
    reset = lambda: model.zero_grad(set_to_none=True)
    q, _ = trl_step.BATCHES[args.batch]
    batches = trl_step.micro_batches(vocab, device, args.size, args.batch, C=completion)
    warmups = 2 * len(batches)  # each micro-batch twice (a captured layout's warm-up and capture)
    bound = with_backward_range(trl_step.bound_step(model, batches))
    results = {"bound": profile_method(bound, model, args.steps, reset, warmups)}
    for name in args.trainers.split(","):
        trainer = trl_step.make_trainer(name, model, args.size, q, device == "cuda", completion)
        trl_step.make_plans([trainer], batches)
        # the row's step as `trl_step` times it: its own compiled layers, Inductor config and Liger's kernels
        row = trl_step.row_steps(model, {name: trl_step.trainer_step(trainer, batches)}, {name: trainer})[name]
        step = with_backward_range(row)
        results[name] = profile_method(step, model, args.steps, reset, warmups)
        if args.python:  # the step warmed by `profile_method`
            text = python_profile(row, args.steps, reset)
            (out / f"python-profile-{args.model}-{args.batch}-{name}.txt").write_text(text)
        del trainer, step
        if device == "cuda":
            torch.cuda.empty_cache()
    print(f"{args.model} {args.batch} x{args.size}: per step, mean of {args.steps}")
    print_table(results)
    (out / f"profile-step-{args.model}-{args.batch}.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
