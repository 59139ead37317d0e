"""The GPU profilers wrap the library's phases by name (`benchmarks.profile_gpu.PHASES`,
`benchmarks.profile_step.PHASES`): a renamed function must fail here, on the CPU, not on the GPU machine."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("module", ["profile_gpu", "profile_step"])
def test_every_profiled_phase_exists(module):
    import importlib

    phases = importlib.import_module(f"benchmarks.{module}").PHASES
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, *_ in phases if name not in vars(owner)]
    assert not missing
