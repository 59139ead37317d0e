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


def test_trl_example_learns_over_its_whole_run_offline_on_a_cpu(tmp_path, monkeypatch, capsys):
    """examples/train_trl_grpo.py, as docs/usage.md shows it: TRL's trainer with the fused loss, no download; over
    its 30 steps the reward keeps climbing (each of the last three logging windows above the first two) without
    reaching the task's maximum, and no window is all groups at advantage 0 (a saturated task trains nothing)."""
    pytest.importorskip("trl")
    argv = ["train_trl_grpo.py", "--eager", "--out", str(tmp_path / "run")]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path("examples/train_trl_grpo.py", run_name="__main__")
    said = capsys.readouterr().out
    assert "30 steps in" in said
    rewards = [float(r) for r in said.split("mean reward per logging window: ")[1].split(";")[0].split(", ")]
    zeros = [int(z.strip().rstrip("%")) for z in said.split("groups at advantage 0 (no backward): ")[1].split(", ")]
    assert len(rewards) == len(zeros) == 6, said
    assert min(rewards[3:]) > max(rewards[:2]) and max(rewards) < 9, rewards
    assert max(zeros) < 100, zeros


def test_usage_doc_shows_the_trl_example_as_it_is():
    """The TRL snippet of docs/usage.md is lines of the example script, word for word."""
    doc = Path("docs/usage.md").read_text()
    snippet = doc.split("## With TRL 1.16")[1].split("```python")[1].split("```")[0]
    script = Path("examples/train_trl_grpo.py").read_text()
    lines = [line for line in snippet.splitlines() if line.strip() and not line.strip().startswith("...")]
    assert lines and all(line in script for line in lines), [line for line in lines if line not in script]


def test_usage_doc_primitive_snippet_runs():
    """The DPO-style loss on fused_linear_logprobs in docs/usage.md runs as written, and its gradient matches
    the same loss on full logits."""
    import torch

    doc = (Path(__file__).resolve().parents[1] / "docs" / "usage.md").read_text()
    section = doc.split("## Per-token log-probs for a loss of your own")[1]
    code = section.split("```python\n")[1].split("```")[0]
    scope = {}
    exec(compile(code, "usage.md", "exec"), scope)  # noqa: S102 - the documentation's own snippet
    hidden, weight, labels = scope["hidden"], scope["weight"], scope["labels"]
    h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    log_p = (h @ w.T).log_softmax(-1)
    valid = labels != -100
    policy = torch.where(valid, log_p.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0).sum(-1)
    B, ref = scope["B"], scope["reference_logps"]
    margin = (policy[:B] - ref[:B]) - (policy[B:] - ref[B:])
    (-torch.nn.functional.logsigmoid(0.1 * margin).mean()).backward()
    torch.testing.assert_close(hidden.grad, h.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(weight.grad, w.grad, rtol=1e-4, atol=1e-6)
