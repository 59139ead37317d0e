"""GPU timing shared by the benchmarks: median CUDA-event time of a call, and its peak memory (on a CPU, a dry
run of a benchmark's plumbing: the wall-clock median and no peak); the date a stored run records."""

from __future__ import annotations

import statistics
import time

import torch


def measure(run, x: dict, repeats: int, warmup: int = 3) -> tuple[float, float | None]:
    """(median ms, peak GiB above the memory in use before the call); `x["weight"].grad` cleared between calls."""
    for _ in range(warmup):
        run()
        x["weight"].grad = None
    if not x["weight"].is_cuda:
        return wall_median_ms(run, repeats, after=lambda: setattr(x["weight"], "grad", None)), None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = median_ms(run, repeats, after=lambda: setattr(x["weight"], "grad", None))
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def run_date() -> str:
    """Today's date (UTC) as a stored run records it."""
    return time.strftime("%Y-%m-%d", time.gmtime())


def median_ms(fn, repeats: int, after=lambda: None) -> float:
    """Median CUDA-event time of `fn()` over `repeats` calls, `after()` run between them (outside the timing)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        after()
    return statistics.median(times)


def wall_median_ms(fn, repeats: int, after=lambda: None) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
        after()
    return statistics.median(times)


def device_busy_ms(profiler, keep=None) -> float:
    """The GPU's busy time (ms) a finished `torch.profiler.profile` saw: its device-side events (each kernel, copy and
    set once, CUDA graphs' kernels included), not the host ops that launched them (counted twice otherwise); only
    the events `keep` (a predicate) keeps, where given."""
    device = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # a `record_function` range also shows on the device as an annotation spanning its kernels: not a kernel
    device = [e for e in device if not getattr(e, "is_user_annotation", False) and (keep is None or keep(e))]
    return sum(e.time_range.elapsed_us() for e in device) / 1e3


def busy_ms(step) -> float:
    """The GPU's busy time (ms) of one `step()`, under the profiler (CUDA activity only)."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        step()
        torch.cuda.synchronize()
    return device_busy_ms(profiler)
