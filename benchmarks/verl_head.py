"""verl-shaped GPU benchmark: the fused head's forward + backward as verl's actor uses it, for verl 0.9.1's Triton
`linear_cross_entropy`, verl's torch backend (`FusedLinearForPPO`) and this library's adapter
(`compiled_grpo.integrations.verl.linear_cross_entropy`), in one process, beside the three lm_head GEMMs.

The batch: padding-removed, one row of 16 sequences of 1024 tokens (16384 positions), the first third of each
sequence prompt; GRPO groups of 4 with every other group's rewards tied (advantage 0); bf16, H=4096, V=151936.
The actor's loss on the outputs: vanilla on-policy PPO with token-mean over the response tokens and
entropy_coeff 0 (the entropy computed for logging only), so the upstream gradient is zero on prompt tokens and
on zero-advantage groups. "dense": every position is a response token with a non-zero advantage and
entropy_coeff 0.01 (every upstream gradient non-zero). Each head's outputs and gradients are also compared with
verl's Triton kernel's.

verl's kernel files come from the installed verl or else from a verl wheel (`--verl-wheel`, default
`.whl/verl-0.9.1-py3-none-any.whl`; benchmarks/verl_triton.py says how).

    python -m benchmarks.verl_head [--repeats 10] [--out benchmark-results]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks import plots, verl_triton
from benchmarks.timing import measure, run_date
from compiled_grpo.integrations import verl as adapter

H, V, SEQUENCES, LENGTH, GROUP = 4096, 151936, 16, 1024, 4
PROMPT = LENGTH // 3


def make_batch(dense: bool, seed: int = 0) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = SEQUENCES * LENGTH
    hidden = torch.randn(1, n, H, device="cuda", dtype=torch.bfloat16, generator=g)
    weight = torch.randn(V, H, device="cuda", dtype=torch.bfloat16, generator=g) * H**-0.5 * 2
    labels = torch.randint(0, V, (1, n), device="cuda", generator=g)
    advantages = torch.randn(SEQUENCES, device="cuda", generator=g)
    response = torch.ones(SEQUENCES, LENGTH, device="cuda")
    if not dense:
        tied = (torch.arange(SEQUENCES, device="cuda") // GROUP) % 2 == 0
        advantages = torch.where(tied, 0.0, advantages)
        response[:, :PROMPT] = 0.0
    weights = (response * advantages.unsqueeze(1)).reshape(1, n)  # d loss / d logp, up to the token-mean scale
    return {"hidden": hidden, "weight": weight.requires_grad_(), "labels": labels,
            "g_logp": -weights / response.sum(), "entropy_coeff": 0.01 if dense else 0.0}  # fmt: skip


def step(head, x: dict):
    """The head, then the actor's loss on its outputs, then backward; returns the outputs and gradients."""
    h = x["hidden"].detach().requires_grad_()
    x["weight"].grad = None
    logp, entropy = head(h, x["weight"], x["labels"])
    loss = (logp.reshape(x["g_logp"].shape) * x["g_logp"]).sum()
    if x["entropy_coeff"]:
        loss = loss - x["entropy_coeff"] * entropy.mean()
    loss.backward()
    return logp.detach().reshape(-1), entropy.detach().reshape(-1).float(), h.grad, x["weight"].grad


def heads(verl_lce, verl_torch) -> dict:
    torch_backend = verl_torch(impl_backend="torch")
    return {
        "floor: three lm_head GEMMs": None,
        "verl 0.9.1 Triton linear_cross_entropy": lambda h, w, y: verl_lce(h, w, y, 1.0, "none"),
        "verl 0.9.1 torch backend (FusedLinearForPPO)": lambda h, w, y: torch_backend(h, w, y, 1.0),
        "compiled_grpo via the verl adapter, compiled": lambda h, w, y: adapter.linear_cross_entropy(h, w, y, 1.0),
    }


def floor(x: dict):
    h, w = x["hidden"][0], x["weight"].detach()
    z = h @ w.T
    _ = z @ w
    _ = z.T @ h


def agreement(out, ref) -> dict:
    """Largest differences from verl's Triton kernel: absolute for logp and entropy, relative for gradients."""
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))
    return {"logp": float((out[0] - ref[0]).abs().max()), "entropy": float((out[1] - ref[1]).abs().max()),
            "d hidden": rel(out[2], ref[2]), "d weight": rel(out[3], ref[3])}  # fmt: skip


def run(scenario: str, repeats: int, methods: dict) -> list[dict]:
    x = make_batch(dense=scenario == "dense")
    rows, reference = [], None
    for name, head in methods.items():
        row = {"shape": scenario, "method": name, "tokens": x["labels"].numel()}
        try:
            fn = (lambda: floor(x)) if head is None else (lambda head=head: step(head, x))
            row["ms"], row["peak_gib"] = measure(fn, x, repeats)
            if head is not None:
                out = step(head, x)
                reference = out if reference is None else reference
                row["vs verl triton"] = agreement(out, reference)
        except torch.OutOfMemoryError:
            row["status"] = "out of memory"
        except Exception as e:  # noqa: BLE001 - report, never drop silently
            row["status"] = f"failed: {type(e).__name__}: {str(e)[:160]}"
        x["weight"].grad = None
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    floor_ms = rows[0].get("ms")
    for r in rows:
        if "ms" in r and floor_ms:
            r["x_floor"] = r["ms"] / floor_ms
    return rows


def write_markdown(rows: list[dict], versions: dict, out: Path, repeats: int) -> None:
    lines = ["# verl-shaped benchmark", "", f"{versions['gpu']}, torch {versions['torch']}. "
             f"{__doc__.split('    python -m')[0].strip()} Median of {repeats} runs after 3 warm-ups.", ""]  # fmt: skip
    for scenario in dict.fromkeys(r["shape"] for r in rows):
        header = (
            "| head | time (ms) | / floor | / verl Triton | peak (GiB) | max diff from verl Triton: logp, "
            "entropy, d hidden (rel), d weight (rel) |"
        )
        lines += [f"## {scenario}", "", header, "|---|---|---|---|---|---|"]
        mine = [r for r in rows if r["shape"] == scenario]
        verl_ms = next((r.get("ms") for r in mine if "Triton" in r["method"]), None)
        for r in mine:
            if "ms" not in r:
                lines.append(f"| {r['method']} | {r.get('status')} | | | | |")
                continue
            a = r.get("vs verl triton")
            diff = "-" if a is None else ", ".join(f"{a[k]:.1e}" for k in ("logp", "entropy", "d hidden", "d weight"))
            vs = f"{r['ms'] / verl_ms:.2f}" if verl_ms else "-"
            lines.append(
                f"| {r['method']} | {r['ms']:.1f} | {r['x_floor']:.2f} | {vs} | {r['peak_gib']:.2f} | {diff} |"
            )
        lines.append("")
    lines.append("![time and peak memory per scenario and head](verl.png)")
    (out / "verl.md").write_text("\n".join(lines) + "\n")


def write_run(run: dict, out: Path, repeats: int) -> None:
    """verl.json, verl.md and verl.png of one run (`run`: its versions, date and rows)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "verl.json").write_text(json.dumps(run, indent=1))
    rows, gpu = run["rows"], run["versions"]["gpu"]
    write_markdown(rows, run["versions"], out, repeats)
    plots.draw(rows, out / "verl.png", plots.run_title(f"{gpu}, bf16, H={H}, V={V}", rows))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--verl-wheel", type=Path, default=verl_triton.WHEEL)
    ap.add_argument("--report", type=Path, default=None, help="a stored verl.json: rewrite its table and picture")
    ap.add_argument("--out", default="benchmark-results", help="folder for verl.md, verl.json and verl.png")
    args = ap.parse_args(argv)
    if args.report:
        return write_run(json.loads(args.report.read_text()), Path(args.out), args.repeats)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (none is visible)")
    loaded = verl_triton.load(args.verl_wheel)
    if isinstance(loaded, str):
        ap.error(loaded)
    methods = heads(*loaded)
    rows = run("verl-shaped", args.repeats, methods) + run("dense", args.repeats, methods)
    versions = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    write_run(
        {"versions": versions, "date": run_date(), "rows": rows},
        Path(args.out),
        args.repeats,
    )


if __name__ == "__main__":
    main()
