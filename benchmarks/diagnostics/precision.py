"""How far each lm_head precision's outputs are from float64, at a production shape (docs/precision.md's table).

One batch (bf16 hidden states, a float32 weight at a model's init scale), the whole loss (dapo, compiled, the speed
schedule) forward and backward, and against float64 on the same inputs: the fp32 head (float32 weight) by float32
GEMMs (TF32 off: TRL's `cast_lm_head_to_fp32`), by TF32, and by this library's bf16 terms (3, and 2 for comparison),
and the weight rounded to bf16; then the bf16 weight's own settings against its float64: the default float32
product and `round_logits=True`, and the two against each other. logp and entropy: absolute; dX (returned in bf16)
and dW: relative to their rms; max / rms.

    python -m benchmarks.diagnostics.precision [--hidden 3584] [--tokens 4096] [--vocab 151936]
        [--out benchmark-results]

Writes precision.json and precision.md to `--out`. On a CPU (a smoke test) the loss runs eager and the fp32 head's
GEMMs are float32 ones: the split products are a GPU's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from compiled_grpo import FusedLinearGRPOLoss, products

OUTPUTS = ("logp", "entropy", "dX", "dW")


def batch(hidden_size: int, tokens: int, vocab: int) -> dict:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    return {
        "hidden": torch.randn(1, tokens, hidden_size, device=dev, generator=g).bfloat16(),
        "weight": torch.randn(vocab, hidden_size, device=dev, generator=g) * hidden_size**-0.5 * 2,
        "ids": torch.randint(0, vocab, (1, tokens), device=dev, generator=g),
        "mask": torch.ones(1, tokens, device=dev),
        "advantages": torch.ones(1, device=dev),
    }


def outputs(x: dict, hidden, weight, tf32=False, terms=3, rounded=False) -> list[torch.Tensor]:
    """(logp, entropy, dX in bf16, dW) of one forward and backward, in float64 for comparing."""
    products.SPLIT_TERMS = terms
    torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        loss_fn = FusedLinearGRPOLoss(loss_type="dapo", compiled=h.is_cuda, validate=False, round_logits=rounded)
        out = loss_fn(h, w, x["ids"], x["mask"], x["advantages"])
        out.loss.backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False
        products.SPLIT_TERMS = 3
    return [out.per_token_logps.double(), out.entropy.double(), h.grad.bfloat16().double(), w.grad.double()]


def errors(got: list, exact: list) -> dict[str, tuple[float, float]]:
    found = {}
    for name, a, b in zip(OUTPUTS, got, exact, strict=True):
        scale = 1.0 if name in ("logp", "entropy") else float(b.square().mean().sqrt())
        d = a - b
        found[name] = (float(d.abs().max()) / scale, float(d.square().mean().sqrt()) / scale)
    return found


def measure(hidden_size: int, tokens: int, vocab: int) -> list[dict]:
    x = batch(hidden_size, tokens, vocab)
    h, w = x["hidden"], x["weight"]
    w16 = w.bfloat16()
    exact = outputs(x, h.double(), w.double())
    exact16 = outputs(x, h.double(), w16.double())
    fp32_head = {
        "fp32 weight, float32 GEMMs": (outputs(x, h.float(), w), exact),
        "fp32 weight, TF32": (outputs(x, h.float(), w, tf32=True), exact),
        "fp32 weight, this library (3 bf16 terms)": (outputs(x, h, w), exact),
        "fp32 weight, 2 bf16 terms": (outputs(x, h, w, terms=2), exact),
        "fp32 weight rounded to bf16": (outputs(x, h, w16), exact),
    }
    default, rounded = outputs(x, h, w16), outputs(x, h, w16, rounded=True)
    bf16_head = {
        "bf16 weight, default float32 product": (default, exact16),
        "bf16 weight, round_logits=True": (rounded, exact16),
        "round_logits=True against the default": (rounded, default),
    }
    rows = []
    for name, (got, against) in {**fp32_head, **bf16_head}.items():
        rows.append({"setting": name, "hidden": hidden_size, "tokens": tokens, "errors": errors(got, against)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| setting | " + " | ".join(OUTPUTS) + " |", "|---|" + "---|" * len(OUTPUTS)]
    for r in rows:
        cells = " | ".join("{:.1e} / {:.1e}".format(*r["errors"][k]) for k in OUTPUTS)
        lines.append(f"| {r['setting']} | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--out", default="benchmark-results")
    args = ap.parse_args(argv)
    rows = measure(args.hidden, args.tokens, args.vocab)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (float32 GEMMs, eager)"
    info = {"gpu": device, "torch": torch.__version__}
    (out / "precision.json").write_text(json.dumps({**info, "rows": rows}, indent=1))
    head = f"# lm_head precision against float64\n\n{info['gpu']}; torch {info['torch']}; H{args.hidden}, "
    text = head + f"{args.tokens} tokens, V{args.vocab}; max / rms.\n\n{table(rows)}\n"
    (out / "precision.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
