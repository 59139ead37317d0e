"""TRL's fused LM head (`trl.kernels.ChunkedLogProbFunction`, which every TRL 1.16 trainer uses for its
per-token log-probs) on this library's primitive, switched on by `compiled_fused_head()`."""

from __future__ import annotations

import contextlib

import torch
import trl.trainer.utils as trl_utils

from ...logprobs import fused_linear_logprobs, fused_linear_logprobs_with_extras


class FusedHeadFunction:
    """TRL 1.16's `trl.kernels.ChunkedLogProbFunction` on this library's primitive: `apply` takes its arguments
    (hidden [N, H], weight, bias, targets [N], temperature, chunk_size, final_logit_softcapping, logit_scale,
    outputs) and returns its five outputs (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1; None
    for those `outputs` does not ask for). log_probs and entropy come from `fused_linear_logprobs` (differentiable,
    the backward skipping rows whose upstream gradients are zero); the other three, without gradient, from the
    same statistics pass (`fused_linear_logprobs_with_extras`) where any is asked for. `chunk_size` (TRL's
    vocabulary chunk) is not used: the tiles are this library's."""

    compiled = True
    capture = False  # the primitive's passes as CUDA graph replays (`fused_linear_logprobs(capture=True)`)
    round_logits = False  # the product rounded to 16 bits before the softmax, as TRL's own head does
    # the hidden states' dtype before `cast_lm_head_to_fp32` widened them (`compiled_fused_head(hidden_dtype=...)`)
    hidden_dtype = None

    @classmethod
    def apply(cls, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):  # fmt: skip
        head = {"bias": bias, "temperature": temperature, "logit_scale": logit_scale,
                "final_logit_softcapping": final_logit_softcapping, "compiled": cls.compiled}  # fmt: skip
        options = dict(entropy="entropy" in outputs, capture=cls.capture, round_logits=cls.round_logits, **head)
        wanted = [name in outputs for name in ("log_sum_sq_probs", "mean_logits", "is_top1")]
        if cls.hidden_dtype is not None and hidden.dtype == weight.dtype == torch.float32:
            hidden = hidden.to(cls.hidden_dtype)  # exact: TRL widened them; the float32 weight stays the head's
        if not any(wanted):
            return (*fused_linear_logprobs(hidden, weight, targets, **options), None, None, None)
        (logp, entropy), found = fused_linear_logprobs_with_extras(hidden, weight, targets, **options)
        return (logp, entropy, *(value if want else None for value, want in zip(found, wanted, strict=True)))


class EagerFusedHeadFunction(FusedHeadFunction):
    compiled = False


class CapturedFusedHeadFunction(FusedHeadFunction):
    capture = True


@contextlib.contextmanager
def compiled_fused_head(compiled: bool = True, capture: bool = False, round_logits: bool = False,
                        hidden_dtype: torch.dtype | None = None):  # fmt: skip
    """Inside the block, TRL's fused LM head (`add_fused_lm_head`, which every TRL 1.16 trainer uses for its
    per-token log-probs: GRPO, RLOO, DPO, KTO, SFT, async GRPO) runs on `fused_linear_logprobs`. Models patched
    before or inside the block alike: the patched forward looks the function up on each call. `capture`
    (experimental, compiled, GPU): the primitive's passes as CUDA graph replays. `round_logits=True`: the log-probs
    and entropies of the lm_head product rounded to 16 bits, as TRL's own head computes them (fewer bytes per
    logit; the extra fields TRL logs come from the same rounded logits, as float32 values). `hidden_dtype`: with
    `cast_lm_head_to_fp32=True`, the dtype of the model's hidden states before TRL widens them to float32
    (torch.bfloat16 for a bf16 model): they are narrowed back to it, exactly, so that the float32 head's products
    come from bf16 terms on a GPU (docs/precision.md) instead of float32 GEMMs; it must be their dtype."""
    if capture and not compiled:
        raise ValueError("compiled_fused_head: capture=True needs compiled=True")
    if not isinstance(round_logits, bool):
        raise ValueError(f"compiled_fused_head: round_logits must be True or False, got {round_logits!r}")
    if hidden_dtype not in (None, torch.bfloat16, torch.float16):
        raise ValueError(f"compiled_fused_head: hidden_dtype must be torch.bfloat16, torch.float16 or None, got "
                         f"{hidden_dtype!r}")  # fmt: skip
    previous = trl_utils._ChunkedLogProbFunction
    chosen = CapturedFusedHeadFunction if capture else FusedHeadFunction
    chosen = chosen if compiled else EagerFusedHeadFunction
    if round_logits or hidden_dtype is not None:
        options = {"round_logits": round_logits, "hidden_dtype": hidden_dtype}
        chosen = type(f"Configured{chosen.__name__}", (chosen,), options)
    trl_utils._ChunkedLogProbFunction = chosen
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = previous
