"""The comparison harness shared by the audit and the tests: fresh leaves, a call with backward, the float64
reference on the same inputs, plain full-logits bf16 autograd (the three-way bound's baseline), and the error
measure."""

from __future__ import annotations

import torch

from compiled_grpo import GRPOLossConfig, products
from compiled_grpo.head import make_head

from . import reference

HEAD = ("hidden", "weight", "bias")
PER_TOKEN = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")
POSITIONAL = ("hidden", "weight", "completion_ids", "completion_mask", "advantages")


def leaves(x: dict, dtype=None) -> dict:
    """A copy of the inputs with fresh leaves for hidden, weight and bias (converted to `dtype` if given)."""
    y = dict(x)
    for k in HEAD:
        if k in x:
            t = x[k].detach()
            y[k] = (t if dtype is None else t.to(dtype)).clone().requires_grad_()
    return y


def call(fn, x: dict, dtype=None, **extra):
    """fn(hidden, weight, ids, mask, advantages, **rest, **extra) on fresh leaves, then loss.backward();
    returns (output, gradients of the head tensors present)."""
    y = leaves(x, dtype)
    args = [y[k] for k in POSITIONAL]
    out = fn(*args, **{k: v for k, v in y.items() if k not in POSITIONAL}, **extra)
    out.loss.backward()
    return out, {k: y[k].grad for k in HEAD if k in y}


def run_fused(loss_fn, x: dict, **extra):
    return call(loss_fn, x, **extra)


def after_warm_ups(fn, backward, warm_ups: int = 2):
    """fn, called `warm_ups` times first on the same tensors, each followed by `backward(result)` and the leaves'
    gradients dropped: with captured calls (`capture=True` on a GPU) the first call of a layout runs uncaptured
    and the second captures it, so the call that is checked is a CUDA graph replay."""

    def warmed(*args, **kwargs):
        for _ in range(warm_ups):
            backward(fn(*args, **kwargs))
            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor) and t.is_leaf:
                    t.grad = None
        return fn(*args, **kwargs)

    return warmed


def run_reference(x: dict, settings: dict, **extra):
    """float64 on the inputs as given (already rounded to the tested dtype)."""
    return call(lambda *a, **k: reference.grpo_loss(*a, **k, **settings), x, torch.float64, **extra)


def run_packed_reference(x: dict, settings: dict, **extra):
    """The packed entry of the reference, float64, on packed inputs (`pack`)."""
    return call(lambda *a, **k: reference.grpo_loss_packed(*a, **k, **settings), x, torch.float64, **extra)


def pack(x: dict, keep_masked: bool = False) -> dict:
    """The padded batch x as packed targets: each row's positions in order (only the active ones unless
    `keep_masked`: then every position, and the layout is the padded one), one segment per row."""
    mask = x["completion_mask"].bool()
    B, T = mask.shape
    keep = torch.ones_like(mask) if keep_masked else mask
    segment_ids = torch.arange(B, device=mask.device).unsqueeze(1).expand(B, T)[keep]
    p = {
        "hidden": x["hidden"][keep],
        "weight": x["weight"],
        "completion_ids": x["completion_ids"][keep],
        "completion_mask": x["completion_mask"][keep],
        "advantages": x["advantages"] if x["advantages"].dim() == 1 else x["advantages"][keep],
        "segment_ids": segment_ids,
        "num_sequences": B,
    }
    for k in (*PER_TOKEN, "bias"):
        if k in x:
            p[k] = x[k] if k == "bias" else x[k][keep]
    ratio = x.get("importance_sampling_ratio")
    if ratio is not None:
        p["importance_sampling_ratio"] = ratio.reshape(B) if ratio.shape[-1] == 1 or ratio.dim() == 1 else ratio[keep]
    return p


def run_naive_bf16(x: dict, settings: dict):
    """Plain full-logits autograd in the inputs' dtype, the way a user would write it."""
    y = leaves(x)
    z = y["hidden"] @ y["weight"].T
    if "bias" in y:
        z = z + y["bias"]
    log_p = torch.log_softmax(z, dim=-1)
    logp = log_p.gather(-1, y["completion_ids"].unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    rest = {k: v for k, v in y.items() if k not in POSITIONAL and k not in HEAD}
    out = reference.grpo_objective(logp.float(), entropy.float(), y["completion_mask"], y["advantages"], **rest,
                                   **settings)  # fmt: skip
    out.loss.backward()
    return out, {k: y[k].grad for k in HEAD if k in y}


def relative_error(a, b, floor: float) -> float:
    """max |a - b| over max |b| (at least `floor`), NaN where both are NaN counted as equal."""
    a, b = a.detach().double(), b.detach().double()
    if b.numel() == 0:
        return 0.0
    both_nan = torch.isnan(a) & torch.isnan(b)
    diff = torch.where(both_nan, 0.0, (a - b).abs())
    return float(diff.max() / max(float(b.abs().nan_to_num(0.0).max()), floor))


def fp32_head_products(hidden: torch.Tensor, weight: torch.Tensor) -> dict | None:
    """The fp32 head's logits product x @ W.T in float64 ("exact"), by a float32 GEMM (TF32 off) and by the loss's
    own head (its bf16 terms' sums: `compiled_grpo.products`); None where its products are float32 GEMMs (a CPU)."""
    x, w = hidden.detach().reshape(-1, hidden.shape[-1]), weight.detach()
    if not products.splits(x, w):
        return None
    head = make_head(w, None, GRPOLossConfig(), torch.float32, split=True).with_whole_terms()  # the loss's own head
    split = products.gemm_product(x.float(), head)
    return {"exact": x.double() @ w.double().T, "float32": x.float() @ w.T, "split": split}


def fp32_head_product_ratio(hidden: torch.Tensor, weight: torch.Tensor, floor: float) -> float:
    """How many times further from float64 the fp32 head's logits product x @ W.T is than a float32 GEMM's (TF32
    off) on the same inputs, at least 1: exactly 1 where its products are float32 GEMMs (a CPU); on a GPU, that of
    its bf16 terms' tensor-core sums (`compiled_grpo.products`)."""
    made = fp32_head_products(hidden, weight)
    if made is None:
        return 1.0
    float32_error = relative_error(made["float32"], made["exact"], floor)
    return max(1.0, relative_error(made["split"], made["exact"], floor) / max(float32_error, floor * 2.0**-24))


def fp32_head_row_sum_ratio(x: dict, floor: float) -> float:
    """How many times further from float64 each row's summed target log-probs are (the sum vespo's weight
    exponentiates) under the fp32 head's logits product than under a float32 GEMM's (TF32 off), at least 1; the
    log-softmax taken in float64 from each product, so that only the product differs. Where the split product's
    errors lean one way along a row while a float32 GEMM's cancel, this exceeds `fp32_head_product_ratio`."""
    hidden, weight = x["hidden"].detach(), x["weight"].detach()
    products_by = fp32_head_products(hidden, weight)
    if products_by is None:
        return 1.0
    bias = x.get("bias")
    bias = torch.zeros(weight.shape[0], dtype=torch.float64, device=hidden.device) if bias is None else bias.detach()
    ids, mask = x["completion_ids"].reshape(-1, 1), x["completion_mask"].reshape(hidden.shape[:-1]).double()

    def row_sums(product: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(product.double() + bias.double(), -1).gather(-1, ids).reshape(mask.shape)
        return (logp * mask).sum(-1)

    exact = row_sums(products_by["exact"])
    errors = {k: float((row_sums(products_by[k]) - exact).abs().max()) for k in ("float32", "split")}
    return max(1.0, errors["split"] / max(errors["float32"], floor * 2.0**-24))
