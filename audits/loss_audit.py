"""The loss audit: the fused loss against the float64 reference, one cell per
loss type x IS level x top_entropy_quantile x dtype x mode (eager, compiled) x schedule (where valid).

Each cell checks the loss, every metric, per-token logp and entropy, the entropy mask (tokens that differ, and
whether each sits on the threshold within rounding), and the gradients of hidden, weight and bias.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from compiled_grpo import LOSS_TYPES, FusedLinearGRPOLoss

from . import harness, reference, tolerances
from .results import CellResult

reference_threshold = reference.objective.entropy_threshold

QUANTILES = (1.0, 0.8, 0.5, 0.2)
GROUP_QUANTILES = (1.0, 0.5, 0.2)
FEW_QUANTILES = (1.0, 0.2)  # the dense and the sparse gradient pass, every schedule: the captured and rounded cells
GROUP_SIZE = 2  # completions per prompt in the "groups" batches (B = 4 quick, 8 full)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the fp32 head (`cast_lm_head_to_fp32`): bf16 hidden states against a float32 weight and bias; on a GPU its
# products come from bf16 terms (compiled_grpo.products), checked against float32 GEMMs on the same inputs
FP32_HEAD = "fp32-head"


@dataclass(frozen=True)
class LossCell:
    loss_type: str
    level: str
    q: float
    dtype: str
    mode: str  # "eager" | "compiled" | "captured" (compiled, its work as CUDA graph replays: GPU only)
    schedule: str  # "memory" | "speed" | "sparse"
    batch: str = "random"  # "random" advantages, beta, bonus | "groups": GRPO groups, half tied | "packed"
    rounded: bool = False  # round_logits=True: the lm_head product rounded to bf16 before the softmax, as TRL's head

    @property
    def name(self) -> str:
        name = f"{self.loss_type:7s} {self.level:8s} q={self.q:<3} {self.dtype:8s} {self.mode:8s} {self.schedule:6s}"
        return name + ("" if self.batch == "random" else f" {self.batch}") + (" rounded" if self.rounded else "")

    def settings(self, T: int) -> dict:
        # groups: beta 0 and no bonus, where zero-advantage and masked-out tokens have no gradient at all
        groups = self.batch == "groups"
        s = {
            "loss_type": self.loss_type,
            "importance_sampling_level": self.level,
            "top_entropy_quantile": self.q,
            "beta": 0.0 if groups else 0.04,
            "entropy_coef": 0.0 if groups else 0.01,
            "max_completion_length": T,
        }
        if self.loss_type == "cispo":
            s["epsilon_high"] = 5.0  # cispo's cap is epsilon_high itself
        return s


def schedules(q: float) -> tuple[str, ...]:
    return ("memory", "speed", "sparse") if q == 1.0 else ("memory", "sparse")


def loss_cells(loss_types=LOSS_TYPES, dtypes=tuple(DTYPES), modes=("eager", "compiled")) -> list[LossCell]:
    """Every loss type x level x q x dtype x mode x valid schedule on random batches (captured: q in 1 and 0.2);
    and on GRPO groups (half of them at advantage 0), q in (1, 0.5, 0.2), the schedules that skip work (speed,
    sparse), eager; and `round_logits=True` (bfloat16, token level, q in 1 and 0.2, eager, on-policy), beside the
    default float32 product's cells; the fp32 head (FP32_HEAD: every loss type x level, q in 1 and 0.2, eager and
    compiled)."""
    out, same = [], tuple(d for d in dtypes if d in DTYPES)  # hidden states and weight in one dtype
    for loss_type, level, q, dtype, mode in itertools.product(
        loss_types, ("token", "sequence"), QUANTILES, same, modes
    ):
        if mode != "captured" or q in FEW_QUANTILES:
            out += [LossCell(loss_type, level, q, dtype, mode, schedule) for schedule in schedules(q)]
    if "eager" in modes:
        for loss_type, level, q, dtype in itertools.product(loss_types, ("token", "sequence"), GROUP_QUANTILES, same):
            skipping = tuple(s for s in schedules(q) if s != "memory")
            out += [LossCell(loss_type, level, q, dtype, "eager", schedule, "groups") for schedule in skipping]
        if "bfloat16" in dtypes:
            for loss_type, q in itertools.product(loss_types, FEW_QUANTILES):
                out += [LossCell(loss_type, "token", q, "bfloat16", "eager", schedule, rounded=True)
                        for schedule in schedules(q)]  # fmt: skip
        # packed (padding-free) batches against the reference's packed entry, one cell per loss type and schedule
        for loss_type, schedule in itertools.product(loss_types, ("speed", "sparse")):
            level = "sequence" if loss_type == "luspo" else "token"
            q = 1.0 if schedule == "speed" else 0.5
            out.append(LossCell(loss_type, level, q, "float32", "eager", schedule, "packed"))
    if FP32_HEAD in dtypes:
        for loss_type, level, q, mode in itertools.product(loss_types, ("token", "sequence"), FEW_QUANTILES, modes):
            if mode != "captured":
                out += [LossCell(loss_type, level, q, FP32_HEAD, mode, schedule) for schedule in schedules(q)]
    return out


@dataclass(frozen=True)
class Size:
    B: int
    T: int
    H: int
    V: int


QUICK = Size(B=4, T=37, H=32, V=1021)
FULL = Size(B=8, T=129, H=64, V=4099)


def group_advantages(B: int) -> torch.Tensor:
    """GRPO's advantages of B completions in groups of GROUP_SIZE with 0/1 rewards: every other group's rewards
    all tie (advantage exactly 0, TRL's frac_reward_zero_std), the others differ (normalized by their std)."""
    rewards = torch.zeros(B // GROUP_SIZE, GROUP_SIZE, dtype=torch.float64)
    rewards[::2] = 1.0
    rewards[1::2, 0] = 1.0
    centered = rewards - rewards.mean(-1, keepdim=True)
    return (centered / (rewards.std(-1, keepdim=True) + 1e-4)).reshape(B)


def make_batch(size: Size, dtype: torch.dtype, device: str, seed: int = 0, groups: bool = False,
               weight_dtype: torch.dtype | None = None) -> dict:  # fmt: skip
    """A micro-batch with padded tails, a fully masked row, off-policy old log-probs and a reference model;
    with `groups`, GRPO group advantages (half the groups at 0) instead of random ones; `weight_dtype`: the
    weight's and bias's, where not the hidden states'."""
    weight_dtype = weight_dtype or dtype
    g = torch.Generator().manual_seed(seed)
    B, T, H, V = size.B, size.T, size.H, size.V
    rn = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    mask[:, 0] = 1
    mask[0, T // 2 :] = 0
    mask[-1] = 0
    x = {
        "hidden": rn(B, T, H).to(dtype),
        "weight": (rn(V, H) * 2 / math.sqrt(H)).to(weight_dtype),
        "bias": (rn(V) * 0.3).to(weight_dtype),
        "completion_ids": torch.randint(0, V, (B, T), generator=g),
        "completion_mask": mask,
        "advantages": group_advantages(B) if groups else rn(B),
    }
    with torch.no_grad():
        logp = reference.grpo_loss(x["hidden"], x["weight"], x["completion_ids"], mask, x["advantages"],
                                   bias=x["bias"]).per_token_logps  # fmt: skip
    x["old_per_token_logps"] = (logp + rn(B, T) * 0.15).clamp(max=0.0)  # log-probs stay <= 0
    x["ref_per_token_logps"] = (logp + rn(B, T) * 0.3).clamp(max=0.0)
    return {k: v.to(device) for k, v in x.items()}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return harness.relative_error(a, b, tolerances.FLOOR)


def compare_masks(out, ref, mask, q: float, on_threshold_within: float, result: CellResult) -> bool:
    """Record mask agreement; True when the masks differ only at tokens on the threshold (the reference is
    then re-run with the fused mask so the rest of the cell compares like with like)."""
    if ref.entropy_mask is None:
        result.check("entropy_mask present", float(out.entropy_mask is not None), 0.0)
        return False
    diff = out.entropy_mask.cpu() != ref.entropy_mask.cpu()
    flips = int(diff.sum())
    if flips == 0:
        result.check("entropy_mask tokens differing", 0, 0)
        return False
    tau = float(reference_threshold(ref.entropy, mask.bool(), q))
    distance = (ref.entropy.cpu()[diff] - tau).abs() / max(1.0, abs(tau))
    on_threshold = bool((distance <= on_threshold_within).all())
    result.notes.append(
        f"{flips} token(s) on the other side of the threshold, max distance {float(distance.max()):.1e} "
        f"({'within rounding' if on_threshold else 'NOT within rounding'})"
    )
    result.check("entropy_mask off-threshold flips", 0.0 if on_threshold else float(flips), 0.0)
    return on_threshold


def output_errors(out, grads, ref, ref_grads) -> dict[str, float]:
    """Each checked output's relative error against the reference: the loss, the metrics both have, logp,
    entropy and the head's gradients."""
    shared = sorted(set(ref.metrics) & set(out.metrics))
    return {"loss": relative_error(out.loss, ref.loss),
            **{f"metric {n}": relative_error(out.metrics[n], ref.metrics[n]) for n in shared},
            "logp": relative_error(out.per_token_logps, ref.per_token_logps),
            "entropy": relative_error(out.entropy, ref.entropy),
            **{f"d {k}": relative_error(grads[k], ref_grads[k]) for k in harness.HEAD}}  # fmt: skip


def check_limits(cell: LossCell, errors: dict, naive: dict | None) -> dict[str, float]:
    """Each check's bound: the dtype's tolerance; with bf16 gradients, no further from the float64 truth than plain
    bf16 autograd (`naive`: its errors) plus a slack; with round_logits, every check so, plus a slack."""
    tol = tolerances.for_dtype(cell.dtype)
    limits = {}
    for what in errors:
        kind = what.split()[0] if what.split()[0] in ("metric", "d") else what
        if cell.rounded and kind != "d":
            limits[what] = naive.get(what, math.inf) + tolerances.ROUNDED_SLACK
        elif kind == "d" and naive is not None:
            limits[what] = min(naive[what] + tolerances.BF16_GRADIENT_SLACK, tolerances.BF16_GRADIENT_CEILING)
        else:
            limits[what] = tol["gradient" if kind == "d" else kind]
    return limits


def fp32_head_limits(cell: LossCell, settings: dict, x: dict, ref, ref_grads, result: CellResult) -> dict:
    """The fp32 head's bounds: each check at most FP32_HEAD_FACTOR times the error of float32 GEMMs (TF32 off) on
    the same inputs (the hidden states widened, their gradient rounded back to bf16 as the cast returns it), scaled
    by the head's product ratio (`tolerances.fp32_head_bound`), plus FP32_HEAD_FLOOR; the errors of float32 GEMMs,
    of TF32 (on a GPU) and of the weight rounded to bf16, and the ratio, in the notes."""
    loss_fn = FusedLinearGRPOLoss(compiled=cell.mode != "eager", schedule=cell.schedule, **settings)
    beside = {"float32 GEMMs": {**x, "hidden": x["hidden"].float()}, "bf16 weight": {
        **x, "weight": x["weight"].bfloat16(), "bias": x["bias"].bfloat16()}}  # fmt: skip
    if x["hidden"].is_cuda:
        beside["TF32"] = beside["float32 GEMMs"]
    errors = {}
    for name, inputs in beside.items():
        torch.backends.cuda.matmul.allow_tf32 = name == "TF32"
        try:
            out, grads = harness.run_fused(loss_fn, inputs)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
        grads["hidden"] = grads["hidden"].to(x["hidden"].dtype)
        errors[name] = output_errors(out, grads, ref, ref_grads)
        picked = {k: errors[name][k] for k in ("loss", "logp", "entropy", "d hidden", "d weight")}
        result.notes.append(f"{name}: " + ", ".join(f"{k} {v:.1e}" for k, v in picked.items()))
    ratio = harness.fp32_head_product_ratio(x["hidden"], x["weight"], tolerances.FLOOR)
    row_ratio = harness.fp32_head_row_sum_ratio(x, tolerances.FLOOR)
    scale = max(ratio, row_ratio) if reads_row_sums(settings) else ratio
    result.notes.append(f"the head's logits product: {ratio:.2f}x float32 GEMMs' error; each row's summed target "
                        f"log-probs from it: {row_ratio:.2f}x; the bounds' scale {scale:.2f}x")  # fmt: skip
    return {what: tolerances.fp32_head_bound(e, scale) for what, e in errors["float32 GEMMs"].items()}


def reads_row_sums(settings: dict) -> bool:
    """Whether the loss weighs each token by a function of its row's summed log-probs (vespo's phi of the summed
    log-ratio, sequence-level importance sampling's exp of the row's mean): its gradients then carry the row sum's
    error, which on a GPU's tensor cores grows with the row's length faster than a float32 GEMM's (their float32
    sums truncate, so the logits' errors lean one way and add up along a row: docs/precision.md)."""
    return settings["loss_type"] == "vespo" or settings["importance_sampling_level"] == "sequence"


def audit_cell(cell: LossCell, x: dict, size: Size, device: str) -> CellResult:
    settings = cell.settings(size.T)
    result = CellResult("loss", cell.name, params={**cell.__dict__})
    captured = cell.mode == "captured"
    loss_fn = FusedLinearGRPOLoss(compiled=cell.mode != "eager", schedule=cell.schedule, capture=captured,
                                  round_logits=cell.rounded, **settings)  # fmt: skip
    run_reference = harness.run_reference
    if cell.batch == "packed":  # the active tokens alone, one sequence per row, the empty row kept
        x, run_reference = harness.pack(x), harness.run_packed_reference
    if cell.rounded:  # on-policy: the clip bounds are jumps that bf16-rounded log-probs cross legitimately
        x = {k: v for k, v in x.items() if k != "old_per_token_logps"}
    fn = harness.after_warm_ups(loss_fn, lambda out: out.loss.backward()) if captured else loss_fn
    out, grads = harness.run_fused(fn, x)
    if captured:  # the checked call was a replay: its work ran as CUDA graphs
        result.check("ran as a CUDA graph replay", float(loss_fn.captures.replays == 0), 0.0)
    ref, ref_grads = run_reference(x, settings)
    naive, naive_grads = harness.run_naive_bf16(x, settings) if cell.dtype == "bfloat16" else (None, None)
    within = tolerances.MASK_ON_THRESHOLD[cell.dtype]
    if cell.rounded:  # rounded entropies: a flip within their rounding of the threshold is legitimate
        within = relative_error(naive.entropy, ref.entropy) + tolerances.ROUNDED_SLACK
    if compare_masks(out, ref, x["completion_mask"], cell.q, within, result):
        ref, ref_grads = run_reference(x, settings, entropy_mask_override=out.entropy_mask)
        if cell.rounded:
            naive, naive_grads = harness.run_naive_bf16(x, {**settings, "entropy_mask_override": out.entropy_mask})
    missing = set(ref.metrics) ^ set(out.metrics)
    result.check("metric names", float(len(missing)), 0.0)
    errors = output_errors(out, grads, ref, ref_grads)
    if cell.dtype == FP32_HEAD:  # against float32 GEMMs' errors on the same inputs
        limits = fp32_head_limits(cell, settings, x, ref, ref_grads, result)
    else:
        limits = check_limits(cell, errors, naive and output_errors(naive, naive_grads, ref, ref_grads))
    for what, error in errors.items():
        result.check(what, error, limits[what])
    result.params["errors"] = {c.what: c.error for c in result.checks}
    if cell.rounded:  # beside the default float32 product on the same batch
        default = FusedLinearGRPOLoss(compiled=cell.mode != "eager", schedule=cell.schedule, **settings)
        d_out, d_grads = harness.run_fused(default, x)
        errors = {"logp": relative_error(d_out.per_token_logps, ref.per_token_logps),
                  "entropy": relative_error(d_out.entropy, ref.entropy), "loss": relative_error(d_out.loss, ref.loss),
                  **{f"d {k}": relative_error(d_grads[k], ref_grads[k]) for k in harness.HEAD}}  # fmt: skip
        result.notes.append("default float32 product on this batch: " + ", ".join(f"{k} {v:.1e}" for k, v in
                                                                                   errors.items()))  # fmt: skip
    return result


def run(cells: list[LossCell], size: Size, device: str, seeds=(0,), advance=lambda: None) -> list[CellResult]:
    kinds = {(c.dtype, c.batch) for c in cells}
    batches = {(d, b, s): batch_of(d, size, device, s, b == "groups") for d, b in kinds for s in seeds}
    results = []
    for seed in seeds:
        for cell in cells:
            r = audit_cell(cell, batches[(cell.dtype, cell.batch, seed)], size, device)
            if len(seeds) > 1:
                r.name += f" seed={seed}"
            results.append(r)
            advance()
    return results


def batch_of(dtype: str, size: Size, device: str, seed: int, groups: bool) -> dict:
    if dtype == FP32_HEAD:
        return make_batch(size, torch.bfloat16, device, seed, groups, weight_dtype=torch.float32)
    return make_batch(size, DTYPES[dtype], device, seed, groups)
