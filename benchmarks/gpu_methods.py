"""The methods `benchmarks.gpu` times: each takes (shape, inputs) and returns a closure that runs one forward +
backward of the whole loss, or a string saying why it does not run there.

Baselines: the three lm_head GEMMs over the active tokens alone (the floor); full logits with autograd; the loss a
user would write on full logits under plain torch.compile, with and without the entropy TRL logs; TRL 1.16.0's
fused LM head (`ChunkedLogProbFunction`, with TRL's compaction of padded positions); Liger 0.8.5's
`LigerFusedLinearGRPOLoss` and its Hopper CuTe head; Unsloth's head (benchmarks/unsloth_head.py); verl 0.9.1's
Triton head (benchmarks/verl_triton.py). Every head without a loss of its own gets the same loss on top. Then this
library's schedules and its primitive, at the default float32 product and rounded (`round_logits=True`), and
captured (`capture=True`) at the hidden sizes where CompiledGRPOTrainer captures.
"""

from __future__ import annotations

import torch

import reference
from benchmarks import unsloth_head, verl_triton
from compiled_grpo import FusedLinearGRPOLoss, fused_linear_logprobs, primitive_captures


def loss_settings(shape) -> dict:
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
        logits = (hidden.to(weight.dtype) @ weight.T).float()
        log_p = torch.log_softmax(logits, -1)
        logp = log_p.gather(-1, x["ids"].unsqueeze(-1)).squeeze(-1)
        return logp, -(log_p.exp() * log_p).sum(-1)

    return head_then_loss(logp_entropy, shape, x)


def plain_compile(entropy: bool = True):
    """The loss a user would write on full logits, under torch.compile (dapo, on-policy, token level); `entropy`:
    also the mean entropy TRL logs (without gradient, but its softmax over the vocabulary is computed)."""

    def make(shape, x):
        if shape.q < 1 or shape.beta:
            return "not written: the plain loss here is dense dapo without KL"

        def plain_loss(hidden, weight, ids, mask, advantages):
            log_p = (hidden @ weight.T).float().log_softmax(-1)
            logp = log_p.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
            ratio = torch.exp(logp - logp.detach())
            a = advantages.unsqueeze(-1)
            per_token = -torch.min(ratio * a, ratio.clamp(0.8, 1.2) * a)
            tokens = mask.sum().clamp(min=1)
            loss = (per_token * mask).sum() / tokens
            if not entropy:
                return loss, None
            mean_entropy = (-(log_p.exp() * log_p).sum(-1).detach() * mask).sum() / tokens
            return loss, mean_entropy

        compiled = torch.compile(plain_loss)

        def run():
            h = x["hidden"].detach().requires_grad_()
            compiled(h, x["weight"], x["ids"], x["mask"], x["advantages"])[0].backward()

        return run

    return make


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
    if not x["hidden"].is_cuda or torch.cuda.get_device_capability() != (9, 0):
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


def verl_triton_head(shape, x):
    """verl 0.9.1's Triton `linear_cross_entropy` (per-token log-probs and entropies, as verl's actor calls it
    under `use_fused_kernels`) over the active tokens, followed by the same loss."""
    if not x["hidden"].is_cuda:
        return "skipped: verl's Triton head runs on a GPU"
    loaded = verl_triton.load()
    if isinstance(loaded, str):
        return loaded
    linear_cross_entropy, _ = loaded
    mask = x["mask"].bool()

    def head(hidden, weight):
        logp, entropy = linear_cross_entropy(hidden[mask], weight, x["ids"][mask], 1.0, "none")
        scatter = lambda t: t.new_zeros(mask.shape, dtype=torch.float32).masked_scatter(mask, t.float())
        return scatter(logp), scatter(entropy)

    return head_then_loss(head, shape, x)


def where_trainer_captures(make):
    """A captured method only at the hidden sizes where CompiledGRPOTrainer captures by default."""

    def made(shape, x):
        try:
            from compiled_grpo.integrations.trl import CAPTURED_HIDDEN_SIZE
        except ImportError:  # without TRL: measured at every size
            CAPTURED_HIDDEN_SIZE = shape.H
        if shape.H > CAPTURED_HIDDEN_SIZE:
            return f"not run: CompiledGRPOTrainer captures up to hidden size {CAPTURED_HIDDEN_SIZE}"
        return make(shape, x)

    return made


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
    "plain loss under torch.compile, with entropy": plain_compile(entropy=True),
    "plain loss under torch.compile, no entropy": plain_compile(entropy=False),
    "TRL 1.16 fused head + loss": trl_fused_head,
    "Liger 0.8.5": liger,
    "Liger 0.8.5 CuTe head + loss": liger_cute_head,
    "Unsloth (unsloth_zoo 2026.10.9) head + loss": unsloth,
    "verl 0.9.1 Triton head + loss": verl_triton_head,
    "compiled_grpo speed, eager": ours("speed", False),
    "compiled_grpo speed, compiled": ours("speed", True),
    "compiled_grpo memory, eager": ours("memory", False),
    "compiled_grpo memory, compiled": ours("memory", True),
    "compiled_grpo sparse, compiled": ours("sparse", True),
    "compiled_grpo auto, compiled": ours("auto", True),
    "compiled_grpo auto, compiled, packed": ours("auto", True, packed=True),
    "compiled_grpo primitive + loss, compiled": primitive(),
    # the opt-in forms: round_logits=True ("rounded"), capture=True ("captured")
    "compiled_grpo speed, compiled, rounded": ours("speed", True, round_logits=True),
    "compiled_grpo memory, compiled, rounded": ours("memory", True, round_logits=True),
    "compiled_grpo auto, compiled, rounded": ours("auto", True, round_logits=True),
    "compiled_grpo primitive + loss, compiled, rounded": primitive(round_logits=True),
    "compiled_grpo speed, compiled, captured": where_trainer_captures(ours("speed", True, capture=True)),
    "compiled_grpo memory, compiled, captured": where_trainer_captures(ours("memory", True, capture=True)),
    "compiled_grpo sparse, compiled, captured": where_trainer_captures(ours("sparse", True, capture=True)),
    "compiled_grpo auto, compiled, captured": where_trainer_captures(ours("auto", True, capture=True)),
    "compiled_grpo primitive + loss, compiled, captured": where_trainer_captures(primitive(capture=True)),
}

# The headline run (docs/benchmarks/gpu.md, README's tables): every baseline, and this library's speed, memory and
# auto schedules and primitive at the default float32 product and rounded, captured where the trainer captures.
HEADLINE = (
    "floor: three lm_head GEMMs",
    "plain loss under torch.compile, with entropy",
    "plain loss under torch.compile, no entropy",
    "TRL 1.16 fused head + loss",
    "Liger 0.8.5",
    "Liger 0.8.5 CuTe head + loss",
    "Unsloth (unsloth_zoo 2026.10.9) head + loss",
    "verl 0.9.1 Triton head + loss",
    "compiled_grpo speed, compiled",
    "compiled_grpo memory, compiled",
    "compiled_grpo auto, compiled",
    "compiled_grpo primitive + loss, compiled",
    "compiled_grpo speed, compiled, rounded",
    "compiled_grpo memory, compiled, rounded",
    "compiled_grpo auto, compiled, rounded",
    "compiled_grpo primitive + loss, compiled, rounded",
    "compiled_grpo auto, compiled, captured",
    "compiled_grpo primitive + loss, compiled, captured",
)


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
