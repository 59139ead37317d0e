"""`benchmarks.gpu`'s parts that run without a GPU: the baselines written on full logits compute the loss the
reference computes (a mis-wired baseline would make every ratio against it meaningless), GPU-only heads say why
they do not run, captured rows run only where the trainer captures, and runs split over several calls join into
one table only when they ran the same versions."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu, gpu_methods

TINY = gpu.Shape("tiny", 8, 16, ragged=True, zero_advantage=True, H=64, V=512)


def weight_gradient(make, x, shape=TINY) -> torch.Tensor:
    x["weight"].grad = None
    make(shape, x)()
    return x["weight"].grad.float().clone()


SCENARIOS = {
    "ragged, half at advantage 0": (TINY, gpu_methods.METHODS),
    "q 0.2": (gpu.Shape("tiny-q0.2", 8, 16, q=0.2, H=64, V=512), gpu_methods.METHODS),
    "beta 0.04": (gpu.Shape("tiny-ref", 8, 16, beta=0.04, H=64, V=512), gpu_methods.METHODS),
    "fp32 head": (gpu.Shape("tiny-fp32", 8, 16, ragged=True, H=64, V=512, fp32_head=True), gpu_methods.FP32_METHODS),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_method_computes_the_same_loss(scenario, monkeypatch):
    """Every method that runs on a CPU gives the weight the gradient of one loss (full logits + autograd), within
    the bf16 weight gradient's rounding: the benchmark compares like with like (a dropped mask, a wrong
    normalization or a missing KL term in one method would show here)."""
    monkeypatch.setattr(torch, "compile", lambda fn=None, **_: fn if fn is not None else (lambda f: f))  # eager
    shape, methods = SCENARIOS[scenario]
    x = gpu.make_inputs(shape, device="cpu")
    expected = weight_gradient(gpu_methods.full_logits, x, shape)
    assert expected.abs().max() > 0
    compared = []
    for name, make in methods.items():
        if name.startswith("floor") or isinstance(make(shape, x), str):
            continue
        got = weight_gradient(make, x, shape)
        assert (got - expected).abs().max() <= 2e-2 * expected.abs().max(), name
        compared.append(name)
    assert len(compared) >= 5


def test_gpu_only_heads_say_why_on_a_cpu():
    x = gpu.make_inputs(TINY, device="cpu")
    for make in (gpu_methods.verl_triton_head, gpu_methods.liger_cute_head):
        assert isinstance(make(TINY, x), str)


def test_captured_rows_only_where_the_trainer_captures():
    from compiled_grpo.integrations.trl import CAPTURED_HIDDEN_SIZE

    made = gpu_methods.where_trainer_captures(lambda shape, x: "measured")
    assert made(gpu.SHAPES["H1536"], None) == "measured"
    assert gpu.SHAPES["S1"].H > CAPTURED_HIDDEN_SIZE
    assert made(gpu.SHAPES["S1"], None).startswith("not run")


def test_the_headline_names_exist():
    assert set(gpu_methods.HEADLINE) <= set(gpu_methods.METHODS)
    assert set(gpu.HEADLINE_SHAPES) <= set(gpu.SHAPES)


def test_a_shape_runs_end_to_end_on_a_cpu(tmp_path, monkeypatch):
    """run_shape -> ratios -> gpu.md, gpu.json and the picture, on a CPU (wall-clock times, no peaks): every
    method is a row, with its time or its reason, and the progress callback sees each one."""
    monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    names = ("floor: three lm_head GEMMs", "plain loss under torch.compile, no entropy", "TRL 1.16 fused head + loss",
             "verl 0.9.1 Triton head + loss", "compiled_grpo auto, compiled, captured")  # fmt: skip
    seen = []
    rows = gpu.run_shape(TINY, {n: gpu_methods.METHODS[n] for n in names}, 2, seen.append, device="cpu")
    assert [r["method"] for r in rows] == [r["method"] for r in seen] == list(names)
    assert [("ms" in r) for r in rows] == [True, True, True, False, True]  # capture runs uncaptured on a CPU
    assert rows[0]["x_floor"] == 1.0 and rows[2]["x_trl"] == 1.0 and all("seconds" in r for r in rows)
    gpu.write_run(rows, {"gpu": "CPU", "torch": torch.__version__, "repeats": 2}, tmp_path)
    table = (tmp_path / "gpu.md").read_text()
    assert "| verl 0.9.1 Triton head + loss | skipped: verl's Triton head runs on a GPU | | | |" in table
    assert (tmp_path / "gpu.png").stat().st_size > 0


def stored_run(path, shape, versions, methods=("floor: three lm_head GEMMs", "TRL 1.16 fused head + loss")):
    rows = [{"shape": shape, "method": m, "tokens": 8192, "ms": 10.0 + i, "peak_gib": 1.0, "status": "ok"}
            for i, m in enumerate(methods)]  # fmt: skip
    rows.append({"shape": shape, "method": "verl 0.9.1 Triton head + loss", "tokens": 8192, "status": "skipped"})
    path.write_text(json.dumps({"versions": versions, "rows": gpu.with_ratios(rows)}))
    return str(path)


def test_runs_of_one_set_of_versions_join_into_one_table(tmp_path):
    versions = {"gpu": "GPU", "torch": "2", "triton": "3", "trl": "1.16.0", "repeats": 10}
    a, b = stored_run(tmp_path / "a.json", "H896", versions), stored_run(tmp_path / "b.json", "S1", versions)
    gpu.main(["--combine", a, b, "--out", str(tmp_path / "out")])
    table = (tmp_path / "out" / "gpu.md").read_text()
    assert "## H896" in table and "## S1" in table
    assert "| TRL 1.16 fused head + loss | 11.0 | 1.10 | 1.00 | 1.00 |" in table
    assert "| verl 0.9.1 Triton head + loss | skipped | | | |" in table
    assert len(json.loads((tmp_path / "out" / "gpu.json").read_text())["rows"]) == 6
    other = stored_run(tmp_path / "c.json", "S3", {**versions, "torch": "3"})
    with pytest.raises(SystemExit):
        gpu.main(["--combine", a, other, "--out", str(tmp_path / "bad")])
    with pytest.raises(SystemExit):
        gpu.main(["--combine", a, a, "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def test_a_later_call_fills_a_skipped_baseline_in_its_place(tmp_path):
    """A call that measured only a baseline another call skipped: its row replaces the skipped one, in the methods'
    order, with `/ TRL` from the first call's TRL row; the shape keeps the first call's floor; the note is kept."""
    versions = {"gpu": "GPU", "torch": "2", "repeats": 10}
    a = stored_run(tmp_path / "a.json", "H896", versions)
    later = [{"shape": "H896", "method": m, "tokens": 8192, "ms": ms, "peak_gib": 1.0, "status": "ok"}
             for m, ms in (("floor: three lm_head GEMMs", 10.5), ("verl 0.9.1 Triton head + loss", 22.0))]  # fmt: skip
    (tmp_path / "b.json").write_text(json.dumps({"versions": versions, "rows": gpu.with_ratios(later)}))
    gpu.main(["--combine", a, str(tmp_path / "b.json"), "--out", str(tmp_path / "out"), "--note", "two calls"])
    run = json.loads((tmp_path / "out" / "gpu.json").read_text())
    methods = [r["method"] for r in run["rows"]]
    assert methods == ["floor: three lm_head GEMMs", "TRL 1.16 fused head + loss", "verl 0.9.1 Triton head + loss"]
    floor, _, verl = run["rows"]
    assert floor["ms"] == 10.0 and verl["x_trl"] == 2.0 and verl["x_floor"] == 22.0 / 10.5
    assert run["note"] == "two calls" and "Note: two calls" in (tmp_path / "out" / "gpu.md").read_text()


def test_readme_performance_tables_are_the_stored_runs(tmp_path):
    """README's performance numbers are the stored runs' (the generated tables), and the section's prose quotes
    none of its own; a hand-edited number turns the check red."""
    import re

    from benchmarks import headline

    assert headline.main(["--check"]) == 0
    readme = (headline.ROOT / "README.md").read_text()
    section = readme[readme.index("## Performance") : readme.index("## ", readme.index("## Performance") + 3)]
    prose = section[: section.index(headline.BEGIN)] + section[section.index(headline.END) :]
    assert not re.findall(r"\d+(?:\.\d+)?\s*(?:ms|GiB|x\b|%)", prose)  # a time, memory, ratio or share
    edited = tmp_path / "README.md"
    edited.write_text(readme.replace("| floor: three lm_head GEMMs | ", "| floor: three lm_head GEMMs | 1", 1))
    assert headline.main(["--check", "--readme", str(edited)]) == 1


def test_a_tables_caption_names_its_runs_dates_and_notes():
    from benchmarks import headline

    versions = {"gpu": "GPU", "torch": "2", "repeats": 9}
    runs = [{"versions": versions, "date": "2026-12-01"}, {"versions": versions, "date": "2026-12-03", "note": "n"}]
    assert headline.about(*runs) == "gpu GPU; torch 2; run 2026-12-01 to 2026-12-03; n"
    assert headline.about({"versions": versions}) == "gpu GPU; torch 2"
    with pytest.raises(ValueError, match="different versions"):
        headline.about(runs[0], {"versions": {**versions, "torch": "3"}})


def test_the_headline_step_runs_make_one_step_table(tmp_path):
    """Every model's `trl_step --headline` file makes one table of every model and batch, with each trainer's
    speed-up over GRPOTrainer."""
    import json

    from benchmarks import headline

    folder = tmp_path / "docs/benchmarks/trl-step"
    folder.mkdir(parents=True)
    versions = {"gpu": "H200", "torch": "2.11"}
    for m in headline.STEP_MODELS:
        rows = [{"shape": f"{m} tail x8 step/4", "method": t, "ms": ms, "peak_gib": 1.0, "gradient_checkpointing": True}
                for t, ms in (("grpo", 600.0), ("grpo-liger", 500.0), ("auto", 300.0))]  # fmt: skip
        (folder / f"trl-step-{m}-step4.json").write_text(json.dumps({"versions": versions, "rows": rows}))
    table = headline.train_step_table(tmp_path)
    assert "gradient checkpointing on" in table[0] and "--headline" in table[0]
    header = "| model, batch | GRPOTrainer | GRPOTrainer with Liger's kernels | CompiledGRPOTrainer (defaults) |"
    assert table[2] == header
    assert table[4] == "| 0.5B tail x8 step/4 | 600.0 (1.00) | 500.0 (1.00), 1.20x | 300.0 (1.00), 2.00x |"
    assert len(table) == 4 + len(headline.STEP_MODELS)
