"""GPU benchmark: every method in one process, per shape, forward + backward of the whole loss.

The methods (benchmarks/gpu_methods.py): the three lm_head GEMMs over the active tokens alone (the floor); full
logits with autograd; the loss a user would write under plain torch.compile, with and without the entropy TRL
logs; TRL 1.16.0's fused LM head; Liger 0.8.5's GRPO loss and its Hopper CuTe head; Unsloth's head; verl 0.9.1's
Triton head; and this library's speed, memory and sparse schedules, eager and compiled, what "auto" picks, and
the primitive, at the default float32 product and rounded, and captured. Median of CUDA-event times after
warm-up; peak memory above what was allocated before the call (inputs, weights). A baseline that is not
installed, or a method that cannot run a shape, is reported as such, with the reason.

Scenarios beside the dense shapes: `-half0`, half the sequences at advantage 0 (every other group of 4
completions tied, as GRPO batches with frac_reward_zero_std = 0.5); `-q0.2`, top_entropy_quantile = 0.2.

    python -m benchmarks.gpu [--shapes S1,S2,S3,S1-q0.2,S1-ref,S1-half0,S1-q0.2-half0,...] [--repeats 10]
        [--out benchmark-results] [--methods "TRL;speed, compiled"] [--variants "sparse:sparse_tile=1024"]
    python -m benchmarks.gpu --headline [--shapes H896,H1536] --out part1   # docs/benchmarks/gpu.md's run
    python -m benchmarks.gpu --combine part1/gpu.json part2/gpu.json --out docs/benchmarks

`--headline` runs the headline shapes and methods (a subset of them with `--shapes`); `--combine` joins runs of
the same versions (a run split over several processes or machines' calls) into one gpu.md, gpu.json and gpu.png.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks import plots, unsloth_head, verl_triton
from benchmarks.gpu_methods import FP32_METHODS, HEADLINE, METHODS, ours
from benchmarks.timing import measure, run_date


@dataclass(frozen=True)
class Shape:
    name: str
    B: int
    T: int
    ragged: bool = False  # completion lengths uniform in [1, T]
    q: float = 1.0
    beta: float = 0.0  # with ref_hidden / ref_weight
    zero_advantage: bool = False  # half the sequences at advantage 0 (every other group of GROUP completions)
    H: int = 4096
    V: int = 151936
    fp32_head: bool = False  # a float32 lm_head weight against the bf16 hidden states (`cast_lm_head_to_fp32`)


GROUP = 4
SHAPES = {
    "S1": Shape("S1", 8, 1024),
    "S2": Shape("S2", 16, 1024, ragged=True),
    "S3": Shape("S3", 4, 8192),
    "S1-q0.2": Shape("S1-q0.2", 8, 1024, q=0.2),
    "S1-ref": Shape("S1-ref", 8, 1024, beta=0.04),
    "S1-q0.5": Shape("S1-q0.5", 8, 1024, q=0.5),
    "S1-half0": Shape("S1-half0", 8, 1024, zero_advantage=True),
    "S1-q0.2-half0": Shape("S1-q0.2-half0", 8, 1024, q=0.2, zero_advantage=True),
    "S3-q0.2": Shape("S3-q0.2", 4, 8192, q=0.2),
    "H896": Shape("H896", 8, 1024, H=896),  # Qwen2.5-0.5B's head
    "H1536": Shape("H1536", 8, 1024, H=1536),  # Qwen2.5-1.5B's head
    "H896-q0.2": Shape("H896-q0.2", 8, 1024, q=0.2, H=896),
    "H1536-q0.2": Shape("H1536-q0.2", 8, 1024, q=0.2, H=1536),
    "H8192": Shape("H8192", 4, 8192, H=8192, V=128256),  # a 70B-class head (Llama 3 70B), 32k tokens
    "H3584": Shape("H3584", 8, 1024, H=3584),  # Qwen2.5-7B's head
    # the fp32 head (ScaleRL's, TRL's `cast_lm_head_to_fp32`): the same batches, the weight in float32
    "H896-fp32": Shape("H896-fp32", 8, 1024, H=896, fp32_head=True),
    "H3584-fp32": Shape("H3584-fp32", 8, 1024, H=3584, fp32_head=True),
    "H4096-fp32": Shape("H4096-fp32", 8, 1024, fp32_head=True),
}
# the headline run: the hidden sizes most RL runs train, 8192 and 32768 tokens at H4096, the sparse batches
HEADLINE_SHAPES = ("H896", "H1536", "S1", "S3", "S1-q0.2", "S1-half0", "S1-q0.2-half0")


def make_inputs(shape: Shape, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    dev, dt, H, V = device, torch.bfloat16, shape.H, shape.V
    x = {
        "hidden": torch.randn(shape.B, shape.T, H, device=dev, dtype=dt, generator=g),
        "weight": (torch.randn(V, H, device=dev, dtype=dt, generator=g) * H**-0.5 * 2).requires_grad_(),
        "ids": torch.randint(0, V, (shape.B, shape.T), device=dev, generator=g),
        "advantages": torch.randn(shape.B, device=dev, generator=g),
    }
    if shape.zero_advantage:  # groups 0, 2, ... tied
        tied = (torch.arange(shape.B, device=dev) // GROUP) % 2 == 0
        x["advantages"] = torch.where(tied, 0.0, x["advantages"])
    if shape.ragged:
        lengths = torch.randint(1, shape.T + 1, (shape.B, 1), device=dev, generator=g)
        x["mask"] = (torch.arange(shape.T, device=dev) < lengths).long()
    else:
        x["mask"] = torch.ones(shape.B, shape.T, device=dev, dtype=torch.long)
    if shape.beta:
        x["ref_hidden"] = x["hidden"] + 0.01 * torch.randn(x["hidden"].shape, device=dev, dtype=dt, generator=g)
        x["ref_weight"] = x["weight"].detach() + 1e-3 * torch.randn(V, H, device=dev, dtype=dt, generator=g)
    if shape.fp32_head:
        x["weight"] = x["weight"].detach().float().requires_grad_()
    return x


def versions() -> dict:
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for pkg in ("triton", "trl", "liger-kernel", "nvidia-cutlass-dsl", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    out["unsloth_zoo"] = unsloth_head.WHEEL.name if unsloth_head.WHEEL.exists() else "not installed"
    out["verl"] = verl_triton.version()
    return out


def run_shape(shape: Shape, methods: dict, repeats: int, progress, device="cuda") -> list[dict]:
    x = make_inputs(shape, device=device)
    active = int(x["mask"].sum())
    rows = []
    for name, make in methods.items():
        torch._dynamo.reset()  # Liger 0.8.5's compiled graphs fail on a new shape in the same process otherwise
        row, started = {"shape": shape.name, "method": name, "tokens": active}, time.perf_counter()
        try:
            run = make(shape, x)
            if isinstance(run, str):
                row["status"] = run
            else:
                row["ms"], row["peak_gib"] = measure(run, x, repeats)
                row["status"] = "ok"
                if hasattr(run, "graph_pool_bytes"):  # reserved before the measured calls: not in their peak
                    row["graph_pool_gib"] = run.graph_pool_bytes() / 2**30
        except torch.OutOfMemoryError:
            row["status"] = "out of memory"
        except Exception as e:  # noqa: BLE001 - report, never drop silently
            row["status"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
        row["seconds"] = round(time.perf_counter() - started, 1)  # set-up and compiling included
        x["weight"].grad = None
        torch.cuda.empty_cache()
        progress(row)
        rows.append(row)
    return with_ratios(rows)


def with_ratios(rows: list[dict]) -> list[dict]:
    """Each timed row's ratio to its shape's floor and to TRL's head (the first row named so in that shape)."""
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape]
        floor_ms = next((r.get("ms") for r in mine if r["method"].startswith("floor")), None)
        trl_ms = next((r.get("ms") for r in mine if r["method"].startswith("TRL")), None)
        for r in mine:
            if "ms" in r:
                r["x_floor"] = r["ms"] / floor_ms if floor_ms else None
                r["x_trl"] = r["ms"] / trl_ms if trl_ms else None
    return rows


def printed_progress(total: int):
    """A callback that prints each row as a JSON line (stdout) and a count with its time (stderr)."""
    done = []

    def progress(row: dict) -> None:
        done.append(row)
        print(json.dumps(row), flush=True)
        timed = f"{row['ms']:.1f} ms" if "ms" in row else row["status"][:60]
        print(f"[{len(done)}/{total}] {row['shape']} {row['method']}: {timed} ({row['seconds']} s)", file=sys.stderr,
              flush=True)  # fmt: skip

    return progress


def ratio(value) -> str:
    return f"{value:.2f}" if value else "-"


def write_markdown(rows: list[dict], info: dict, out: Path, repeats: int, note: str | None = None) -> None:
    versions_line = ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("gpu", "repeats"))
    lines = [
        "# GPU benchmark",
        "",
        f"{info['gpu']}; {versions_line}. bf16, H=4096 and V=151936 unless the shape says otherwise, dapo, "
        f"forward + backward of the whole loss, median of {repeats} runs after 3 warm-ups (CUDA events); peak "
        "memory above the inputs. `/ floor` is against the three lm_head GEMMs over the active tokens, `/ TRL` "
        "against TRL 1.16.0's fused head + the same loss, both measured in the same run.",
        "",
        "Shapes: S1 B=8 T=1024 (all active); S2 B=16 T=1024, lengths uniform in [1, 1024]; S3 B=4 T=8192; "
        "S1-q0.2 S1 with top_entropy_quantile=0.2; S1-ref S1 with beta=0.04 and ref_hidden/ref_weight; -half0: "
        "every other group of 4 sequences at advantage 0; H896, H1536 and H3584: S1 with hidden size 896 "
        "(Qwen2.5-0.5B's head), 1536 (1.5B's) and 3584 (7B's); H8192: B=4 T=8192 with H=8192 and V=128256 (a "
        "70B-class head); -fp32: the lm_head weight in float32 against the bf16 hidden states (TRL's "
        "`cast_lm_head_to_fp32`), its floor three float32 GEMMs (TF32 off) and `/ TRL` against TRL's head in "
        "float32. `rounded`: `round_logits=True`; `captured`: `capture=True` (its graph pool beside the peak).",
        "",
        *([f"Note: {note}", ""] if note else []),
    ]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        lines += [f"## {shape} ({next(r['tokens'] for r in rows if r['shape'] == shape)} active tokens)", ""]
        lines += ["| method | time (ms) | / floor | / TRL | peak memory (GiB) |", "|---|---|---|---|---|"]
        for r in (r for r in rows if r["shape"] == shape):
            if "ms" in r:
                pool = f" + graph pool {r['graph_pool_gib']:.2f}" if "graph_pool_gib" in r else ""
                peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}{pool}"
                ratios = f"{ratio(r['x_floor'])} | {ratio(r['x_trl'])}"
                lines.append(f"| {r['method']} | {r['ms']:.1f} | {ratios} | {peak} |")
            else:
                lines.append(f"| {r['method']} | {r['status']} | | | |")
        lines.append("")
    lines += ["![time and peak memory per shape and method](gpu.png)", ""]
    (out / "gpu.md").write_text("\n".join(lines))


def write_run(rows: list[dict], info: dict, out: Path, date: str | None = None, note: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    run = {"versions": info, "date": date or run_date(), "rows": rows}
    (out / "gpu.json").write_text(json.dumps(run | ({"note": note} if note else {}), indent=1))
    write_markdown(rows, info, out, info["repeats"], note)
    plots.draw(rows, out / "gpu.png", plots.run_title(f"{info['gpu']}, bf16, dapo", rows))


def combined(paths: list[Path]) -> tuple[list[dict], dict, str | None]:
    """The rows of several runs, their one set of versions and the latest date. A later run may measure again a
    row that an earlier one skipped (a baseline whose libraries that call lacked): the measured row replaces the
    skipped one, keeps its own call's floor ratio, and takes its `/ TRL` from the TRL row beside it; a shape's floor
    is the first run's. Runs of other versions, or a (shape, method) measured twice, are refused (a table mixes no
    runs of different code or settings)."""
    runs = [json.loads(p.read_text()) for p in paths]
    info = runs[0]["versions"]
    for path, run in zip(paths, runs, strict=True):
        if run["versions"] != info:
            raise ValueError(f"{path} ran under {run['versions']}, {paths[0]} under {info}: not one run")
    rows = merged([r for run in runs for r in run["rows"]])
    seen = [(r["shape"], r["method"]) for r in rows]
    twice = sorted({k for k in seen if seen.count(k) > 1})
    if twice:
        raise ValueError(f"measured in more than one run: {twice}")
    date = max((run["date"] for run in runs if "date" in run), default=None)
    return in_method_order(filled_trl_ratios(rows)), info, date


def merged(rows: list[dict]) -> list[dict]:
    """The rows without those a later run measured after skipping them, and with one floor per shape (the first)."""
    measured = {(r["shape"], r["method"]) for r in rows if "ms" in r}
    kept, floors = [], set()
    for r in rows:
        is_floor = r["method"].startswith("floor")
        if ("ms" not in r and (r["shape"], r["method"]) in measured) or (is_floor and r["shape"] in floors):
            continue
        floors |= {r["shape"]} if is_floor else set()
        kept.append(r)
    return kept


def filled_trl_ratios(rows: list[dict]) -> list[dict]:
    """`/ TRL` for the timed rows of a call that did not time TRL's head, from the TRL row of their shape."""
    trl = {r["shape"]: r["ms"] for r in rows if r["method"].startswith("TRL") and "ms" in r}
    for r in rows:
        if "ms" in r and r.get("x_trl") is None and r["shape"] in trl:
            r["x_trl"] = r["ms"] / trl[r["shape"]]
    return rows


def in_method_order(rows: list[dict]) -> list[dict]:
    """Rows by shape (first seen first) and within a shape in the order its methods are declared."""
    shapes = {s: i for i, s in enumerate(dict.fromkeys(r["shape"] for r in rows))}

    def place(r: dict) -> tuple[int, int]:
        shape = SHAPES.get(r["shape"])
        order = list(FP32_METHODS if shape is not None and shape.fp32_head else METHODS)
        return shapes[r["shape"]], order.index(r["method"]) if r["method"] in order else len(order)

    return sorted(rows, key=place)


def chosen_methods(args) -> tuple[dict, dict]:
    """(METHODS, FP32_METHODS) narrowed to the headline's and to `--methods`, with `--variants` added."""
    methods, fp32_methods = dict(METHODS), dict(FP32_METHODS)
    if args.headline:
        methods = {name: methods[name] for name in HEADLINE}
    if args.methods:
        keep = [k for k in args.methods.split(";") if k]
        chosen = lambda name: name.startswith("floor") or any(k in name for k in keep)
        methods = {n: m for n, m in methods.items() if chosen(n)}
        fp32_methods = {n: m for n, m in fp32_methods.items() if chosen(n)}
    for variant in filter(None, args.variants.split(";")):
        schedule, _, knobs = variant.partition(":")
        tiles = {k: int(v) for k, v in (kv.split("=") for kv in filter(None, knobs.split(",")))}
        methods[f"compiled_grpo {schedule}, compiled, {knobs}"] = ours(schedule, True, **tiles)
    return methods, fp32_methods


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None, help=f"default: every shape ({', '.join(SHAPES)}); with --headline, "
                    f"its shapes ({', '.join(HEADLINE_SHAPES)})")  # fmt: skip
    ap.add_argument("--headline", action="store_true", help="the headline run's methods (and shapes)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--methods", default=None, help="';'-separated name substrings to keep (the floor always runs)")
    ap.add_argument(
        "--variants",
        default="",
        help="extra compiled runs of this library, ';'-separated, each 'schedule:knob=value,...' "
        "(e.g. 'memory:vocab_tile=16384;speed:speed_tile=1024')",
    )
    ap.add_argument("--combine", nargs="+", type=Path, default=None, help="gpu.json files to join (no GPU needed)")
    ap.add_argument(
        "--note", default=None, help="with --combine: a sentence on how the runs were made, kept in both files"
    )
    ap.add_argument("--out", default="benchmark-results", help="folder for gpu.md, gpu.json and gpu.png")
    return ap


def main(argv=None):
    ap = parser()
    args = ap.parse_args(argv)
    if args.combine:
        try:
            rows, info, date = combined(args.combine)
        except (ValueError, OSError, KeyError) as e:
            ap.error(f"--combine: {e}")
        return write_run(rows, info, Path(args.out), date, args.note)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (none is visible); on a CPU run `python -m benchmarks.cpu`")
    shapes = (args.shapes or ",".join(HEADLINE_SHAPES if args.headline else SHAPES)).split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; valid: {', '.join(SHAPES)}")
    methods, fp32_methods = chosen_methods(args)
    info = {**versions(), "repeats": args.repeats}
    print(json.dumps(info), flush=True)
    per_shape = {s: fp32_methods if SHAPES[s].fp32_head else methods for s in shapes}
    progress = printed_progress(sum(len(m) for m in per_shape.values()))
    rows = []
    for s in shapes:  # written after every shape: an interrupted run keeps what it measured
        rows += run_shape(SHAPES[s], per_shape[s], args.repeats, progress)
        write_run(rows, info, Path(args.out))


if __name__ == "__main__":
    main()
