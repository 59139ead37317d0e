"""The products of an fp32 LM head (ScaleRL's `cast_lm_head_to_fp32`) from 16-bit GEMMs: error and time per method.

An fp32 weight W (and the backward's fp32 logits gradient G) split into bf16 terms, a = a_1 + a_2 [+ a_3], each
term the bf16 rounding of what the terms before it left, so the terms carry 8, 16, 24 bits of the mantissa. The
head's three products, each with float32 accumulation:

- logits  Z = X W^T   [N, V]: X bf16 (the model's hidden states, exact in bf16) against W's terms;
- dX      = G W       [N, H]: G's terms against W's terms (the pairs whose bits matter: i + j <= terms + 1);
- dW      = G^T X     [V, H]: G's terms against X.

Methods: `fp32` (one fp32 GEMM, TF32 off: TRL's flag today), `tf32`, `bf16` (W and G rounded to bf16: the head
without the flag), `split2` and `split3` (one GEMM per pair of terms, the float32 outputs summed) and `concat2`,
`concat3` (the same pairs as one GEMM over the terms concatenated along the reduction dimension, K = 2H or 3H, so
the pairs are summed inside one float32 accumulator); with `--k-chunks 512,...`, `split3/k512` and `fp32/k512`: the
reduction dimension cut into chunks of that many, each chunk's product by that method and the chunks' float32
outputs summed (round-to-nearest adds outside the GEMM: what a tensor core's own accumulation over a long K loses,
if anything, the chunked sum does not). Errors against the float64 product of the same operands: max
and rms of the difference, relative to the product's rms. Times: CUDA events, median of `--repeats`, of the GEMMs alone
(the fixed operand's split, made once per step in a head, is not timed; on a CPU the 16-bit GEMMs run in float32,
so only the errors mean anything there).

    python -m benchmarks.diagnostics.split_product [--hidden 896,3584,4096] [--tokens 8192] [--vocab 151936]
        [--k-chunks 256,1024] [--repeats 10] [--out benchmark-results]

Writes split-product.json and split-product.md (one table per hidden size) to `--out`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.timing import median_ms

METHODS = ("fp32", "tf32", "bf16", "split2", "split3", "concat2", "concat3")


def split(a: torch.Tensor, terms: int) -> list[torch.Tensor]:
    """a (float32) as `terms` bf16 tensors whose sum approaches it: each the bf16 rounding of what is left."""
    out, rest = [], a.float()
    for _ in range(terms):
        term = rest.to(torch.bfloat16)
        out.append(term)
        rest = rest - term.float()
    return out


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with float32 accumulation and output (16-bit inputs stay 16-bit on a GPU)."""
    if a.is_cuda and a.dtype == torch.bfloat16:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def pairs(left: list, right: list, terms: int) -> list[tuple]:
    """The pairs of terms (i, j) whose product carries bits above float32's rounding: i + j <= terms - 1 (counted
    from 0); a single left operand (X, exact in bf16) pairs with every right term."""
    return [(a, b) for i, a in enumerate(left) for j, b in enumerate(right) if i + j <= max(terms - 1, len(left) - 1)]


def split_gemms(a: torch.Tensor, b: torch.Tensor, terms: int, concat: bool, a_exact: bool):
    """A function computing a @ b from bf16 terms (split here, once): one GEMM per pair summed in float32, or one
    GEMM over the pairs concatenated along K."""
    left = [a.to(torch.bfloat16)] if a_exact else split(a, terms)
    chosen = pairs(left, split(b, terms), terms)
    if concat:
        lhs, rhs = torch.cat([p for p, _ in chosen], dim=1), torch.cat([q for _, q in chosen], dim=0)
        return lambda: mm32(lhs, rhs)

    def run():
        out = mm32(*chosen[0])
        for p, q in chosen[1:]:
            out += mm32(p, q)
        return out

    return run


def tf32_mm(a: torch.Tensor, b: torch.Tensor, allow: bool) -> torch.Tensor:
    torch.backends.cuda.matmul.allow_tf32 = allow
    try:
        return torch.mm(a, b)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


def k_chunked(method: str, a: torch.Tensor, b: torch.Tensor, a_exact: bool, chunk: int):
    """A function computing a @ b as the float32 sum of the products of K-chunks of `chunk`, each by `method`."""
    runs = [gemms(method, a[:, k : k + chunk], b[k : k + chunk], a_exact) for k in range(0, a.shape[1], chunk)]

    def run():
        out = runs[0]()
        for part in runs[1:]:
            out += part()
        return out

    return run


def gemms(method: str, a: torch.Tensor, b: torch.Tensor, a_exact: bool):
    """A function computing a @ b by `method`, its operands prepared here (a_exact: a holds bf16 values, as the
    hidden states do): what a head would hold before its tile loop is not timed."""
    if "/k" in method:
        inner, _, chunk = method.partition("/k")
        return k_chunked(inner, a, b, a_exact, int(chunk))
    if method in ("fp32", "tf32"):
        a32, b32 = a.float(), b.float()
        return lambda: tf32_mm(a32, b32, method == "tf32")
    if method == "bf16":
        a16, b16 = a.to(torch.bfloat16), b.to(torch.bfloat16)
        return lambda: mm32(a16, b16)
    return split_gemms(a, b, int(method[-1]), method.startswith("concat"), a_exact)


def errors(got: torch.Tensor, exact: torch.Tensor) -> tuple[float, float, float]:
    """(max, rms) of got - exact, relative to exact's rms, and the errors' lean: the mean of the error along the
    product's sign over the error's rms, from -1 (every entry pulled toward zero: a truncating sum) through 0
    (round-to-nearest errors, which cancel in a sum of many) to 1."""
    scale = exact.square().mean().sqrt()
    diff = got.double() - exact
    rms = diff.square().mean().sqrt()
    lean = (diff * exact.sign()).mean() / rms.clamp(min=1e-300)
    return float(diff.abs().max() / scale), float(rms / scale), float(lean)


def timed_ms(fn, repeats: int) -> float | None:
    """Median CUDA-event time of `fn()` after one warm-up call; None on a CPU."""
    if not torch.cuda.is_available():
        return None
    fn()
    return median_ms(fn, repeats)


def operands(tokens: int, vocab: int, hidden: int, device) -> dict:
    """X (bf16 values), W (fp32, a model's init scale), G (fp32, a logits gradient's spread: mostly tiny, a few
    large, as softmax probabilities minus one-hots make it)."""
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, hidden, generator=g, device=device).to(torch.bfloat16).float()
    w = torch.randn(vocab, hidden, generator=g, device=device) * hidden**-0.5
    grad = torch.softmax(torch.randn(tokens, vocab, generator=g, device=device) * 3, dim=-1) / tokens
    grad[torch.arange(tokens, device=device), torch.randint(0, vocab, (tokens,), generator=g, device=device)] -= (
        1.0 / tokens
    )
    return {"x": x, "w": w, "g": grad}


def measure(tokens: int, vocab: int, hidden: int, repeats: int, device, methods=METHODS) -> list[dict]:
    """One row per product and method: errors against float64, and the time on a GPU."""
    ops = operands(tokens, vocab, hidden, device)
    products = {  # name: (left, right, left exact in bf16)
        "logits": (ops["x"], ops["w"].T, True),
        "dX": (ops["g"], ops["w"], False),
        "dW": (ops["x"].T.contiguous(), ops["g"], True),  # (G^T X)^T: X^T G, X exact
    }
    rows = []
    for name, (a, b, exact_a) in products.items():
        exact = a.double() @ b.double()
        for method in methods:
            run = gemms(method, a, b, exact_a)
            got = run()
            worst, rms, lean = errors(got, exact)
            ms = timed_ms(run, repeats)
            rows.append({"hidden": hidden, "tokens": tokens, "vocab": vocab, "product": name, "method": method,
                         "max_error": worst, "rms_error": rms, "lean": lean, "ms": ms})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
            del got, run
        del exact
    return rows


def table(rows: list[dict]) -> str:
    lines = []
    for hidden in dict.fromkeys(r["hidden"] for r in rows):
        mine = [r for r in rows if r["hidden"] == hidden]
        lines += [f"### H{hidden}, {mine[0]['tokens']} tokens, V{mine[0]['vocab']}", "",
                  "| method | " + " | ".join(f"{p} max / rms error, lean, ms" for p in ("logits", "dX", "dW")) + " |",
                  "|---|---|---|---|"]  # fmt: skip
        for method in dict.fromkeys(r["method"] for r in mine):
            cells = []
            for name in ("logits", "dX", "dW"):
                r = next(r for r in mine if r["product"] == name and r["method"] == method)
                ms = "" if r["ms"] is None else f", {r['ms']:.1f}"
                cells.append(f"{r['max_error']:.1e} / {r['rms_error']:.1e}, {r.get('lean', float('nan')):+.2f}{ms}")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", default="896,3584,4096")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k-chunks", default="", help="reduction-chunk sizes for the chunked split3 and fp32 methods")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="benchmark-results")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    chunks = [int(k) for k in args.k_chunks.split(",") if k]
    methods = (*METHODS, *(f"{m}/k{k}" for k in chunks for m in ("split3", "fp32")))
    rows = [r for h in map(int, args.hidden.split(",")) for r in measure(args.tokens, args.vocab, h, args.repeats,
                                                                          device, methods)]  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (errors only)"
    (out / "split-product.json").write_text(json.dumps({"device": gpu, "torch": torch.__version__, "rows": rows}))
    text = f"# fp32 head products from bf16 terms\n\n{gpu}; torch {torch.__version__}.\n\n{table(rows)}"
    (out / "split-product.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
