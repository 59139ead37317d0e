"""CPU benchmark: the fused loss eager vs compiled, against the three lm_head GEMMs over the active tokens (the
floor), full logits with autograd, and TRL 1.16.0's CPU path (its fused head scores every position on a
device without Triton) followed by the same loss.

Shape: fp32, B=4, T=256, H=512, V=32000, positions 200+ of every row padded (800 active tokens),
dapo, forward + backward. Medians over --repeats runs after warm-up, every method in this process.
Scenarios where part of the batch has no gradient, against the dense speed schedule of the same run:
top_entropy_quantile 0.2, half the sequences at advantage 0, and both.

    python -m benchmarks.cpu [--repeats 10] [--out benchmark-results]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from benchmarks import plots
from benchmarks.timing import run_date
from compiled_grpo import FusedLinearGRPOLoss

# (settings, rows at advantage 0) of the scenarios run beside the dense batch
SCENARIOS = {
    "q=0.2": ({"top_entropy_quantile": 0.2}, 0),
    "half the sequences at advantage 0": ({}, 2),
    "q=0.2, half at advantage 0": ({"top_entropy_quantile": 0.2}, 2),
}


def make_batch(B=4, T=256, H=512, V=32000, active=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g) / H**0.25
    weight = torch.randn(V, H, generator=g) / H**0.5
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    mask[:, :active] = 1
    return hidden, weight, ids, mask, torch.randn(B, generator=g)


def gemm_floor(hidden, weight, ids, mask, adv):
    """The three GEMMs any exact method must do over the active tokens: logits, dX and dW."""
    x = hidden.reshape(-1, hidden.shape[-1])[mask.reshape(-1).bool()]
    z = x @ weight.T
    _ = z @ weight
    _ = z.T @ x


def same_loss(logp, entropy, mask, adv):
    import reference

    return reference.grpo_objective(logp, entropy, mask, adv, loss_type="dapo").loss


def full_logits(hidden, weight, ids, mask, adv):
    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    log_p = torch.log_softmax(h @ w.T, -1)
    logp = log_p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    same_loss(logp, -(log_p.exp() * log_p).sum(-1), mask, adv).backward()


def trl_cpu_path():
    """TRL 1.16.0's fused head as it runs on a CPU (every position scored), then the same loss; None if absent."""
    try:
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
    except Exception:  # noqa: BLE001 - not installed
        return None

    def run(hidden, weight, ids, mask, adv):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        flat = h.reshape(-1, h.shape[-1])
        logp, entropy, *_ = ChunkedLogProbFunction.apply(flat, w, None, ids.reshape(-1), 1.0, chunk, None, 1.0,
                                                         ("entropy",))  # fmt: skip
        m = mask.bool()
        same_loss(logp.view(m.shape).masked_fill(~m, 0), entropy.view(m.shape).masked_fill(~m, 0), mask, adv).backward()

    return run


def primitive(compiled: bool):
    """`fused_linear_logprobs` with the same loss on top (ignored targets where the mask is 0)."""
    from compiled_grpo import fused_linear_logprobs

    def run(hidden, weight, ids, mask, adv):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        targets = torch.where(mask.bool(), ids, -100)
        logp, entropy = fused_linear_logprobs(h, w, targets, compiled=compiled)
        same_loss(logp, entropy, mask, adv).backward()

    return run


def fused(loss_fn):
    def run(hidden, weight, ids, mask, adv):
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        loss_fn(h, w, ids, mask, adv).loss.backward()

    return run


def scenario_rows(batch, repeats: int, dense) -> list[dict]:
    """Each scenario with every valid compiled schedule and auto, each timed in rounds alternating with `dense` (the
    compiled speed schedule on the dense batch): `x_dense` is the median of the rounds' ratios, which a drift of this
    machine's speed between one method's runs and the next's does not move (runs of a method one after another, then
    the next method's, moved the q=0.2 ratio by +-0.1 on a shared 2-core machine)."""
    rows = []
    for scenario, (settings, zero_rows) in SCENARIOS.items():
        hidden, weight, ids, mask, adv = batch
        adv = adv.clone()
        adv[adv.numel() - zero_rows :] = 0.0
        for schedule in ("speed", "sparse", "memory", "auto"):
            if schedule == "speed" and settings:
                continue
            fn = fused(FusedLinearGRPOLoss(compiled=True, schedule=schedule, loss_type="dapo", **settings))
            t, ratio = alternating(fn, (hidden, weight, ids, mask, adv), dense, batch, repeats)
            row = {"shape": scenario, "method": f"compiled_grpo {schedule}, compiled", "ms": t * 1e3, "x_dense": ratio}
            print(f"{scenario:40s} {schedule:7s} {t * 1e3:8.1f} ms, {ratio:.2f}x the dense speed", flush=True)
            rows.append(row)
    return rows


def seconds(fn, batch) -> float:
    t0 = time.perf_counter()
    fn(*batch)
    return time.perf_counter() - t0


def median_seconds(fn, batch, repeats, warmup=2):
    for _ in range(warmup):
        fn(*batch)
    return statistics.median(seconds(fn, batch) for _ in range(repeats))


def alternating(fn, batch, dense, dense_batch, repeats, warmup=2) -> tuple[float, float]:
    """(median seconds of fn, median over rounds of fn's time / dense's time in the same round)."""
    for _ in range(warmup):
        fn(*batch)
    rounds = [(seconds(dense, dense_batch), seconds(fn, batch)) for _ in range(repeats)]
    return statistics.median(t for _, t in rounds), statistics.median(t / d for d, t in rounds)


DENSE = "dense (800 active tokens)"
FLOOR_NAME = "floor: three lm_head GEMMs over active tokens"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="benchmark-results", help="folder for cpu.md, cpu.json and cpu.png")
    args = ap.parse_args(argv)
    batch = make_batch()
    methods = {
        FLOOR_NAME: gemm_floor,
        "full logits + autograd": full_logits,
        "TRL 1.16 CPU path + loss": trl_cpu_path(),
        "compiled_grpo speed, eager": fused(FusedLinearGRPOLoss(compiled=False, schedule="speed")),
        "compiled_grpo speed, compiled": fused(FusedLinearGRPOLoss(compiled=True, schedule="speed")),
        "compiled_grpo memory, eager": fused(FusedLinearGRPOLoss(compiled=False, schedule="memory")),
        "compiled_grpo memory, compiled": fused(FusedLinearGRPOLoss(compiled=True, schedule="memory")),
        "compiled_grpo primitive + loss, eager": primitive(compiled=False),
        "compiled_grpo primitive + loss, compiled": primitive(compiled=True),
    }
    results = {}
    for name, fn in methods.items():
        if fn is None:
            print(f"{name:50s} skipped: not installed", flush=True)
            continue
        results[name] = median_seconds(fn, batch, args.repeats)
        print(f"{name:50s} {results[name] * 1e3:8.1f} ms", flush=True)
    floor = results[FLOOR_NAME]
    rows = [{"shape": DENSE, "method": name, "ms": t * 1e3} for name, t in results.items()]
    scenarios = scenario_rows(batch, args.repeats, methods["compiled_grpo speed, compiled"])
    for scenario in SCENARIOS:  # the dense batch's floor beside each scenario, for the picture's line
        rows.append({"shape": scenario, "method": "floor: the dense batch's", "ms": floor * 1e3})
        rows += [r for r in scenarios if r["shape"] == scenario]
    info = {"cpu": f"{platform.machine()} CPU, {torch.get_num_threads()} threads", "torch": torch.__version__,
            "trl": md.version("trl") if "TRL 1.16 CPU path + loss" in results else "not installed"}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = {"versions": info, "date": run_date(), "rows": rows}
    (out / "cpu.json").write_text(json.dumps(run, indent=1))
    title = plots.run_title(f"{info['cpu']}, fp32, B=4 T=256 H=512 V=32000, torch {torch.__version__}", rows)
    plots.draw(rows, out / "cpu.png", title)
    lines = markdown(results, scenarios, args.repeats, info)
    (out / "cpu.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'cpu.md'}, cpu.json, cpu.png")


def markdown(results: dict, scenarios: list[dict], repeats: int, info: dict) -> list[str]:
    floor = results[FLOOR_NAME]
    lines = [
        "# CPU benchmark: eager vs compiled",
        "",
        f"fp32, B=4, T=256, H=512, V=32000, 800 active tokens, dapo, forward + backward; median of {repeats}"
        f" runs. torch {info['torch']}, {info['cpu']}.",
        "",
        "| method | time (ms) | / floor |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {t * 1e3:.1f} | {t / floor:.2f} |" for name, t in results.items()]
    eager, comp = results["compiled_grpo speed, eager"], results["compiled_grpo speed, compiled"]
    lines += ["", f"compiled is {eager / comp:.2f}x faster than eager (speed schedule)."]
    p_eager, p_comp = (
        results["compiled_grpo primitive + loss, eager"],
        results["compiled_grpo primitive + loss, compiled"],
    )
    lines += [f"the compiled primitive (with the loss on top) is {p_eager / p_comp:.2f}x faster than its eager run."]
    trl = results.get("TRL 1.16 CPU path + loss")
    if trl:
        lines += [f"compiled speed schedule is {trl / comp:.2f}x faster than TRL's CPU path (TRL {info['trl']})."]
    lines += [
        "",
        "## Batches where part of the tokens have no gradient",
        "",
        "Compiled; `/ dense speed`: the median over rounds of the time against the compiled speed schedule on the "
        "dense batch above (all 800 tokens with a gradient) in the same round.",
        "",
        "| scenario | schedule | time (ms) | / dense speed |",
        "|---|---|---|---|",
    ]
    lines += [f"| {r['shape']} | {r['method'].split()[1].rstrip(',')} | {r['ms']:.1f} | "
              f"{r['x_dense']:.2f} |" for r in scenarios]  # fmt: skip
    lines += ["", "![time per scenario and method](cpu.png)"]
    return lines


if __name__ == "__main__":
    main()
