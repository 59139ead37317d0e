"""Every tolerance of the audit, written down once, with its reason.

Errors are relative to the quantity's largest magnitude over the batch (max |fused - ref| / max |ref|), so an
entry that happens to be near zero cannot make a relative error meaningless; a floor keeps exactly-zero
quantities (a loss of 0 on an all-zero advantage batch) from dividing by zero.
"""

from __future__ import annotations

FLOOR = 1e-6

# float32: statistics are accumulated in float32 over the vocabulary (log-sum-exp of ~1e3..1e5 terms), so
# per-token logp and entropy carry ~1e-6 relative rounding; the loss and metrics are sums over tokens of those.
# Gradients add one float32 GEMM over H or over the active tokens (~1e-6 each, a few ulps over the sum).
# The loss and metrics sum per-token terms over up to ~1000 tokens; vespo's weight exponentiates a row's *summed*
# log-ratio (phi = exp(lam + k lw - lam e^lw)), so per-token errors add up over the row before being amplified by
# k: the --full sweep (T=129, V=4099) measured up to 1.6e-5 there, against ~3e-6 for the other loss types.
FP32 = {
    "loss": 5e-5,
    "metric": 5e-5,  # masked means of float32 quantities (counts are exact unless a token sits on a clip bound)
    "logp": 1e-5,
    "entropy": 1e-5,
    "gradient": 3e-5,  # float32 GEMMs over H and over N tokens: error grows with sqrt(N) ulps
}

# bf16: the reference is taken on the bf16-rounded inputs (input rounding is no implementation's fault).
# Statistics are float32 accumulations of products of bf16 inputs, so logp/entropy/loss stay near float32
# accuracy. Gradients go through bf16 GEMMs (the logits' gradient is rounded to bf16, 2**-8 relative, before
# the dX and dW products), so they are held to a three-way bound instead: no further from the float64 truth
# than plain full-logits autograd in bf16 (what a user would write), plus BF16_GRADIENT_SLACK of the scale.
BF16 = {
    "loss": 5e-5,  # as float32: the statistics are the same float32 accumulations (measured up to 2.8e-5, sapo)
    "metric": 5e-5,
    "logp": 1e-5,
    "entropy": 1e-5,
    "gradient": None,  # three-way, see BF16_GRADIENT_SLACK
}
BF16_GRADIENT_SLACK = 2e-3
# ... and never looser than this: naive bf16 can be off by 100% where its rounded log-probs cross a clip bound,
# which would make the three-way bound say nothing. Rounding the logits' gradient to bf16 (3.9e-3 relative per
# element) before float32-accumulated GEMMs gives a few times 2**-8 at most.
BF16_GRADIENT_CEILING = 1.5e-2

# round_logits=True (the product rounded to bf16 before the softmax, as TRL's head and plain torch): its statistics
# carry bf16's rounding of every logit (2**-8 relative), so every quantity is held to the three-way bound, no
# further from the float64 truth than plain full-logits bf16 autograd (the same rounding) plus this of the scale;
# a token may cross the entropy threshold where its entropy lies within that rounding of it.
ROUNDED_SLACK = 2e-3

# The fp32 head (a float32 weight against bf16 hidden states): every check at most this factor times the error of
# float32 GEMMs (TF32 off) on the same inputs, plus the floor (a float32 rounding or two of an O(1) quantity, so
# that a check float32 GEMMs get exactly right, a loss of 0 say, is not held to 0). On a CPU its products are
# float32 GEMMs. On a GPU they come from bf16 terms whose tensor-core sums round differently from a float32 GEMM's:
# there the bound is scaled by how many times further from float64 the head's own logits product is than a float32
# GEMM's on the cell's inputs (`harness.fp32_head_product_ratio`, at least 1). Why: to first order a check's error
# is A e + c, with e the product's error, A how much the loss amplifies it (vespo's weight exponentiates a row's
# summed log-ratios, so its A is large) and c the float32 work both share; with e r times float32 GEMMs' e', the
# error is at most r (A e' + c). Where A e dominates (vespo's d weight and d bias) the ratio of the errors is r
# itself, which a fixed factor of 2 does not cover when r > 2; where c dominates it stays near 1.
FP32_HEAD_FACTOR = 2.0
FP32_HEAD_FLOOR = 2e-7


def fp32_head_bound(float32_gemms_error: float, product_ratio: float = 1.0) -> float:
    """An fp32-head check's bound, from float32 GEMMs' error on the same inputs and the head's product ratio."""
    return FP32_HEAD_FACTOR * product_ratio * float32_gemms_error + FP32_HEAD_FLOOR


# An entropy-mask difference is legitimate only for a token whose entropy lies within rounding of the
# threshold: float32 statistics (fp32 and bf16 runs alike) put ~1e-6 relative error on each entropy.
MASK_ON_THRESHOLD = {"float32": 1e-5, "bfloat16": 1e-4, "fp32-head": 1e-5}

# Quantile audit: the threshold is computed in float32 (torch.quantile's own dtype) from float32 values, and
# compared with numpy / scipy in float64 on the same float32 values: one float32 rounding of the interpolation.
QUANTILE = 2e-7  # relative to max(|value range|, 1e-30), i.e. about 2 float32 ulps

# Entropy audit: the streaming fold in float32 against scipy in float64 on the same float32 logits. logsumexp
# is relative to |lse| (shifted by the max, no cancellation); entropy is absolute (it is O(1) at most
# log V ~ 12, and exactly 0 for a one-hot distribution, where a relative error is meaningless).
LOGSUMEXP = 2e-6
ENTROPY = 2e-5


def for_dtype(dtype_name: str) -> dict:
    return FP32 if dtype_name in ("float32", "fp32-head") else BF16
