"""The memory engine's passes in isolation, per way of forming the recomputed product: the statistics pass (the
forward) and the vocabulary-outer gradient pass (the backward) of 8192 tokens against V = 151936, per hidden size.

Statistics pass: the log-probs, entropies and lse alone, and with TRL's extra fields (`statistics_with_extras_tile`).

Gradient-pass variants:
- `float32 product`: cuBLAS writes x @ W.T in float32, a fused Inductor kernel reads it and writes the 16-bit
  logits gradient (4 + 4 + 2 bytes per logit, then 2 + 2 read by the dX and dW GEMMs);
- `bf16 product, cuBLAS`: the same with the GEMM's 16-bit output (2 + 2 + 2, then 2 + 2);
- `bf16 product, fused epilogue`: Inductor's Triton GEMM template with the gradient as its epilogue, so the
  product never reaches memory (2, then 2 + 2);
- `bf16 product, autotuned`: Inductor picks between cuBLAS and its templates (max-autotune, both backends).
Each variant's dX and dW are compared with the float32-product variant's. `--statistics-variants` adds the
statistics pass with its fold compiled under Inductor's tuning options. Each row: the median of CUDA-event times,
and from a profile of 3 calls the kernels per call, the GPU's busy time and the call's span (host start to last
kernel): span - busy is the time the GPU waited inside a call.

    python -m benchmarks.diagnostics.gradient_pass [--hidden 896,1536,4096] [--repeats 10] [--out gradient-pass.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.timing import median_ms
from compiled_grpo import streaming, tiling
from compiled_grpo.head import Head, VocabShard
from compiled_grpo.kernels import Kernels
from compiled_grpo.schedules.passes import Engine, Wanted, statistics_pass, vocab_outer_gradients
from compiled_grpo.streaming import RowGradients

TOKENS, VOCAB = 8192, 151936
CAPTURED = False  # --captured: each variant also timed as a CUDA graph replay
FUSED = {"max_autotune": True, "max_autotune_gemm_backends": "TRITON", "epilogue_fusion": True}
AUTOTUNED = {"max_autotune": True, "epilogue_fusion": True}
TUNED = {"coordinate_descent_tuning": True}
STATISTICS_VARIANTS = {  # name: torch.compile options of the statistics tile (None: the library's)
    "float32 product, whole vocabulary rows": None,
    "coordinate-descent tuned fold": TUNED,
    "autotuned fold": {"max_autotune_pointwise": True},
    "autotuned and coordinate-descent tuned fold": {"max_autotune_pointwise": True, **TUNED},
}
VARIANTS = {  # name: (rounded product, torch.compile options of the gradient tile or None for the library's)
    "float32 product": (False, None),
    "float32 product, coordinate-descent tuned": (False, TUNED),
    "bf16 product, cuBLAS": (True, None),
    "bf16 product, fused epilogue": (True, FUSED),
    "bf16 product, autotuned": (True, AUTOTUNED),
}


def inputs(hidden_size: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(VOCAB, hidden_size, device="cuda", dtype=torch.bfloat16, generator=g) * hidden_size**-0.5 * 2
    targets = torch.randint(0, VOCAB, (TOKENS,), device="cuda", generator=g)
    return x, w, targets


def engine_with(options, statistics_options=None) -> Engine:
    kernels = Kernels(True)
    compiled = lambda f, o: torch.compile(f, fullgraph=True, dynamic=False, options=o)
    if options is not None:
        kernels.gradient_vocab = compiled(streaming.gradient_vocab_tile, options)
    if statistics_options is not None:
        kernels.statistics = compiled(streaming.statistics_tile, statistics_options)
    return Engine(kernels, tiling.Tiles.for_device(torch.device("cuda")), VocabShard())


def profiled(fn, calls: int = 3) -> dict:
    """Kernels launched per call, and per call (median of `calls`) the GPU's busy time (the kernels' durations
    summed) and its span (the call's start on the host to its last kernel's end): span - busy is the time the GPU
    waited inside a call, for the host or between kernels."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function("call"):
                fn()
            torch.cuda.synchronize()
    events = prof.events()
    starts = sorted(e.time_range.start for e in events if e.device_type.name == "CPU" and e.name == "call")
    kernels = [e for e in events if e.device_type.name == "CUDA" and e.name != "call"]
    busy, span = [], []
    for start, following in zip(starts, [*starts[1:], float("inf")], strict=True):  # each call ends synchronized
        inside = [k for k in kernels if start <= k.time_range.start < following]
        busy.append(sum(k.time_range.elapsed_us() for k in inside) / 1e3)
        span.append((max(k.time_range.end for k in inside) - start) / 1e3)
    return {"kernels": len(kernels) // calls, "busy_ms": statistics.median(busy), "span_ms": statistics.median(span)}


def chunked_statistics(kernels, x, targets, head: Head, piece: int, chunk: int):
    """(logp, entropy, lse) with the product made `chunk` vocabulary entries at a time for `piece` tokens (a
    [piece, chunk] float32 block small enough to stay in L2 between the GEMM that writes it and the fold that
    reads it), the chunks' partial statistics combined as a vocabulary-parallel head combines its shards."""
    outs = []
    for s in range(0, x.shape[0], piece):
        xs, ts = x[s : s + piece], targets[s : s + piece]
        parts = [kernels.partial_statistics(xs, ts - v0, head.vocab_slice(v0, chunk)) for v0 in range(0, VOCAB, chunk)]
        m, sums, u, target = (torch.stack(p, 1) for p in zip(*parts, strict=True))
        big_m = m.amax(1, keepdim=True)
        scale = torch.exp(m - big_m)
        total = (sums * scale).sum(1)
        log_s = torch.log(total)
        lse = big_m.squeeze(1) + log_s
        outs.append((target.sum(1) - lse, log_s - (scale * (u + sums * (m - big_m))).sum(1) / total, lse))
    return tuple(torch.cat(p) for p in zip(*outs, strict=True))


def chunked_gradients(kernels, x, rows: RowGradients, head: Head, group: int, chunk: int):
    """dX and dW vocabulary-outer, each `group`-entry slice's logits gradient formed `chunk` entries at a time from
    a [tokens, chunk] float32 product (in L2 while the gradient kernel reads it) into one 16-bit [tokens, group]
    buffer, which the dX and dW GEMMs of the slice then read."""
    w = head.weight
    dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    dw = torch.empty_like(w)
    buf = torch.empty(x.shape[0], group, dtype=x.dtype, device=x.device)
    for j, v0 in enumerate(range(0, VOCAB, group)):
        width = min(group, VOCAB - v0)
        for c0 in range(v0, v0 + width, chunk):
            head_c = head.vocab_slice(c0, min(chunk, v0 + width - c0))
            product = streaming.matmul_fp32(x, head_c.weight.T)
            out = buf[:, c0 - v0 : c0 - v0 + head_c.weight.shape[0]]
            kernels.gradient_from_product(product, rows._replace(targets=rows.targets - c0), head_c, out, False)
        d_raw = buf[:, :width]
        streaming.add_matmul(dx, d_raw, w[v0 : v0 + width], first=j == 0)
        torch.mm(d_raw.T, x, out=dw[v0 : v0 + width])
    return dx.to(x.dtype), dw, None


def compared(row: dict, got, want) -> None:
    for name, a, b in zip(("dx", "dw"), got, want, strict=False):
        row[f"{name}_rel"] = ((a.float() - b.float()).norm() / b.float().norm()).item()


def as_replay(fn):
    """fn captured as one CUDA graph (after a warm-up call): its replay, and the graph's outputs."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def measured(row: dict, fn, repeats: int):
    try:
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        row["first_call_s"] = time.perf_counter() - start
        row["ms"] = median_ms(fn, repeats)
        row.update(profiled(fn))
        if CAPTURED:  # the GPU's time alone, without the host's launches
            replay, _ = as_replay(fn)
            row["replay_ms"] = median_ms(replay, repeats)
        return out
    except Exception as e:  # noqa: BLE001 - report, never drop silently
        row["status"] = f"failed: {type(e).__name__}: {str(e)[:300]}"
        return None
    finally:
        print(json.dumps(row), flush=True)


def run_hidden(hidden_size: int, repeats: int, chunks: list[tuple[int, int]], sub_chunks: list[int]) -> list[dict]:
    x, w, targets = inputs(hidden_size)
    values = torch.tensor([1.0, 1.0, 1.0], device="cuda")
    tiles = ((0, TOKENS),)
    out = []
    exact = Head(w, None, values, False)
    logp = entropy = lse = None
    for name, options in STATISTICS_VARIANTS.items():
        torch._dynamo.reset()
        engine = engine_with(None, options)
        row = {"H": hidden_size, "pass": f"statistics ({name})"}
        got = measured(row, lambda e=engine: statistics_pass(e, x, targets, exact, tiles), repeats)
        if got is not None and logp is not None:
            row["logp_max"] = (got[0] - logp).abs().max().item()
            row["entropy_max"] = (got[1] - entropy).abs().max().item()
        logp, entropy, lse = (logp, entropy, lse) if logp is not None else got
        out.append(row)
    engine = engine_with(None)
    row = {"H": hidden_size, "pass": "statistics with TRL's extra fields (same read)"}
    measured(row, lambda: statistics_pass(engine, x, targets, exact, tiles, extras=True), repeats)
    out.append(row)
    for piece, chunk in chunks:
        row = {"H": hidden_size, "pass": f"statistics, [{piece}, {chunk}] blocks"}
        got = measured(row, lambda p=piece, c=chunk: chunked_statistics(engine.kernels, x, targets, exact, p, c),
                       repeats)  # fmt: skip
        if got is not None:
            row["logp_max"] = (got[0] - logp).abs().max().item()
            row["entropy_max"] = (got[1] - entropy).abs().max().item()
        out.append(row)
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = RowGradients(streaming.compared_ids(targets), lse, entropy, torch.randn(TOKENS, device="cuda", generator=g),
                        0.1 * torch.randn(TOKENS, device="cuda", generator=g))  # fmt: skip
    reference = None
    for name, (rounded, options) in VARIANTS.items():
        torch._dynamo.reset()
        engine, head = engine_with(options), exact._replace(rounded=rounded)
        row = {"H": hidden_size, "pass": f"gradient ({name})"}
        got = measured(row, lambda e=engine, h=head: vocab_outer_gradients(e, x, rows, h, tiles, Wanted(True, False)),
                       repeats)  # fmt: skip
        reference = got if reference is None else reference
        if got is not None:
            compared(row, got, reference)
        out.append(row)
    engine = engine_with(None)
    for chunk in sub_chunks:
        row = {"H": hidden_size, "pass": f"gradient (float32 product, {chunk}-entry chunks)"}
        got = measured(row, lambda c=chunk: chunked_gradients(engine.kernels, x, rows, exact, 8192, c), repeats)
        if got is not None:
            compared(row, got, reference)
        out.append(row)
    z = (x @ w.T).requires_grad_()
    floor = lambda: (z @ w, z.T @ x)
    out.append({"H": hidden_size, "pass": "floor: dX and dW GEMMs", "ms": median_ms(floor, repeats)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", default="896,1536,4096")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument(
        "--variants",
        default="cuBLAS",
        help="';'-separated name substrings of the gradient variants to "
        "keep besides the float32 product ('epilogue;autotuned': Inductor's Triton GEMM templates)",
    )
    ap.add_argument(
        "--blocks",
        default="1024x8192,1024x4096,2048x4096,4096x2048",
        help="statistics blocks, tokens x vocabulary entries",
    )
    ap.add_argument("--chunks", default="2048,1024,512", help="vocabulary chunks of the chunked gradient pass")
    ap.add_argument(
        "--statistics-variants",
        default="",
        help="';'-separated name substrings of the statistics variants to keep besides the library's "
        "('tuned;autotuned': Inductor's tuning of the fold's kernel)",
    )
    ap.add_argument("--out", default="gradient-pass.json")
    ap.add_argument("--captured", action="store_true", help="also time each variant as one CUDA graph replay")
    args = ap.parse_args(argv)
    global CAPTURED
    CAPTURED = args.captured
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    if args.variants is not None:
        for name in list(VARIANTS):
            if name != "float32 product" and not any(k in name for k in args.variants.split(";")):
                del VARIANTS[name]
    for name in list(STATISTICS_VARIANTS)[1:]:
        if not any(k and k in name for k in args.statistics_variants.split(";")):
            del STATISTICS_VARIANTS[name]
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": TOKENS, "vocab": VOCAB}
    blocks = [tuple(int(v) for v in b.split("x")) for b in filter(None, args.blocks.split(","))]
    chunks = [int(c) for c in filter(None, args.chunks.split(","))]
    rows = [r for h in args.hidden.split(",") for r in run_hidden(int(h), args.repeats, blocks, chunks)]
    with open(args.out, "w") as f:
        json.dump({"versions": info, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
