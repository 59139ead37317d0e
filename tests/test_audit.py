"""The audit passes on the library, and fails, naming the cells, on a deliberately wrong loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from audits.__main__ import main
from compiled_grpo import objectives, quantile

SMALL = ["--only", "loss", "--modes", "eager", "--dtype", "float32"]


def test_audit_passes_on_the_library(tmp_path, capsys):
    assert main(SMALL + ["--loss-types", "bnpo,dapo", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "bnpo" in out and "dapo" in out
    assert (tmp_path / "audit.md").exists() and (tmp_path / "loss_error_heatmap.png").exists()


def test_audit_fails_on_an_off_by_one_normalizer(tmp_path, capsys, monkeypatch):
    make = objectives.make_normalizers

    def off_by_one(*args, **kwargs):
        n = make(*args, **kwargs)
        return dataclasses.replace(n, tokens=n.tokens + 1, items=n.items + 1)

    monkeypatch.setattr(objectives, "make_normalizers", off_by_one)
    assert main(SMALL + ["--loss-types", "bnpo,dapo,grpo", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out
    report = (tmp_path / "audit.md").read_text()
    failing = report.split("## Failing cells")[1].split("##")[0]
    assert "bnpo" in failing and "dapo" in failing and "grpo" not in failing  # grpo has no token normalizer


def test_audit_fails_on_a_per_chunk_entropy_threshold(tmp_path, capsys, monkeypatch):
    whole_batch = quantile.high_entropy_mask

    def per_row(entropy, mask, q, group=None, active=None):
        rows = [whole_batch(entropy[i : i + 1], mask[i : i + 1], q, group) for i in range(entropy.shape[0])]
        return torch.cat(rows)

    monkeypatch.setattr(quantile, "high_entropy_mask", per_row)
    assert main(SMALL + ["--loss-types", "dapo", "--out", str(tmp_path)]) == 1
    report = (tmp_path / "audit.md").read_text()
    assert "entropy_mask off-threshold flips" in report
    assert "NOT within rounding" in report


@pytest.mark.parametrize(
    "argv, valid",
    [
        (["--modes", "jit"], "eager, compiled"),
        (["--loss-types", "ppo"], "grpo"),
        (["--only", "bogus"], "loss, logprobs, quantile, entropy"),
        (["--only", ","], "loss, logprobs, quantile, entropy"),
        (["--modes", ""], "eager, compiled"),
    ],
)
def test_a_selection_that_checks_nothing_is_refused(argv, valid, tmp_path, capsys):
    """Never a PASS on zero cells: a non-zero exit, an error naming the valid values, no report written."""
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "valid values" in err and valid in err
    assert not (tmp_path / "audit.md").exists()


def test_captured_mode_needs_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--modes", "captured", "--out", str(tmp_path)])
    assert exit_info.value.code != 0 and "add --device cuda" in capsys.readouterr().err


def test_help_lists_the_values(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "loss, logprobs, quantile, entropy" in out and "eager, compiled" in out and "dapo" in out


def test_a_run_replaces_the_last_runs_report_and_plots(tmp_path):
    (tmp_path / "bf16_error_distribution.png").write_bytes(b"stale")
    (tmp_path / "notes.txt").write_text("kept")
    assert main(["--only", "quantile", "--out", str(tmp_path)]) == 0
    assert not (tmp_path / "bf16_error_distribution.png").exists()  # no bf16 cell ran: no bf16 plot
    assert (tmp_path / "notes.txt").read_text() == "kept"
    assert "quantile" in (tmp_path / "audit.md").read_text()


def test_primitive_audit_fails_when_the_entropy_gradient_is_dropped(tmp_path, monkeypatch):
    """A backward that never forms the entropy term fails the primitive's cells that have an entropy gradient,
    and only those."""
    from compiled_grpo.schedules import sparse_gradients

    keep_rows = sparse_gradients.rows_with_gradient

    def without_entropy_term(g_logp, g_entropy):
        return keep_rows(g_logp, g_entropy)[0], False

    monkeypatch.setattr(sparse_gradients, "rows_with_gradient", without_entropy_term)
    argv = ["--only", "logprobs", "--modes", "eager", "--dtype", "float32", "--out", str(tmp_path)]
    assert main(argv) == 1
    failing = (tmp_path / "audit.md").read_text().split("## Failing cells")[1].split("##")[0]
    assert "plain" in failing and "no entropy gradient" not in failing


def test_progress_lines_when_the_output_is_not_a_terminal(tmp_path, capsys):
    """CI logs and pipes get plain progress lines (the bar is drawn only on a terminal)."""
    assert main(["--only", "quantile", "--out", str(tmp_path)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[audit] ")]
    assert lines and lines[-1].startswith("[audit] ") and " done, " in lines[-1]
    done, total = lines[-1].split()[1].split("/")
    assert done == total


def test_the_progress_counter_counts_the_cells_reported():
    """Each audit advances its progress once per cell it reports, and says beforehand how many (`steps`)."""
    from audits import entropy_audit, quantile_audit

    for audit in (quantile_audit, entropy_audit):
        advanced = []
        results = audit.run(False, lambda: advanced.append(1))  # noqa: B023
        assert len(advanced) == len(results) == audit.steps(False), audit.__name__
