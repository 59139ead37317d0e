"""The built wheel installs only `compiled_grpo` (the reference and the audit mapped under it), and the audit
runs from the installed package, away from the checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_no_generic_top_level_names_and_its_audit_runs(tmp_path):
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "-w", str(tmp_path / "dist"), str(ROOT)], check=True)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    top = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in top if not t.endswith(".dist-info")} == {"compiled_grpo"}, top
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)], check=True)
    run = subprocess.run(
        [sys.executable, "-m", "compiled_grpo.audits", "--only", "quantile", "--out", str(tmp_path / "report")],
        cwd=tmp_path,  # not the checkout: its top-level folders must not be what gets imported
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "PASS" in run.stdout and str(site) in subprocess.run(
        [sys.executable, "-c", "import compiled_grpo.audits as a; print(a.reference.__file__)"],
        cwd=tmp_path, env={"PYTHONPATH": str(site)}, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    script = [str(site / "bin" / "compiled-grpo-audit")]
    module = [sys.executable, "-m", "compiled_grpo.audits"]
    for command, name in ((script, "compiled-grpo-audit"), (module, "python -m compiled_grpo.audits")):
        usage = subprocess.run([*command, "--help"], cwd=tmp_path, env={"PYTHONPATH": str(site)}, capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
        assert usage.startswith(f"usage: {name} "), usage[:80]
