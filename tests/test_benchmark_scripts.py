"""The GPU benchmarks' parts that run without a GPU: the profilers wrap the library's phases by name
(`benchmarks.diagnostics.profile_gpu.PHASES`, `benchmarks.diagnostics.profile_step.PHASES`), so a renamed
function must fail here, on the CPU, not on the GPU machine; the SFT step's report joins its runs' JSON into a
table and a picture; every step method has a label, and the diagnostic head after a host wait is TRL's; the
benchmarks users run import only public names."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("module", ["profile_gpu", "profile_step"])
def test_every_profiled_phase_exists(module):
    import importlib

    phases = importlib.import_module(f"benchmarks.diagnostics.{module}").PHASES
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


def test_verl_head_report_rewrites_a_stored_runs_table_without_a_gpu(tmp_path):
    import json

    from benchmarks import verl_head

    timed = (("floor: three lm_head GEMMs", 10.0), ("verl 0.9.1 Triton linear_cross_entropy", 20.0))
    rows = [{"shape": "dense", "method": m, "tokens": 16, "ms": ms, "peak_gib": 1.0, "x_floor": ms / 10.0}
            for m, ms in timed]  # fmt: skip
    stored = tmp_path / "verl.json"
    stored.write_text(json.dumps({"versions": {"gpu": "Some GPU", "torch": "2"}, "date": "2026-12-04", "rows": rows}))
    verl_head.main(["--report", str(stored), "--out", str(tmp_path / "out")])
    table = (tmp_path / "out" / "verl.md").read_text()
    assert "Some GPU, torch 2." in table and "| verl 0.9.1 Triton linear_cross_entropy | 20.0 | 2.00 | 1.00 |" in table
    assert json.loads((tmp_path / "out" / "verl.json").read_text())["date"] == "2026-12-04"


def test_every_step_method_has_a_label():
    from benchmarks import sft_step, trl_step_rows

    assert set(trl_step_rows.LABELS) == set(trl_step_rows.TRAINERS)
    assert set(sft_step.LABELS) == set(sft_step.METHODS)


def test_the_waiting_head_is_trls_and_is_put_back():
    """The diagnostic head (TRL's, after a host wait) computes what TRL's head computes, and TRL's own is back in
    place after the block."""
    import torch
    import trl.trainer.utils as trl_utils

    from benchmarks import trl_step_rows

    original = trl_utils._ChunkedLogProbFunction
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(10, 16, generator=g), torch.randn(50, 16, generator=g)
    targets = torch.randint(0, 50, (10,), generator=g)
    args = (hidden, weight, None, targets, 1.0, 32, None, 1.0, ("entropy",))
    with trl_step_rows.trl_head_after_a_wait():
        waiting = trl_utils._ChunkedLogProbFunction
        got = waiting.apply(*args)[:2]
    assert waiting is not original and trl_utils._ChunkedLogProbFunction is original
    for a, b in zip(got, original.apply(*args)[:2], strict=True):
        assert torch.equal(a, b)


def test_capture_layouts_counts_the_loss_s_graph_cache(tmp_path):
    """The layout simulation drives the loss's own graph cache: one layout repeated captures its graphs once and
    replays them; more layouts than the cache keeps capture again after being dropped."""
    from benchmarks.diagnostics import capture_layouts

    cycle = capture_layouts.simulate("cycle4", steps=12, batch=8, cap=1024, limit=16)
    # four layouts, each: its checks (the 1024-token batch only), its forward and its gradient pass
    assert cycle["distinct_keys"] == cycle["captures"] == cycle["uncaptured"]
    assert cycle["replayed"] == cycle["graph_calls"] - 2 * cycle["distinct_keys"]
    tight = capture_layouts.simulate("uniform", steps=60, batch=8, cap=1024, limit=2)
    assert tight["captures"] > tight["distinct_keys"]  # dropped graphs captured again
    capture_layouts.main(["--steps", "8", "--out", str(tmp_path)])
    assert "| cycle4 | 16 |" in (tmp_path / "capture-layouts.md").read_text()


USER_BENCHMARKS = (
    "gpu", "gpu_methods", "timing", "cpu", "trl_step", "sft_step", "verl_head", "verl_triton", "side_by_side", "plots",
    "unsloth_head", "train", "trl_step_batches", "trl_step_rows", "trl_step_report", "trl_step_processes",
)  # fmt: skip


@pytest.mark.parametrize("name", USER_BENCHMARKS)
def test_user_benchmarks_import_only_public_names(name):
    """What users run breaks only when the public API does: `compiled_grpo`'s exported names and
    `compiled_grpo.integrations.*`, no internal module and no diagnostic."""
    import ast
    from pathlib import Path

    import compiled_grpo

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    bad = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "compiled_grpo":
                bad += [a.name for a in node.names if a.name not in compiled_grpo.__all__]
            internal = node.module.startswith("compiled_grpo.") and not node.module.startswith("compiled_grpo.integ")
            if internal or node.module.startswith("benchmarks.diagnostics"):
                bad.append(node.module)
        elif isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.startswith("compiled_grpo.") and ".integrations" not in a.name]
    assert not bad, f"benchmarks/{name}.py imports internals: {bad}"


def test_split_product_study_runs_and_three_bf16_terms_reach_float32(tmp_path):
    """The fp32-head study on the CPU (errors only): three bf16 terms of an fp32 operand give its products within
    twice float32's rms error (cut into reduction chunks too), two terms (16 bits of the mantissa) within 64 times
    it, the bf16 head (8 bits) at least 100 times worse than two terms."""
    import json

    from benchmarks.diagnostics import split_product

    split_product.main(["--hidden", "64", "--tokens", "64", "--vocab", "1000", "--k-chunks", "16", "--out",
                        str(tmp_path)])  # fmt: skip
    rows = json.loads((tmp_path / "split-product.json").read_text())["rows"]
    rms = {(r["product"], r["method"]): r["rms_error"] for r in rows}
    for name in ("logits", "dX", "dW"):
        fp32 = rms[name, "fp32"]
        assert rms[name, "split3"] <= 2 * fp32 and rms[name, "split2"] <= 64 * fp32, name
        assert rms[name, "bf16"] >= 100 * rms[name, "split2"], name
        assert rms[name, "split3/k16"] <= 2 * fp32 and rms[name, "fp32/k16"] <= 2 * fp32, name
    assert "| split3 |" in (tmp_path / "split-product.md").read_text()


def test_precision_study_runs(tmp_path):
    """`benchmarks.diagnostics.precision` on the CPU: every setting's row, the bf16-rounded weight far from float64
    where float32 GEMMs are not."""
    import json

    from benchmarks.diagnostics import precision

    precision.main(["--hidden", "32", "--tokens", "64", "--vocab", "1000", "--out", str(tmp_path)])
    rows = {r["setting"]: r["errors"] for r in json.loads((tmp_path / "precision.json").read_text())["rows"]}
    assert len(rows) == 8 and "| bf16 weight, round_logits=True |" in (tmp_path / "precision.md").read_text()
    assert rows["fp32 weight rounded to bf16"]["logp"][1] > 100 * rows["fp32 weight, float32 GEMMs"]["logp"][1]


def test_train_benchmark_times_whole_train_runs_on_a_tiny_model_and_reports_them(tmp_path):
    """`benchmarks.train` on the CPU (a tiny Qwen2): each row a `train()` run in a process of its own, every step's
    wall clock split into generation and the rest; `--report` writes the table and the picture."""
    import json

    from benchmarks import train

    train.main(["--model", "tiny", "--steps", "3", "--rows", "grpo,grpo-compiled-decoding", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "train-tiny.json").read_text())["rows"]
    assert [r["row"] for r in rows] == ["grpo", "grpo-compiled-decoding"] and all("error" not in r for r in rows)
    for row in rows:
        assert len(row["steps"]) == 3 and all(0 < s["generation_s"] < s["wall_s"] for s in row["steps"])
        assert all(s["mean_completion"] > 0 for s in row["steps"])
        # GRPOTrainer compiles nothing outside generation; no CUDA graph on the CPU
        assert all(s["training_graphs"] == 0 and s["cuda_graphs"] == 0 for s in row["steps"]), row["steps"]
    other = json.loads((tmp_path / "train-tiny.json").read_text())  # the same runs as if on another machine
    other["versions"]["gpu"] = "another"
    (tmp_path / "other.json").write_text(json.dumps(other))
    train.main(
        ["--report", str(tmp_path / "train-tiny.json"), str(tmp_path / "other.json"), "--out", str(tmp_path / "out")]
    )
    table = (tmp_path / "out" / "train.md").read_text()
    assert "| tiny | cpu, " in table and "| tiny | another, " in table and "| GRPOTrainer | " in table
    own = [line.split(" | ") for line in table.splitlines() if line.startswith("| tiny |")]
    assert sorted(cells[1].split(",")[0] for cells in own if cells[2] == "GRPOTrainer") == ["another", "cpu"]
    assert all(cells[4] == "1.00x" for cells in own if cells[2] == "GRPOTrainer"), table  # each machine's own
    assert (tmp_path / "out" / "train.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        train.main(["--model", "tiny", "--rows", "grpo,nonsense"])


def test_a_train_row_stopped_in_its_profiled_step_keeps_its_timed_steps(tmp_path, monkeypatch):
    """`benchmarks.train` adds a row to its file before the row's profiled step (a time limit can stop a run there):
    the save comes as the step after the timed ones begins, the row is reported with its timed steps and marked."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    from benchmarks import train

    callbacks, saved = [], []
    train.keep_before(SimpleNamespace(add_callback=callbacks.append), 3, lambda: saved.append(len(saved)))
    for step in range(5):
        callbacks[0].on_step_begin(None, SimpleNamespace(global_step=step), None)
    assert saved == [0]  # once, as step 4 begins
    path = tmp_path / "train-tiny.json"
    path.write_text(json.dumps({"versions": {}, "rows": [{"row": "grpo", "model": "tiny", "error": "exit 1"}]}))
    steps = [{"wall_s": w, "generation_s": w / 2, "generation_graphs": 0} for w in (9.0, 8.0, 2.0, 4.0, 3.0)]
    train.keep_partial(path, {"row": "default", "model": "tiny", "steps": steps, "partial": train.PARTIAL})
    rows = json.loads(path.read_text())["rows"]
    assert [r["row"] for r in rows] == ["grpo", "default"]
    line = next(line for line in train.summary_lines(rows).splitlines() if train.PARTIAL in line)
    assert "| 3.00 | - | 1.50 |" in line  # the median of the steps after the first two, its generation

    def killed_in_profiled_step(command, **kwargs):  # a child that kept its timed steps, then was killed
        sweep_file = Path(command[command.index("--sweep-out") + 1])
        train.keep_partial(sweep_file, {"row": command[command.index("--child") + 1], "model": "tiny",
                                        "steps": steps, "partial": train.PARTIAL})  # fmt: skip
        return SimpleNamespace(returncode=-9)

    monkeypatch.setattr(train.subprocess, "run", killed_in_profiled_step)
    monkeypatch.setattr(train, "versions", dict)
    train.main(["--model", "tiny", "--rows", "grpo,default", "--out", str(tmp_path / "swept")])
    rows = json.loads((tmp_path / "swept" / "train-tiny.json").read_text())["rows"]
    kept = [(r["row"], r["error"], len(r["steps"])) for r in rows]
    assert kept == [(row, "exit -9", 5) for row in ("grpo", "default")]


def test_train_benchmark_long_prompt_workload(tmp_path):
    """`--workload long`: every prompt `LONG_PROMPT` tokens, the run named so and written apart."""
    import json

    from benchmarks import train

    train.main(["--model", "tiny", "--steps", "3", "--rows", "default-noshare", "--workload", "long", "--out",
                str(tmp_path)])  # fmt: skip
    (row,) = json.loads((tmp_path / "train-tiny-long.json").read_text())["rows"]
    assert row["model"] == f"tiny, {train.LONG_PROMPT}-token prompts" and len(row["steps"]) == 3
    assert row["shared_prompt_tokens"] == 0.0  # share_prompts=False


def test_packed_shapes_counts_the_shapes_the_library_packs(tmp_path):
    """`packed_shapes` counts what `packing.pack` gives on fixed capacities: each shape's length a capacity above the
    micro-batch's real tokens, coarser capacities padding more, its new shapes per step adding up to its count."""
    import json

    from benchmarks.diagnostics import packed_shapes
    from compiled_grpo.integrations.trl import packing

    rows = [(0, 100, 30)] * 8  # one group of 8: a 100-token prompt, completions of 30
    length, slots, keys, key_slots = packed_shapes.shape(rows, share=True)
    assert length == packing.capacity(99 + 8 * 31 + 1, packed_shapes.BUCKET) and slots == key_slots == 17
    assert keys >= 99 + 8 * (99 + 31)  # each completion's keys: the shared prompt, then its own tokens
    assert len(packed_shapes.shape(rows, share=False)) == 2  # packed apart: no keys of their own
    packed_shapes.main(["--steps", "4", "--seeds", "2", "--per-octave", "1,4", "--out", str(tmp_path)])
    found = json.loads((tmp_path / "packed-shapes-mixed.json").read_text())
    coarse, fine = found["rows"]
    assert coarse["padding"] > fine["padding"] > 0
    for row in found["rows"]:
        assert sum(row["new_per_step"]) == row["shapes"][0] and len(row["new_per_step"]) == 4
    assert (tmp_path / "packed-shapes-mixed.png").stat().st_size > 0


def test_readme_quick_start_times_are_the_stored_ci_runs():
    """README's quick-start table is written from docs/ci/quickstart.json, the .ci/run log that measured it."""
    from benchmarks import quickstart

    assert quickstart.main(["--check"]) == 0


def test_quick_start_times_are_read_from_a_ci_log_and_an_incomplete_log_is_refused():
    from benchmarks import quickstart

    log = """+ pip install -e ".[audit,test]" && python -m audits
PASS: 12/12 cells
[ci] 200 s: pip install -e ".[audit,test]" && python -m audits
+ python -m pytest -n 2
4000 passed, 80 skipped, 9 warnings in 600.12s (0:10:00)
[ci] 601 s: python -m pytest -n 2
[ci] 31 s: python examples/train_tiny_grpo.py
[ci] 3 s: python -m pytest -n 2
2 passed in 1.00s
[ci] total 900 s
"""
    run = quickstart.read_log(log)
    assert run["seconds"] == {'pip install -e ".[audit,test]" && python -m audits': 200,
                              "python -m pytest -n 2": 601, "python examples/train_tiny_grpo.py": 31}  # fmt: skip
    assert run["audit"] == "PASS: 12/12 cells" and run["tests"] == "4000 passed, 80 skipped, 9 warnings"
    assert run["total_s"] == 900
    table = quickstart.table({**run, "note": "a note", "date": "2026-12-04"})
    assert "| `python -m pytest -n 2` | 601 | 4000 passed, 80 skipped, 9 warnings |" in table
    with pytest.raises(ValueError, match="not a complete .ci/run log"):
        quickstart.read_log(log.replace("[ci] 31 s: python examples/train_tiny_grpo.py\n", ""))


def test_trl_step_times_micro_batches_and_whole_optimizer_steps_on_a_tiny_model(tmp_path):
    """`benchmarks.trl_step` on the CPU (a tiny Qwen2): one micro-batch per step, and a whole optimizer step over a
    generation batch of 2 micro-batches, each trainer's row written."""
    import json

    from benchmarks import trl_step

    common = [
        "--model",
        "tiny",
        "--sizes",
        "8",
        "--trainers",
        "grpo,skip-all",
        "--repeats",
        "1",
        "--out",
        str(tmp_path),
    ]
    trl_step.main([*common, "--batches", "zero75"])
    trl_step.main([*common, "--batches", "half0", "--generation", "2"])
    trl_step.main([*common, "--batches", "zero75", "--no-gradient-checkpointing"])
    runs = (("trl-step-tiny.json", "tiny zero75 x8", True), ("trl-step-tiny-step2.json", "tiny half0 x8 step/2", True),
            ("trl-step-tiny-nockpt.json", "tiny zero75 x8, no checkpointing", False))  # fmt: skip
    for name, shape, checkpointing in runs:
        rows = json.loads((tmp_path / name).read_text())["rows"]
        assert {r["method"] for r in rows} == {trl_step.BOUND, "grpo", "skip-all"}
        assert all(r["shape"] == shape and r["ms"] > 0 and r["ms_rounds"] == [r["ms"]] for r in rows)
        assert all(r["gradient_checkpointing"] is checkpointing for r in rows)


def test_trl_step_long_prompt_rows_share_their_prompts(tmp_path):
    """The `longprompt` kind: groups of `LONG_GROUP` rows of one long prompt, as TRL's generation batch holds them;
    a whole optimizer step of it runs for GRPOTrainer and `noshare` (on the CPU the default trims: the shared
    path's equality is tests/test_shared_prompts.py's)."""
    import json

    from benchmarks import trl_step, trl_step_batches
    from compiled_grpo.integrations.trl import plan

    batch = trl_step_batches.long_prompt_batch(1000, "cpu", 16)
    groups = plan.prompt_groups(batch["prompt_ids"], batch["prompt_mask"])
    assert groups.tolist() == [0] * 8 + [8] * 8 and batch["prompt_ids"].shape[1] == trl_step_batches.LONG_PROMPT
    trl_step.main(["--model", "tiny", "--sizes", "8", "--trainers", "grpo,noshare", "--repeats", "1", "--out",
                   str(tmp_path), "--batches", "longprompt", "--generation", "2"])  # fmt: skip
    rows = json.loads((tmp_path / "trl-step-tiny-step2.json").read_text())["rows"]
    assert {r["method"] for r in rows} == {trl_step.BOUND, "grpo", "noshare"} and all(r["ms"] > 0 for r in rows)


def test_trl_step_runs_each_batch_kind_and_trainer_in_a_process_of_its_own(tmp_path):
    """`--processes each` (the default on a GPU, where compiled layers are shared by the rows of one process): a
    child per batch kind and trainer, their rows gathered into one file, the bound timed by the shape's first child
    alone (`test_trl_step_resumes_where_its_file_stops`: by the first child of a shape that has none)."""
    import json

    from benchmarks import trl_step

    trl_step.main(["--model", "tiny", "--sizes", "8", "--trainers", "grpo,grpo-wait", "--repeats", "1", "--out",
                   str(tmp_path), "--batches", "zero75", "--processes", "each"])  # fmt: skip
    rows = json.loads((tmp_path / "trl-step-tiny.json").read_text())["rows"]
    assert [r["method"] for r in rows] == [trl_step.BOUND, "grpo", "grpo-wait"]
    assert all(r["shape"] == "tiny zero75 x8" for r in rows)
    bound, grpo, waiting = (r["process"] for r in rows)
    assert bound == grpo != waiting and all(r["ms"] > 0 for r in rows)


def test_trl_step_says_which_child_died_before_writing_its_row(tmp_path, monkeypatch):
    """A child that exits without its row leaves a row that says so, and the rows of the others stay."""
    import json
    import subprocess

    from benchmarks import trl_step

    monkeypatch.setattr(subprocess, "run", lambda command, check: subprocess.CompletedProcess(command, 9))
    trl_step.main(["--model", "tiny", "--sizes", "8", "--trainers", "grpo,auto", "--repeats", "1", "--out",
                   str(tmp_path), "--batches", "tail", "--generation", "2", "--processes", "each"])  # fmt: skip
    rows = json.loads((tmp_path / "trl-step-tiny-step2.json").read_text())["rows"]
    assert [(r["shape"], r["method"], r["size"]) for r in rows] == [("tiny tail x8 step/2", "grpo", 8),
                                                                    ("tiny tail x8 step/2", "auto", 8)]  # fmt: skip
    assert all("exited with code 9" in r["status"] for r in rows)


def test_trl_step_resumes_where_its_file_stops(tmp_path, monkeypatch):
    """`--resume`: the rows the file holds are kept and their children not run again, a failed row is timed again,
    and the bound is timed by the first child of a shape that has none."""
    import json
    import subprocess

    from benchmarks import trl_step

    shape = "tiny tail x8 step/2"
    row = {"shape": shape, "model": "tiny", "batch": "tail", "size": 8}
    held = [{**row, "method": "grpo", "ms": 5.0}, {**row, "method": "auto", "status": "failed"}]
    (tmp_path / "trl-step-tiny-step2.json").write_text(json.dumps({"versions": {}, "date": "d", "rows": held}))
    commands = []
    monkeypatch.setattr(subprocess, "run", lambda command, check: commands.append(command)
                        or subprocess.CompletedProcess(command, 1))  # fmt: skip
    trl_step.main(["--model", "tiny", "--sizes", "8", "--trainers", "grpo,auto,noshare", "--repeats", "1", "--out",
                   str(tmp_path), "--batches", "tail", "--generation", "2", "--processes", "each",
                   "--resume"])  # fmt: skip
    assert [c[c.index("--trainers") + 1] for c in commands] == ["auto", "noshare"]
    assert ["--no-bound" in c for c in commands] == [False, False]  # no bound row held, and the first child failed
    rows = json.loads((tmp_path / "trl-step-tiny-step2.json").read_text())["rows"]
    assert [(r["method"], r.get("ms")) for r in rows] == [("grpo", 5.0), ("auto", None), ("noshare", None)]


def test_profile_step_names_the_trainers_parts_and_writes_python_profiles(tmp_path, monkeypatch):
    """`profile_step` on a tiny model: each method's phases, the trainer's own parts among them, from the plans made
    before timing (as the generation batch makes them in training: the masks read once, not in every step), and with
    `--python` each method's host profile by function."""
    import json

    from benchmarks.diagnostics import profile_step
    from compiled_grpo.integrations.trl import plan

    reads, read = [], plan.read
    monkeypatch.setattr(plan, "read", lambda *a, **k: reads.append(1) or read(*a, **k))
    profile_step.main(["--model", "tiny", "--batch", "tail", "--trainers", "grpo,trim", "--steps", "1", "--python",
                       "--out", str(tmp_path)])  # fmt: skip
    assert len(reads) == 1  # the one CompiledGRPOTrainer's plans, made before its steps
    phases = json.loads((tmp_path / "profile-step-tiny-tail.json").read_text())["trim"]["phases"]
    assert "forward, packed or padded, the model's included (trainer)" in phases
    for name in ("grpo", "trim"):
        text = (tmp_path / f"python-profile-tiny-tail-{name}.txt").read_text()
        assert "_compute_loss" in text and "cumulative" in text


def test_trl_step_checkpoints_as_train_does(tmp_path):
    """The benchmark's trainers turn the model's gradient checkpointing on as `train()` does (GRPOConfig's default),
    with the config's kwargs, or off."""
    from benchmarks import trl_step

    model, _, completion = trl_step.make_model("tiny", "cpu")
    trl_step.make_trainer("grpo", model, 8, 1.0, False, completion)
    layer = model.model.layers[0]
    assert model.is_gradient_checkpointing and layer.gradient_checkpointing and model.training
    trl_step.make_trainer("grpo", model, 8, 1.0, False, completion, checkpointing=False)
    assert not model.is_gradient_checkpointing and not layer.gradient_checkpointing


def test_one_micro_batch_steps_compile_the_trainers_layers_as_train_does(monkeypatch):
    """A step of one micro-batch calls `_compute_loss` without `_prepare_inputs`, where `train()` compiles the
    layers (`compile_backbone`): the benchmark's step compiles them first, or its rows would time eager layers."""
    from benchmarks import trl_step
    from compiled_grpo.integrations.trl import regional_compile

    model, _, completion = trl_step.make_model("tiny", "cpu")
    trainer = trl_step.make_trainer("trim-backbone", model, 8, 1.0, False, completion)

    def stop(model, inputs):
        raise RuntimeError("the loss was reached")

    monkeypatch.setattr(trainer, "_compute_loss", stop)
    with pytest.raises(RuntimeError, match="the loss was reached"):
        trl_step.trainer_step(trainer, [{}])()
    assert regional_compile.compiled(trainer.backbone_layers)
    regional_compile.uncompile(trainer.backbone_layers)


def test_trl_step_headline_takes_its_batches_and_trainers_unless_given(monkeypatch):
    from benchmarks import trl_step

    seen = []
    monkeypatch.setattr(trl_step, "sweep", seen.append)
    trl_step.main(["--model", "tiny", "--headline"])
    trl_step.main(["--model", "tiny", "--headline", "--trainers", "grpo"])
    trl_step.main(["--model", "tiny"])
    trl_step.main(["--model", "tiny", "--headline", "--generation", "2"])
    assert [(a.batches, a.sizes, a.trainers, a.generation) for a in seen] == [
        (trl_step.HEADLINE["batches"], "8", trl_step.HEADLINE["trainers"], 4),
        (trl_step.HEADLINE["batches"], "8", "grpo", 4),
        (",".join(trl_step.BATCHES), "8,16", trl_step.DEFAULT_TRAINERS, 0),
        (trl_step.HEADLINE["batches"], "8", trl_step.HEADLINE["trainers"], 2),
    ]
    assert "tail" in trl_step.HEADLINE["batches"] and "grpo-liger" in trl_step.HEADLINE["trainers"]


def test_a_rows_compiled_layers_run_in_its_own_steps_only():
    """The rows share one model: layers compiled by hand for one row, or by the trainer inside another row's step
    (compile_backbone), run compiled in that row's steps only."""
    from benchmarks import trl_step

    model, _, _ = trl_step.make_model("tiny", "cpu")
    layers, seen = model.model.layers, []
    look = lambda: seen.append([layer._compiled_call_impl is not None for layer in layers])  # noqa: E731

    def compiles_in_its_step():
        if layers[0]._compiled_call_impl is None:
            for layer in layers:
                layer.compile()
        look()

    by_hand = trl_step.with_own_layer_calls(model, look, by_hand=True)
    eager = trl_step.with_own_layer_calls(model, look)
    trainer = trl_step.with_own_layer_calls(model, compiles_in_its_step)
    for step in (by_hand, eager, trainer, eager, trainer, by_hand):
        step()
    assert seen == [[True, True], [False, False], [True, True], [False, False], [True, True], [True, True]]
    assert all(layer._compiled_call_impl is None for layer in layers)


def test_a_method_that_fails_is_reported_and_the_others_timed():
    from benchmarks import trl_step

    def boom():
        raise RuntimeError("replay overwritten\nmore")

    measured = trl_step.timed({"ok": lambda: None, "bad": boom}, rounds=2, on_gpu=False, reset=lambda: None)
    assert measured["bad"] == "failed: RuntimeError: replay overwritten"
    assert len(measured["ok"][3]) == 2
    assert trl_step.with_measurement({}, measured["bad"]) == {"status": "failed: RuntimeError: replay overwritten"}


def test_a_rows_inductor_config_holds_in_its_own_steps_only():
    """The C++-wrapper row compiles its layers under `cpp_wrapper`, the CUDA-graph row under `triton.cudagraphs`;
    the config is as it was outside their steps."""
    import torch

    from benchmarks import trl_step

    seen = []
    look = lambda: seen.append((torch._inductor.config.cpp_wrapper, torch._inductor.config.triton.cudagraphs))  # noqa: E731
    for name in ("auto-cpp-wrapper", "auto-cudagraphs"):
        trl_step.with_inductor_config(look, trl_step.inductor_options(name))()
    look()
    assert seen == [(True, False), (False, True), (False, False)]
    assert trl_step.inductor_options("auto") == {}


def test_the_liger_row_patches_liger_in_for_its_own_steps_only():
    """Liger's kernels patched in as `train()` patches them (the model's RMSNorm and MLP forwards, the modeling
    file's RoPE) inside the row's steps, and the shared model as it was after each."""
    import sys

    needs = 'Liger\'s kernels need liger-kernel and Triton: `pip install -e ".[liger]"` (.ci/run runs this test so)'
    pytest.importorskip("liger_kernel.transformers", reason=needs)

    from benchmarks import trl_step

    model, _, _ = trl_step.make_model("tiny", "cpu")
    modeling = sys.modules[type(model).__module__]
    rope, seen = modeling.apply_rotary_pos_emb, []

    def look():
        forwards = (model.model.norm.forward, model.model.layers[0].mlp.forward, modeling.apply_rotary_pos_emb)
        seen.append([getattr(f, "__func__", f).__qualname__ for f in forwards])

    liger = trl_step.with_liger_kernels(model, {"fused_linear_cross_entropy": False}, look)
    plain = trl_step.with_own_layer_calls(model, look)
    for step in (liger, plain, liger):
        step()
    assert seen[0] == seen[2] == ["LigerRMSNorm.forward", "LigerSwiGLUMLP.forward", "liger_rotary_pos_emb"], seen
    assert seen[1] == ["Qwen2RMSNorm.forward", "Qwen2MLP.forward", "apply_rotary_pos_emb"], seen
    assert "forward" not in vars(model.model.norm) and modeling.apply_rotary_pos_emb is rope


def test_layer_call_costs_run_each_row_in_its_own_process(tmp_path):
    """`benchmarks.diagnostics.layer_calls` on the CPU, the eager row (nothing to compile): a child's per-call times
    come back and are written; an unknown row is refused. Their order is not asserted: on a loaded two-core host a
    forward can take longer than a step measured a moment later."""
    import json

    from benchmarks.diagnostics import layer_calls

    layer_calls.main(["--rows", "eager", "--layers", "2", "--repeats", "3", "--out", str(tmp_path)])
    (row,) = json.loads((tmp_path / "layer-calls-cpu.json").read_text())["rows"]
    assert row["row"] == "eager" and row["forward_us"] > 0 and row["step_us"] > 0, row
    with pytest.raises(SystemExit):
        layer_calls.main(["--rows", "eager,fast", "--out", str(tmp_path)])


def test_nested_region_cases_run_each_in_its_own_process(capsys):
    """`benchmarks.diagnostics.nested_regions` under AOTAutograd's eager backend (no Inductor: exact): each case's
    errors come back from its child, zero, no block off; an unknown case is refused."""
    import json

    from benchmarks.diagnostics import nested_regions

    nested_regions.main(["--cases", "baseline,frozen-block", "--blocks", "3", "--backend", "aot_eager"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()[1:]]
    assert [row["case"] for row in rows] == ["baseline", "frozen-block"], rows
    assert all(row["worst_gradient_error"] == 0.0 and row["blocks_off"] == [] for row in rows), rows
    with pytest.raises(SystemExit):
        nested_regions.main(["--cases", "baseline,fast"])


def test_the_trl_step_report_keeps_one_bound_row_per_shape():
    """Runs of one trainer per process each measure the bound: the joined table and picture show the first."""
    from benchmarks.trl_step_report import one_bound_per_shape
    from benchmarks.trl_step_rows import BOUND

    rows = [{"shape": "a", "method": BOUND, "ms": 1.0}, {"shape": "a", "method": "grpo"},
            {"shape": "a", "method": BOUND, "ms": 2.0}, {"shape": "b", "method": BOUND, "ms": 3.0}]  # fmt: skip
    kept = one_bound_per_shape(rows)
    assert [(r["shape"], r["method"], r.get("ms")) for r in kept] == [
        ("a", BOUND, 1.0),
        ("a", "grpo", None),
        ("b", BOUND, 3.0),
    ]


def test_the_decoding_diagnostic_calls_generate_as_grpo_trainer_does():
    """`benchmarks.diagnostics.decoding`'s prompts are left-padded to the longest (masked where padded) and its rows'
    configs are TRL's sampling one, eager on a dynamic cache or compiled on a static cache pinned to the prompt
    bucket + the new tokens; without a GPU it refuses to run (it times CUDA graphs), as it does an unknown row."""
    import torch

    from benchmarks.diagnostics import decoding

    inputs = decoding.prompts(5, 1000, "cpu")
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert ids.shape == mask.shape and int(mask.sum(1).max()) == ids.shape[1] and bool(mask[:, -1].all())
    assert bool(((ids == 0) == (mask == 0)).all()) and bool((mask.diff(dim=1) >= 0).all())  # padding on the left
    eager, compiled = (decoding.generation_config(row, 64, 200) for row in ("eager", "compiled"))
    assert eager.disable_compile and eager.cache_implementation is None and eager.do_sample
    assert not compiled.disable_compile and compiled.cache_implementation == "static"
    assert compiled.max_cache_len == 256 + 64 and compiled.compile_config.mode == "reduce-overhead"
    for argv in (["--rows", "compiled,fast"], [] if not torch.cuda.is_available() else None):
        if argv is not None:
            with pytest.raises(SystemExit):
                decoding.main(argv)
