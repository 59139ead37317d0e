"""The primitive's audit: `fused_linear_logprobs` against the float64 reference primitive (full logits, plain
autograd), one cell per case x dtype x mode (eager, compiled, and captured on a GPU).

Cases: plain; temperature per token; temperature per sequence; logit scale, softcap and bias; a custom
ignore_index; 80% of the rows with zero upstream gradient (the sparse backward); no entropy gradient; the extra
fields (`fused_linear_logprobs_with_extras`: log_sum_sq_probs, mean_logits and is_top1 against the reference's, from
the same pass, beside its logp, entropy and gradients). Each cell
checks per-token logp and entropy, that ignored targets give exactly 0, and the gradients of hidden, weight and
bias for the case's upstream gradients (bf16: the three-way bound against plain bf16 autograd on full logits,
as the loss audit). The vocabulary (V = 1021 quick) is not a multiple of any vocabulary tile.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from compiled_grpo import fused_linear_logprobs
from compiled_grpo.logprobs import PRIMITIVE_CAPTURES, fused_linear_logprobs_with_extras

from . import harness, reference, tolerances
from .loss_audit import DTYPES, FP32_HEAD, Size, relative_error
from .results import CellResult

CASES = ("plain", "temperature per token", "temperature per sequence", "scale softcap bias", "ignore_index 7",
         "80% zero-gradient rows", "no entropy gradient", "extra fields")  # fmt: skip
TOP1_MISMATCHES = 2e-3  # is_top1 may differ from float64's only where the top two logits tie to float32 rounding


@dataclass(frozen=True)
class LogProbsCell:
    case: str
    dtype: str
    mode: str

    @property
    def name(self) -> str:
        return f"{self.case:26s} {self.dtype:8s} {self.mode}"


def cells(dtypes=tuple(DTYPES), modes=("eager", "compiled")) -> list[LogProbsCell]:
    """Every case x dtype x mode (the fp32 head: not captured)."""
    return [LogProbsCell(c, d, m) for c in CASES for d in dtypes for m in modes if d != FP32_HEAD or m != "captured"]


def make_case(case: str, size: Size, dtype, device: str, seed: int = 0, weight_dtype=None) -> dict:
    """Inputs, primitive options and upstream gradients of a case (`weight_dtype`: the weight's and bias's, where
    not the hidden states')."""
    weight_dtype = weight_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    B, T, H, V = size.B, size.T, size.H, size.V
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    ignore = 7 if case == "ignore_index 7" else -100
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[torch.rand(B, T, generator=g) < 0.25] = ignore
    targets[0, T // 2 :] = ignore
    options = {"ignore_index": ignore}
    if case == "temperature per token":
        options["temperature"] = (torch.rand(B, T, generator=g, dtype=torch.float64) + 0.5).to(device)
    elif case == "temperature per sequence":
        options["temperature"] = (torch.rand(B, 1, generator=g, dtype=torch.float64) + 0.5).to(device)
    elif case == "scale softcap bias":
        options.update(logit_scale=0.7, final_logit_softcapping=4.0, temperature=0.8)
    elif case == "extra fields":
        options.update(temperature=0.8)
    g_logp, g_entropy = rn(B, T), rn(B, T) * 0.3
    if case == "80% zero-gradient rows":
        keep = torch.rand(B, T, generator=g) < 0.2
        g_logp, g_entropy = g_logp * keep, g_entropy * keep
    if case == "no entropy gradient":
        g_entropy = None
    x = {
        "hidden": rn(B, T, H).to(dtype).to(device),
        "weight": (rn(V, H) * 2 / math.sqrt(H)).to(weight_dtype).to(device),
        "bias": (rn(V) * 0.3).to(weight_dtype).to(device) if case == "scale softcap bias" else None,
        "targets": targets.to(device),
    }
    upstream = (g_logp.float().to(device), None if g_entropy is None else g_entropy.float().to(device))
    return {"x": x, "options": options, "upstream": upstream}


def gradients(fn, x: dict, upstream, dtype=None):
    """(logp, entropy, {name: gradient}) of fn on fresh leaves (converted to `dtype` when given)."""
    leaves = {k: None if v is None else v.detach().to(dtype or v.dtype).clone().requires_grad_()
              for k, v in x.items() if k != "targets"}  # fmt: skip
    logp, entropy = fn(leaves["hidden"], leaves["weight"], x["targets"], bias=leaves["bias"])
    upstream_backward((logp, entropy), upstream)
    return logp, entropy, {k: v.grad for k, v in leaves.items() if v is not None}


def upstream_backward(outputs, upstream) -> None:
    """Backward of (logp, entropy) with the case's upstream gradients."""
    (logp, entropy), (g_logp, g_entropy) = outputs, upstream
    total = (logp * g_logp.to(logp.dtype)).sum()
    if g_entropy is not None:
        total = total + (entropy * g_entropy.to(entropy.dtype)).sum()
    total.backward()


def naive(hidden, weight, targets, bias=None, ignore_index=-100, temperature=1.0, logit_scale=1.0,
          final_logit_softcapping=None):  # fmt: skip
    """Plain full-logits autograd in the inputs' dtype: the three-way bound's baseline."""
    z = hidden @ weight.T + (0 if bias is None else bias)
    z = z * logit_scale
    if final_logit_softcapping is not None:
        z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
    z = z / (temperature.to(z.dtype).unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature)
    log_p = z.log_softmax(-1)
    valid = targets != ignore_index
    logp = torch.where(valid, log_p.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1), 0)
    return logp.float(), torch.where(valid, -(log_p.exp() * log_p).sum(-1), 0).float()


def audit_cell(cell: LogProbsCell, case: dict) -> CellResult:
    result = CellResult("logprobs", cell.name, params={**cell.__dict__})
    x, options, upstream = case["x"], case["options"], case["upstream"]
    captured = cell.mode == "captured"
    extras = []  # the extra fields of each call, with "extra fields"

    def ours(h, w, t, bias):
        primitive = fused_linear_logprobs_with_extras if cell.case == "extra fields" else fused_linear_logprobs
        out = primitive(h, w, t, bias=bias, compiled=cell.mode != "eager", capture=captured, **options)
        if cell.case == "extra fields":
            out, extra = out
            extras.append(extra)
        return out

    ref = lambda h, w, t, bias: reference.fused_linear_logprobs(h, w, t, bias=bias, **options)[:2]
    replays = PRIMITIVE_CAPTURES.replays
    if captured:  # the checked call is a replay of the call's captured passes (`harness.after_warm_ups`)
        ours = harness.after_warm_ups(ours, lambda out: upstream_backward(out, upstream))
    logp, entropy, grads = gradients(ours, x, upstream)
    if captured:
        result.check("ran as a CUDA graph replay", float(PRIMITIVE_CAPTURES.replays == replays), 0.0)
    ref_logp, ref_entropy, ref_grads = gradients(ref, x, upstream, torch.float64)
    tol = tolerances.for_dtype(cell.dtype)
    result.check("logp", relative_error(logp, ref_logp), tol["logp"])
    result.check("entropy", relative_error(entropy, ref_entropy), tol["entropy"])
    if extras:
        hidden, weight, bias = (None if x[k] is None else x[k].double() for k in ("hidden", "weight", "bias"))
        check_extras(result, extras[-1], reference.fused_linear_logprobs(hidden, weight, x["targets"], bias=bias,
                                                                           **options), tol)  # fmt: skip
    ignored = x["targets"] == options["ignore_index"]
    result.check("ignored targets exactly 0", float((logp[ignored] != 0).sum() + (entropy[ignored] != 0).sum()), 0.0)
    limits, naive_grads = {}, {}
    if cell.dtype == FP32_HEAD:
        limits = fp32_head_limits(ours, x, upstream, (ref_logp, ref_entropy, ref_grads))
    else:
        naive_grads = gradients(lambda h, w, t, bias: naive(h, w, t, bias, **options), x, upstream)[2]
    if limits:
        result.check("logp (fp32 head)", relative_error(logp, ref_logp), limits["logp"])
        result.check("entropy (fp32 head)", relative_error(entropy, ref_entropy), limits["entropy"])
    for k, g in ref_grads.items():
        bound = limits.get(f"d {k}", tol["gradient"])
        if bound is None:
            slack = tolerances.BF16_GRADIENT_SLACK
            bound = min(relative_error(naive_grads[k], g) + slack, tolerances.BF16_GRADIENT_CEILING)
        result.check(f"d {k}", relative_error(grads[k], g), bound)
    return result


def fp32_head_limits(ours, x: dict, upstream, exact) -> dict[str, float]:
    """The fp32 head's bounds: at most FP32_HEAD_FACTOR times the error of float32 GEMMs on the same inputs (the
    hidden states widened; their gradient rounded back to bf16, as the cast returns it), scaled by the head's product
    ratio (`tolerances.fp32_head_bound`), plus FP32_HEAD_FLOOR."""
    logp, entropy, grads = gradients(ours, {**x, "hidden": x["hidden"].float()}, upstream)
    grads["hidden"] = grads["hidden"].to(x["hidden"].dtype)
    ref_logp, ref_entropy, ref_grads = exact
    errors = {"logp": relative_error(logp, ref_logp), "entropy": relative_error(entropy, ref_entropy),
              **{f"d {k}": relative_error(grads[k], g) for k, g in ref_grads.items()}}  # fmt: skip
    ratio = harness.fp32_head_product_ratio(x["hidden"], x["weight"], tolerances.FLOOR)
    return {what: tolerances.fp32_head_bound(e, ratio) for what, e in errors.items()}


def check_extras(result: CellResult, extras, exact, tol) -> None:
    """The extra fields against the float64 reference's (without gradient)."""
    result.check("log_sum_sq_probs", relative_error(extras.log_sum_sq_probs, exact.log_sum_sq_probs), tol["logp"])
    result.check("mean_logits", relative_error(extras.mean_logits, exact.mean_logits), tol["logp"])
    mismatches = float((extras.is_top1 != exact.is_top1).double().mean())
    result.check("is_top1 mismatches (fraction)", mismatches, TOP1_MISMATCHES)


def run(audit_cells: list[LogProbsCell], size: Size, device: str, advance=lambda: None) -> list[CellResult]:
    results = []
    for cell in audit_cells:
        fp32_head = cell.dtype == FP32_HEAD
        dtype, weight_dtype = (torch.bfloat16, torch.float32) if fp32_head else (DTYPES[cell.dtype], None)
        results.append(audit_cell(cell, make_case(cell.case, size, dtype, device, weight_dtype=weight_dtype)))
        advance()
    return results
