"""Where a TRL step makes the host wait for the GPU: one step of each `benchmarks.trl_step` method under
`torch.cuda.set_sync_debug_mode("warn")`, which warns at every operation that synchronizes with the device; each
wait is reported with the innermost frames of the stack that are not torch's own, counted per place.

    python -m benchmarks.diagnostics.host_waits --model 0.5B --batch dense --trainers grpo,auto,captured [--out DIR]

In a step bound by the host's launch rate, every wait throws away the host's lead over the GPU: the kernels
queued behind it are no longer hidden behind the host's work. Writes `host-waits-<model>-<batch>.json`.
"""

from __future__ import annotations

import argparse
import collections
import json
import traceback
import warnings
from pathlib import Path

import torch

from benchmarks import trl_step

OWN = ("/torch/", "/site-packages/torch", "<frozen", "/warnings.py", "host_waits.py")


def where(limit: int = 4) -> str:
    """The innermost `limit` frames outside torch and this script, innermost first."""
    frames = [f for f in traceback.extract_stack() if not any(part in f.filename for part in OWN)]
    named = [f"{Path(f.filename).parent.name}/{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames]
    return " <- ".join(reversed(named[-limit:]))


def waits_of(step) -> collections.Counter:
    """{place: count} of the synchronizing operations one call of `step` makes."""
    found = collections.Counter()
    shown = warnings.showwarning

    def record(message, category, *args, **kwargs):
        if "synchroniz" in str(message):
            found[where()] += 1
        else:
            shown(message, category, *args, **kwargs)

    torch.cuda.synchronize()
    warnings.showwarning = record
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    return found


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(trl_step.QWEN), default="0.5B")
    ap.add_argument("--batch", choices=[b for b in trl_step.BATCHES if b != "varied"], default="dense")
    ap.add_argument("--size", type=int, default=8)
    ap.add_argument("--trainers", default="grpo,auto,captured")
    ap.add_argument("--out", default="benchmark-results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (on a CPU nothing waits)")
    model, vocab, completion = trl_step.make_model(args.model, "cuda")
    q, zero_half = trl_step.BATCHES[args.batch]
    inputs = trl_step.micro_batch(vocab, "cuda", args.size, zero_half, C=completion)
    report = {}
    for name in args.trainers.split(","):
        trainer = trl_step.make_trainer(name, model, args.size, q, True, completion)
        step = trl_step.trainer_step(trainer, [inputs])
        for _ in range(3):  # compiled, captured, warm
            step()
            model.zero_grad(set_to_none=True)
        found = waits_of(step)
        model.zero_grad(set_to_none=True)
        report[name] = dict(found.most_common())
        print(f"{name}: {sum(found.values())} waits in one step")
        for place, count in found.most_common():
            print(f"  {count:3d}  {place}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"host-waits-{args.model}-{args.batch}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
