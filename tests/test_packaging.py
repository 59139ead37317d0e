"""The built wheel installs only `compiled_grpo` (the reference and the audit mapped under it), and the audit
runs from the installed package, away from the checkout; without the audit's extra packages its command still
shows its usage, and says what to install instead of failing on an import."""

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
    # a plain install: the audit's extras cannot be imported (the test environment has them, so they are hidden)
    hidden = tmp_path / "hide-extras"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text(HIDE_EXTRAS)
    plain = {"PYTHONPATH": f"{hidden}:{site}"}
    for command, name in ((script, "compiled-grpo-audit"), (module, "python -m compiled_grpo.audits")):
        usage = subprocess.run([*command, "--help"], cwd=tmp_path, env=plain, capture_output=True, text=True)
        assert usage.returncode == 0, usage.stderr
        assert usage.stdout.startswith(f"usage: {name} "), usage.stdout[:80]
        assert "python -m audits" not in usage.stdout  # a checkout's command does not work after an install
        assert f"{name} --device cuda" in usage.stdout
        run = subprocess.run([*command, "--only", "quantile"], cwd=tmp_path, env=plain, capture_output=True, text=True)
        assert run.returncode == 2, run.stdout + run.stderr
        assert "missing: numpy, scipy, matplotlib, rich" in run.stderr and "compiled-grpo[audit]" in run.stderr
        assert "Traceback" not in run.stderr, run.stderr


HIDE_EXTRAS = """
import sys

HIDDEN = ("numpy", "scipy", "matplotlib", "rich")


class WithoutExtras:
    # the path finder, except that the hidden packages are not found (find_spec None: not installed)
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attribute):
        return getattr(self.finder, attribute)


sys.meta_path[:] = [WithoutExtras(f) if getattr(f, "__name__", "") == "PathFinder" else f for f in sys.meta_path]
"""
