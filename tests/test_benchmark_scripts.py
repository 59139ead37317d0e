"""The GPU benchmarks' parts that run without a GPU: the profilers wrap the library's phases by name
(`benchmarks.profile_gpu.PHASES`, `benchmarks.profile_step.PHASES`), so a renamed function must fail here, on the
CPU, not on the GPU machine; the SFT step's report joins its runs' JSON into a table and a picture."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("module", ["profile_gpu", "profile_step"])
def test_every_profiled_phase_exists(module):
    import importlib

    phases = importlib.import_module(f"benchmarks.{module}").PHASES
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, *_ in phases if name not in vars(owner)]
    assert not missing


def test_sft_step_report(tmp_path):
    import json

    from benchmarks import sft_step

    def run(model, trl_ms, ours_ms):
        rows = [{"shape": f"{model} SFT x8", "model": model, "method": method, "ms": ms, "peak_gib": 1.0}
                for method, ms in (("trl", trl_ms), ("compiled", ours_ms))]  # fmt: skip
        path = tmp_path / f"sft-step-{model}.json"
        path.write_text(json.dumps({"versions": {"gpu": "GPU", "torch": "2", "repeats": 13}, "rows": rows}))
        return str(path)

    table = sft_step.report([run("0.5B", 100.0, 102.0), run("1.5B", 200.0, 190.0)], tmp_path / "out")
    assert "| 0.5B SFT x8 | 100.0 ms, 1.00 GiB | 102.0 ms, 1.00 GiB (+2.0%) |" in table
    assert "(-5.0%)" in table
    assert (tmp_path / "out" / "sft-step.png").stat().st_size > 0
