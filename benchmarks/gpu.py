"""GPU benchmark: every method in one process, per shape, forward + backward of the whole loss.

Methods: the three lm_head GEMMs over the active tokens alone (the floor); full logits with autograd; TRL
1.16.0's fused LM head (`ChunkedLogProbFunction`, with TRL's compaction of padded positions) followed by the same
loss; Liger 0.8.5's `LigerFusedLinearGRPOLoss`, and its Hopper CuTe head (per-token NLL and entropy) followed by
the same loss; and this library's speed, memory and sparse schedules, eager
and compiled, and what "auto" picks. Median of CUDA-event times after warm-up; peak memory above what was
allocated before the call (inputs, weights); the rows that went through the gradient pass. A baseline that is
not installed, or a method that cannot run a shape, is reported as such.

Scenarios beside the dense shapes: `-half0`, half the sequences at advantage 0 (every other group of 4
completions tied, as GRPO batches with frac_reward_zero_std = 0.5); `-q0.2`, top_entropy_quantile = 0.2.

    python -m benchmarks.gpu [--shapes S1,S2,S3,S1-q0.2,S1-ref,S1-half0,S1-q0.2-half0,...] [--repeats 10]
        [--out benchmark-results] [--methods "TRL;speed, compiled"] [--variants "sparse:sparse_tile=1024"]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

import reference
from benchmarks import plots, unsloth_head
from compiled_grpo import FusedLinearGRPOLoss, fused_linear_logprobs, primitive_captures


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


def make_inputs(shape: Shape, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dt, H, V = "cuda", torch.bfloat16, shape.H, shape.V
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


def loss_settings(shape: Shape) -> dict:
    return {"loss_type": "dapo", "beta": shape.beta, "top_entropy_quantile": shape.q}


# ---------------------------------------------------------------- methods: each returns a closure or a reason
def floor(shape, x):
    w = x["weight"].detach()
    active = x["hidden"].reshape(-1, shape.H)[x["mask"].reshape(-1).bool()].to(w.dtype)

    def run():
        z = active @ w.T
        _ = z @ w
        _ = z.T @ active

    return run


def same_loss(logp, entropy, x, shape, ref_logp=None):
    """TRL's loss on [B,T] (the reference's objective: no vocabulary dimension, cheap)."""
    kw = {"ref_per_token_logps": ref_logp} if ref_logp is not None else {}
    return reference.grpo_objective(logp, entropy, x["mask"], x["advantages"], **kw, **loss_settings(shape)).loss


def head_then_loss(head, shape, x):
    """A method that gets (logp, entropy) from `head(hidden, weight)` and then applies the same loss; with
    beta, the reference model's log-probs come from the same head without gradient."""

    def run():
        h = x["hidden"].detach().requires_grad_()
        ref_logp = None
        if shape.beta:
            with torch.no_grad():
                ref_logp = head(x["ref_hidden"], x["ref_weight"])[0]
        logp, entropy = head(h, x["weight"])
        same_loss(logp, entropy, x, shape, ref_logp).backward()

    return run


def full_logits(shape, x):
    def logp_entropy(hidden, weight):
        logits = (hidden @ weight.T).float()
        log_p = torch.log_softmax(logits, -1)
        logp = log_p.gather(-1, x["ids"].unsqueeze(-1)).squeeze(-1)
        return logp, -(log_p.exp() * log_p).sum(-1)

    return head_then_loss(logp_entropy, shape, x)


def plain_compile(shape, x):
    """The loss a user would write on full logits, under torch.compile (dapo, on-policy, token level)."""
    if shape.q < 1 or shape.beta:
        return "not written: the plain loss here is dense dapo without KL"

    def plain_loss(hidden, weight, ids, mask, advantages):
        log_p = (hidden @ weight.T).float().log_softmax(-1)
        logp = log_p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        ratio = torch.exp(logp - logp.detach())
        a = advantages.unsqueeze(-1)
        per_token = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
        tokens = mask.sum().clamp(min=1)
        return (per_token * mask).sum() / tokens, (entropy.detach() * mask).sum() / tokens

    compiled = torch.compile(plain_loss)

    def run():
        h = x["hidden"].detach().requires_grad_()
        compiled(h, x["weight"], x["ids"], x["mask"], x["advantages"])[0].backward()

    return run


def primitive(**options):
    """`fused_linear_logprobs` (compiled) with the same loss on top, as a framework's own loss would use it."""

    def make(shape, x):
        targets = torch.where(x["mask"].bool(), x["ids"], -100)
        if options.get("capture"):  # graphs of this method alone in the primitive's process-wide set
            primitive_captures(reset=True)

        def head(hidden, weight):
            return fused_linear_logprobs(hidden, weight, targets, validate=False, **options)

        run = head_then_loss(head, shape, x)
        if options.get("capture"):
            run.graph_pool_bytes = lambda: primitive_captures().pool_bytes
        return run

    return make


def unsloth(shape, x):
    """unsloth_zoo 2026.10.9's `fused_linear_logprobs` (benchmarks/unsloth_head.py) with the same loss on top: the
    log-probs and, without gradient, the entropies (what the loss logs), padded positions masked out."""
    op = unsloth_head.load()
    if isinstance(op, str):
        return op

    def head(hidden, weight):
        return op(hidden, weight, x["ids"], mask=x["mask"], return_entropy=True, entropy_requires_grad=False)

    return head_then_loss(head, shape, x)


def trl_fused_head(shape, x):
    try:
        from trl.kernels import ChunkedLogProbFunction
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk
    except Exception as e:  # noqa: BLE001 - any import failure means "not installed here"
        return f"skipped: trl not importable ({type(e).__name__}: {e})"
    mask = x["mask"].bool()

    def head(hidden, weight):
        logp, entropy, *_ = ChunkedLogProbFunction.apply(
            hidden[mask].to(weight.dtype), weight, None, x["ids"][mask], 1.0, chunk, None, 1.0, ("entropy",)
        )
        scatter = lambda t: t.new_zeros(mask.shape).masked_scatter(mask, t)
        return scatter(logp), scatter(entropy)

    return head_then_loss(head, shape, x)


def liger(shape, x):
    if shape.q < 1:
        return "not supported: Liger has no top_entropy_quantile"
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception as e:  # noqa: BLE001
        return f"skipped: liger-kernel not importable ({type(e).__name__}: {e})"
    loss_fn = LigerFusedLinearGRPOLoss(beta=shape.beta, loss_type="dapo", use_ref_model=bool(shape.beta),
                                       use_bias_correction_kl=True)  # fmt: skip
    extra = {"ref_input": x["ref_hidden"], "ref_weight": x["ref_weight"]} if shape.beta else {}

    def run():
        h = x["hidden"].detach().requires_grad_()
        loss, _ = loss_fn(h, x["weight"], x["ids"], x["mask"], x["advantages"], **extra)
        loss.backward()

    return run


def liger_cute_head(shape, x):
    """Liger's Hopper head (`LigerFusedLinearScaledCrossEntropyFunction`: per-token NLL and entropy from its CuTe
    DSL kernels on sm_90) over the active tokens, followed by the same loss."""
    try:
        from liger_kernel.ops import fused_linear_scaled_cross_entropy as scaled
    except Exception as e:  # noqa: BLE001
        return f"skipped: liger-kernel not importable ({type(e).__name__}: {e})"
    if torch.cuda.get_device_capability() != (9, 0):
        return "skipped: Liger's CuTe head runs on sm_90 only"
    try:
        scaled._load_sm90_function()
    except Exception as e:  # noqa: BLE001 - the CUTLASS DSL wheels are a separate install
        hint = "; installed with pip --target? put its nvidia_cutlass_dsl/dsl_packages on PYTHONPATH (a .pth file)"
        return f"skipped: Liger's CuTe head not importable ({type(e).__name__}: {str(e)[:80]}){hint}"
    mask = x["mask"].bool()

    def head(hidden, weight):
        nll, entropy = scaled.LigerFusedLinearScaledCrossEntropyFunction.apply(
            hidden[mask], weight, x["ids"][mask], 1.0, -100, 1, True
        )
        scatter = lambda t: t.new_zeros(mask.shape, dtype=torch.float32).masked_scatter(mask, t.float())
        return scatter(-nll), scatter(entropy)

    return head_then_loss(head, shape, x)


def ours(schedule, compiled, packed=False, **options):
    """This library; `packed`: the same batch given padding-free (the active tokens' hidden rows, one
    segment per sequence), packed outside the timed call as a packing data loader would."""

    def make(shape, x):
        if schedule == "speed" and shape.q < 1:
            return "not applicable: the speed schedule cannot take top_entropy_quantile < 1"
        if packed and shape.beta:
            return "not measured: packed with a reference model"
        settings = loss_settings(shape)
        loss_fn = FusedLinearGRPOLoss(compiled=compiled, schedule=schedule, validate=False, **options, **settings)
        extra = {"ref_hidden": x["ref_hidden"], "ref_weight": x["ref_weight"]} if shape.beta else {}
        hidden, ids, mask, adv = x["hidden"], x["ids"], x["mask"], x["advantages"]
        if packed:
            keep = mask.bool()
            rows = torch.arange(shape.B, device=mask.device).unsqueeze(1).expand_as(mask)[keep]
            hidden, ids, mask = hidden[keep], ids[keep], mask[keep]
            extra = {"segment_ids": rows, "num_sequences": shape.B}

        def run():
            h = hidden.detach().requires_grad_()
            loss_fn(h, x["weight"], ids, mask, adv, **extra).loss.backward()

        if loss_fn.captures is not None:
            run.graph_pool_bytes = lambda: loss_fn.captures.pool_bytes
        return run

    return make


METHODS = {
    "floor: three lm_head GEMMs": floor,
    "full logits + autograd": full_logits,
    "plain loss under torch.compile": plain_compile,
    "TRL 1.16 fused head + loss": trl_fused_head,
    "Liger 0.8.5": liger,
    "Liger 0.8.5 CuTe head + loss": liger_cute_head,
    "compiled_grpo speed, eager": ours("speed", False),
    "compiled_grpo speed, compiled": ours("speed", True),
    "compiled_grpo memory, eager": ours("memory", False),
    "compiled_grpo memory, compiled": ours("memory", True),
    "compiled_grpo sparse, compiled": ours("sparse", True),
    "compiled_grpo auto, compiled": ours("auto", True),
    "compiled_grpo auto, compiled, packed": ours("auto", True, packed=True),
    "compiled_grpo primitive + loss, compiled": primitive(),
    "Unsloth (unsloth_zoo 2026.10.9) head + loss": unsloth,
    # the opt-in forms: round_logits=True ("rounded"), capture=True ("captured")
    "compiled_grpo speed, compiled, rounded": ours("speed", True, round_logits=True),
    "compiled_grpo memory, compiled, rounded": ours("memory", True, round_logits=True),
    "compiled_grpo primitive + loss, compiled, rounded": primitive(round_logits=True),
    "compiled_grpo speed, compiled, captured": ours("speed", True, capture=True),
    "compiled_grpo memory, compiled, captured": ours("memory", True, capture=True),
    "compiled_grpo sparse, compiled, captured": ours("sparse", True, capture=True),
    "compiled_grpo primitive + loss, compiled, captured": primitive(capture=True),
    "compiled_grpo primitive + loss, compiled, captured, rounded": primitive(capture=True, round_logits=True),
}


def with_tf32(make):
    """A method with TF32 GEMMs allowed while it runs (float32 GEMMs on 10-bit inputs)."""

    def made(shape, x):
        run = make(shape, x)
        if isinstance(run, str):
            return run

        def tf32_run():
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                run()
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False

        return tf32_run

    return made


# The fp32 head's shapes: float32 GEMMs (TF32 off, torch's default), TF32, and this library's products from bf16 terms
FP32_METHODS = {
    "floor: three lm_head GEMMs in float32": floor,
    "floor: three lm_head GEMMs, TF32": with_tf32(floor),
    "TRL 1.16 fused head + loss, float32 GEMMs": trl_fused_head,
    "TRL 1.16 fused head + loss, TF32": with_tf32(trl_fused_head),
    "compiled_grpo speed, compiled": ours("speed", True),
    "compiled_grpo memory, compiled": ours("memory", True),
    "compiled_grpo auto, compiled": ours("auto", True),
    "compiled_grpo auto, compiled, captured": ours("auto", True, capture=True),
    "compiled_grpo primitive + loss, compiled": primitive(),
}


def measure(run, x, repeats: int, warmup: int = 3):
    """(median ms, peak GiB above the memory in use before the call)."""
    for _ in range(warmup):
        run()
        x["weight"].grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = median_ms(run, repeats, after=lambda: setattr(x["weight"], "grad", None))
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def median_ms(fn, repeats: int, after=lambda: None) -> float:
    """Median CUDA-event time of `fn()` over `repeats` calls, `after()` run between them (outside the timing)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        after()
    return statistics.median(times)


def versions() -> dict:
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    for pkg in ("triton", "trl", "liger-kernel", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def run_shape(shape: Shape, repeats: int) -> list[dict]:
    x = make_inputs(shape)
    active = int(x["mask"].sum())
    rows = []
    for name, make in (FP32_METHODS if shape.fp32_head else METHODS).items():
        torch._dynamo.reset()  # Liger 0.8.5's compiled graphs fail on a new shape in the same process otherwise
        row = {"shape": shape.name, "method": name, "tokens": active}
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
        x["weight"].grad = None
        torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    floor_ms = next(r.get("ms") for r in rows if r["method"].startswith("floor"))
    trl_ms = next((r.get("ms") for r in rows if r["method"].startswith("TRL")), None)
    for r in rows:
        if "ms" in r:
            r["x_floor"] = r["ms"] / floor_ms
            r["x_trl"] = r["ms"] / trl_ms if trl_ms else None
    return rows


def write_markdown(rows: list[dict], info: dict, out: Path, repeats: int) -> None:
    lines = [
        "# GPU benchmark",
        "",
        f"{info['gpu']}; torch {info['torch']}, Triton {info['triton']}, TRL {info['trl']}, "
        f"Liger {info['liger-kernel']}, transformers {info['transformers']}. bf16, H=4096 and V=151936 unless the "
        "shape says otherwise, dapo, forward + "
        f"backward of the whole loss, median of {repeats} runs after 3 warm-ups (CUDA events); peak memory above "
        "the inputs. `/ floor` is against the three lm_head GEMMs over the active tokens, `/ TRL` against TRL "
        "1.16.0's fused head + the same loss, both measured in the same run.",
        "",
        "Shapes: S1 B=8 T=1024 (all active); S2 B=16 T=1024, lengths uniform in [1, 1024]; S3 B=4 T=8192; "
        "S1-q0.2 S1 with top_entropy_quantile=0.2; S1-ref S1 with beta=0.04 and ref_hidden/ref_weight; -half0: "
        "every other group of 4 sequences at advantage 0; H896 and H1536: S1 with hidden size 896 (Qwen2.5-0.5B's "
        "head), 1536 (1.5B's) and 3584 (7B's); H8192: B=4 T=8192 with H=8192 and V=128256 (a 70B-class head); "
        "-fp32: the lm_head weight in float32 against the bf16 hidden states (TRL's `cast_lm_head_to_fp32`), "
        "its floor three float32 GEMMs (TF32 off) and `/ TRL` against TRL's head in float32.",
        "",
    ]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        lines += [f"## {shape} ({next(r['tokens'] for r in rows if r['shape'] == shape)} active tokens)", ""]
        lines += [
            "| method | time (ms) | / floor | / TRL | peak memory (GiB) |",
            "|---|---|---|---|---|",
        ]
        for r in (r for r in rows if r["shape"] == shape):
            if "ms" in r:
                trl = f"{r['x_trl']:.2f}" if r.get("x_trl") else "-"
                peak = f"{r['peak_gib']:.2f}" + (
                    f" + graph pool {r['graph_pool_gib']:.2f}" if "graph_pool_gib" in r else ""
                )
                lines.append(f"| {r['method']} | {r['ms']:.1f} | {r['x_floor']:.2f} | {trl} | {peak} |")
            else:
                lines.append(f"| {r['method']} | {r['status']} | | | |")
        lines.append("")
    lines += ["![time and peak memory per shape and method](gpu.png)", ""]
    (out / "gpu.md").write_text("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--methods", default=None, help="';'-separated name substrings to keep (the floor always runs)")
    ap.add_argument(
        "--variants",
        default="",
        help="extra compiled runs of this library, ';'-separated, each 'schedule:knob=value,...' "
        "(e.g. 'memory:vocab_tile=16384;speed:speed_tile=1024')",
    )
    ap.add_argument("--out", default="benchmark-results", help="folder for gpu.md, gpu.json and gpu.png")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (none is visible); on a CPU run `python -m benchmarks.cpu`")
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; valid: {', '.join(SHAPES)}")
    if args.methods:
        keep = [k for k in args.methods.split(";") if k]
        for methods in (METHODS, FP32_METHODS):
            for name in list(methods):
                if not name.startswith("floor") and not any(k in name for k in keep):
                    del methods[name]
    for variant in filter(None, args.variants.split(";")):
        schedule, _, knobs = variant.partition(":")
        tiles = {k: int(v) for k, v in (kv.split("=") for kv in filter(None, knobs.split(",")))}
        METHODS[f"compiled_grpo {schedule}, compiled, {knobs}"] = ours(schedule, True, **tiles)
    info = versions()
    print(json.dumps(info), flush=True)
    rows = [r for s in args.shapes.split(",") for r in run_shape(SHAPES[s], args.repeats)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps({"versions": info, "rows": rows}, indent=1))
    write_markdown(rows, info, out, args.repeats)
    plots.draw(rows, out / "gpu.png", plots.run_title(f"{info['gpu']}, bf16, dapo", rows))


if __name__ == "__main__":
    main()
