"""The example trains: a short run finishes and writes its curve (the full run's curve is in docs/images)."""

from __future__ import annotations

import runpy
import sys

import pytest


def test_tiny_grpo_example_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curve.png"
    monkeypatch.setattr(sys, "argv", ["train_tiny_grpo.py", "--steps", "3", "--eager", "--out", str(out)])
    runpy.run_path("examples/train_tiny_grpo.py", run_name="__main__")
    assert out.exists() and "mean reward" in capsys.readouterr().out
