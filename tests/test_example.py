"""The example trains: a short run finishes and writes its curve (the full run's curve is in docs/images)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest


def test_tiny_grpo_example_runs(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curve.png"
    monkeypatch.setattr(sys, "argv", ["train_tiny_grpo.py", "--steps", "3", "--eager", "--out", str(out)])
    runpy.run_path("examples/train_tiny_grpo.py", run_name="__main__")
    assert out.exists() and "mean reward" in capsys.readouterr().out


def test_trl_example_runs_offline_on_a_cpu(tmp_path, monkeypatch, capsys):
    """examples/train_trl_grpo.py, as docs/usage.md shows it: TRL's trainer with the fused loss, no download."""
    pytest.importorskip("trl")
    argv = ["train_trl_grpo.py", "--steps", "2", "--eager", "--out", str(tmp_path / "run")]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path("examples/train_trl_grpo.py", run_name="__main__")
    assert "2 steps in" in capsys.readouterr().out


def test_usage_doc_shows_the_trl_example_as_it_is():
    """The TRL snippet of docs/usage.md is lines of the example script, word for word."""
    doc = Path("docs/usage.md").read_text()
    snippet = doc.split("## With TRL 1.16")[1].split("```python")[1].split("```")[0]
    script = Path("examples/train_trl_grpo.py").read_text()
    lines = [line for line in snippet.splitlines() if line.strip() and not line.strip().startswith("...")]
    assert lines and all(line in script for line in lines), [line for line in lines if line not in script]
