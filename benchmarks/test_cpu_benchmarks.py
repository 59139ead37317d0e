"""pytest-benchmark suite on the CPU: eager vs compiled for both schedules, beside the GEMM floor.

Not part of the test run (the tests live in tests/). Run it with

    python -m pytest benchmarks --benchmark-only --benchmark-group-by=param:shape
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.cpu import fused, gemm_floor, make_batch
from compiled_grpo import FusedLinearGRPOLoss

SHAPES = {
    "design": dict(
        B=4, T=256, H=512, V=32000, active=200
    ),  # the CPU benchmark's shape (docs/benchmarks/cpu.md), 800 active tokens
    "small": dict(B=4, T=128, H=256, V=8000, active=100),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request):
    return request.param


@pytest.fixture(scope="module")
def batch(shape):
    return make_batch(**SHAPES[shape])


def test_floor(benchmark, batch, shape):
    benchmark.extra_info["shape"] = shape
    benchmark(gemm_floor, *batch)


@pytest.mark.parametrize("schedule", ["speed", "memory"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fused(benchmark, batch, shape, schedule, compiled):
    run = fused(FusedLinearGRPOLoss(compiled=compiled, schedule=schedule))
    run(*batch)  # compile outside the timed rounds
    benchmark.extra_info["shape"] = shape
    benchmark.pedantic(run, args=batch, rounds=5, warmup_rounds=1)


def test_eager_and_compiled_agree(batch):
    """A benchmark of a wrong result is worthless: both modes give the same loss on the benchmarked batch."""
    outs = [FusedLinearGRPOLoss(compiled=c, schedule="speed")(*batch).loss for c in (False, True)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
