"""An SFT step as TRL's SFTTrainer takes it: its fused LM head (TRL 1.16's chunked log-prob head, which the trainer
always uses) against the same trainer inside `compiled_fused_head()` (this library's primitive), with
`capture=True`, and with `round_logits=True` (TRL's head's numerics); `compute_loss` (the model's forward
included) + backward, time and peak memory, every method of a model in one process, taking turns round by round
(`benchmarks.trl_step.timed`).

Models: `benchmarks.trl_step`'s Qwen2.5 shapes with random bf16 weights; micro-batches of 8 sequences of 1088
tokens (a 64-token prompt whose labels are -100, then 1024 trained tokens).

    python -m benchmarks.sft_step --model 0.5B [--methods trl,compiled,captured,rounded] [--repeats 13] [--out DIR]
    python -m benchmarks.sft_step --report DIR/sft-step-*.json [--out docs/benchmarks/sft-step]

The first writes `sft-step-<model>.json` (rows as `benchmarks.trl_step`'s); `--model tiny` runs on the CPU (a smoke
test). `--report` joins such files into `sft-step.md` (each method's time against TRL's head) and `sft-step.png`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path

import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from benchmarks import plots, trl_step
from benchmarks.timing import run_date
from benchmarks.trl_step_rows import trl_head_after_a_wait
from compiled_grpo.integrations.trl import compiled_fused_head

METHODS = {  # name: the context the step runs in
    "trl": contextlib.nullcontext,
    "compiled": compiled_fused_head,
    "captured": lambda: compiled_fused_head(capture=True),
    "rounded": lambda: compiled_fused_head(round_logits=True),  # TRL's own numerics: the product rounded to bf16
    # a diagnostic: TRL's head after a host wait for the device (what one wait where the head starts costs the step)
    "trl-wait": trl_head_after_a_wait,
}


def make_trainer(model, size: int, on_gpu: bool) -> SFTTrainer:
    args = SFTConfig(output_dir="/tmp/sft-step", per_device_train_batch_size=size, report_to=[], save_strategy="no",
                     bf16=on_gpu, use_cpu=not on_gpu)  # fmt: skip
    data = Dataset.from_dict({"prompt": ["a"] * size, "completion": ["a"] * size})
    return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=trl_step.tokenizer())


def micro_batch(vocab: int, device, B: int, P=64, C=1024, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, P + C), generator=g)
    labels = ids.clone()
    labels[:, :P] = -100  # the prompt is not trained on
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    return {k: v.to(device) for k, v in inputs.items()}


def sft_step(trainer: SFTTrainer, inputs: dict, context):
    def step():
        with context(), trainer.accelerator.autocast():
            loss = trainer.compute_loss(trainer.model, dict(inputs))
        loss.backward()

    return step


def loss_of(trainer: SFTTrainer, inputs: dict, context) -> float:
    with torch.no_grad(), context(), trainer.accelerator.autocast():
        return float(trainer.compute_loss(trainer.model, dict(inputs)))


LABELS = {
    "trl": "TRL's fused head",
    "compiled": "compiled_fused_head()",
    "captured": "compiled_fused_head(capture=True)",
    "rounded": "compiled_fused_head(round_logits=True)",
    "trl-wait": "TRL's fused head after one host wait",
}


def report(files: list[str], out: Path) -> str:
    """sft-step.md and sft-step.png in `out` from the runs' JSON files; returns the table."""
    runs = [json.loads(Path(name).read_text()) for name in files]
    rows = [r for run in runs for r in run["rows"]]
    versions = runs[-1]["versions"]
    present = [name for name in METHODS if any(r["method"] == name for r in rows)]
    lines = [
        "# An SFT step: TRL's fused head against this library's primitive",
        "",
        f"{versions.get('gpu')}; torch {versions.get('torch')}. Random bf16 weights of each model's shape; 8 sequences "
        "of 64 prompt + 1024 trained tokens; `compute_loss` (the model's forward included) + backward, median of "
        f"{versions.get('repeats', '?')} rounds, methods taking turns; peak memory above the model and inputs.",
        "",
        "| model | " + " | ".join(LABELS[name] for name in present) + " |",
        "|---|" + "---|" * len(present),
    ]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = {r["method"]: r for r in rows if r["shape"] == shape}
        lines.append(f"| {shape} | " + " | ".join(cell(mine, name) for name in present) + " |")
    lines += ["", "![step time and peak memory](sft-step.png)", ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "sft-step.md").write_text("\n".join(lines))
    named = [{**r, "method": LABELS[r["method"]]} for r in rows if r["method"] in LABELS]
    plots.draw(named, out / "sft-step.png", f"SFT step, {versions.get('gpu')}: compute_loss + backward")
    return "\n".join(lines)


def cell(mine: dict, name: str) -> str:
    """Time and peak memory of a method, and its time against TRL's head's."""
    r, trl = mine.get(name), mine.get("trl", {})
    if r is None or "ms" not in r:
        return "-"
    text = f"{r['ms']:.1f} ms, {r['peak_gib']:.2f} GiB" if r.get("peak_gib") is not None else f"{r['ms']:.1f} ms"
    if name != "trl" and "ms" in trl:
        text += f" ({r['ms'] / trl['ms'] - 1:+.1%})"
    return text


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", nargs="+", default=None, help="sft-step-*.json files to join into a table and picture")
    ap.add_argument("--model", choices=list(trl_step.QWEN), default="0.5B")
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"of {list(METHODS)}")
    ap.add_argument("--repeats", type=int, default=13, help="rounds; each runs every method once")
    ap.add_argument("--out", default="benchmark-results")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report, Path(args.out)))
        return
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        ap.error(f"unknown methods {unknown}; methods: {list(METHODS)}")
    on_gpu = torch.cuda.is_available() and args.model != "tiny"
    device = "cuda" if on_gpu else "cpu"
    model, vocab, completion = trl_step.make_model(args.model, device)
    trainer = make_trainer(model, args.size, on_gpu)
    inputs = micro_batch(vocab, device, args.size, C=completion)
    shape = f"{args.model} SFT x{args.size}"
    steps = {name: sft_step(trainer, inputs, METHODS[name]) for name in args.methods.split(",")}
    losses = {name: loss_of(trainer, inputs, METHODS[name]) for name in steps}
    print("losses (the methods compute the same step):", json.dumps(losses), flush=True)
    reset = lambda: model.zero_grad(set_to_none=True)
    rows = []
    for method, measured in trl_step.timed(steps, args.repeats, on_gpu, reset).items():
        row = {"shape": shape, "model": args.model, "size": args.size, "method": method, "loss": losses[method]}
        rows.append(trl_step.with_measurement(row, measured))
        print(json.dumps(row), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    versions = {"gpu": torch.cuda.get_device_name() if on_gpu else "CPU", "torch": torch.__version__,
                "repeats": args.repeats}  # fmt: skip
    run = {"versions": versions, "date": run_date(), "rows": rows}
    (out / f"sft-step-{args.model}.json").write_text(json.dumps(run, indent=1))


if __name__ == "__main__":
    main()
