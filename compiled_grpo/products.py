"""The lm_head's three GEMM products, each summed in float32: the logits' x @ W.T, dX = G @ W and dW = G.T @ x
(G: the gradient of the raw logits).

16-bit weights: one GEMM each, 16-bit inputs with float32 accumulation. A float32 weight against 16-bit hidden states
(the fp32 head of `cast_lm_head_to_fp32`): the hidden states arrive widened to float32 (exact), and on a GPU each
product is formed by bf16 tensor-core GEMMs from a split of the float32 operands, a = a_1 + a_2 + ..., each term the
bf16 rounding of what the terms before it left (8 more bits of the mantissa per term), the partial products summed
in float32 (`Head.terms`: the weight's terms, made once per pass). The hidden states are exact in bf16 and need no
split; G is split where it is multiplied. Three terms carry the float32 operands' 24 bits: where the sums are exact
float32 ones (a CPU), the products are as close to float64 as float32 GEMMs. On an H200 the tensor cores' own float32
sums over a GEMM's K drift further (a bf16 GEMM's logits at H3584: 3.5x a float32 GEMM's rms error, the same with 2
or 3 terms), at bf16 tensor-core speed instead of float32's (about 12x slower there): docs/precision.md.
"""

from __future__ import annotations

import functools

import torch

SPLIT_TERMS = 3  # bf16 terms of the float32 operands of the logits and of dW (docs/precision.md: 2 and 3 measured)
# dX's pairs (G_i, W_j) with i + j < this: dX is rounded to the bf16 hidden states' dtype, far above these
# products' 2**-16 relative remainder
HIDDEN_GRADIENT_TERMS = 2
SPLIT_ON_CPU = False  # tests set it to run the split products where no GPU is (each term's GEMM then in float32)


def add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool = False) -> None:
    """acc += a @ b in place (acc = a @ b when `first`: acc need not be initialized, and is not read), the
    product accumulated in acc's (float32 or float64) precision: a tile's product is never rounded to 16 bits
    before the sum over tiles (that rounding biases training)."""
    beta = 0 if first else 1
    if a.dtype == acc.dtype:
        torch.addmm(acc, a, b, beta=beta, out=acc)
    elif a.is_cuda:
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)
    else:  # CPU has no 16-bit GEMM with a float32 output
        torch.addmm(acc, a.to(acc.dtype), b.to(acc.dtype), beta=beta, out=acc)


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with float32 output, the product accumulated in float32 (16-bit inputs stay 16-bit on the GPU)."""
    if a.dtype in (torch.float32, torch.float64):
        return torch.mm(a, b).to(torch.promote_types(a.dtype, torch.float32))
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())  # CPU has no 16-bit GEMM with float32 output


def fp32_head(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this is an fp32 head: a float32 weight against 16-bit hidden states."""
    return weight.dtype == torch.float32 and hidden.dtype in (torch.float16, torch.bfloat16)


def splits(hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the head's products come from bf16 terms: bf16 hidden states against a float32 weight, on a GPU."""
    on_device = hidden.is_cuda or SPLIT_ON_CPU
    return on_device and hidden.dtype == torch.bfloat16 and fp32_head(hidden, weight)


def widened(hidden: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor | None:
    """An fp32 head's hidden states in float32 (exact: the head is then a float32 one throughout, and their
    gradient comes back in their dtype through the cast); else as they are."""
    return hidden.float() if hidden is not None and fp32_head(hidden, weight) else hidden


def bf16_terms(a: torch.Tensor, count: int | None = None) -> list[torch.Tensor]:
    """a (float32) as `count` (default SPLIT_TERMS) bf16 tensors whose float32 sum approaches it (a is kept)."""
    return list(terms_leaving_rest(a.clone(), count))


def terms_kept(a: torch.Tensor, count: int):
    """a's bf16 terms as `terms_leaving_rest` makes them, one at a time, with a itself given back after the last
    (no copy of a: what each term leaves is formed in a, and adding the terms back restores a exactly, each
    subtraction and addition being exact in float32)."""
    made = []
    for term in terms_leaving_rest(a, count):
        made.append(term)
        yield term
    for term in reversed(made[:-1]):
        a.add_(term)


def terms_leaving_rest(a: torch.Tensor, count: int | None = None):
    """a (float32) as `count` (default SPLIT_TERMS) bf16 terms, one at a time, each the bf16 rounding of what the
    ones before it left; a itself is left holding that rest (no copy of a)."""
    count = count or SPLIT_TERMS
    for i in range(count):
        term = a.to(torch.bfloat16)
        yield term
        if i + 1 < count:
            a.sub_(term)


TERM_ROWS = 8192  # vocabulary rows split at a time by `weight_terms` (its only float32 temporary: [rows, H])


def weight_terms(weight: torch.Tensor) -> torch.Tensor:
    """The float32 weight [V, H] as its bf16 terms side by side, [V, SPLIT_TERMS * H] (term i in columns
    i H .. (i + 1) H): a slice of vocabulary rows is a slice of rows, and the logits are one GEMM over them.
    Written a slice of rows at a time: the terms are the only [V, H]-sized tensor it makes (a whole-weight split
    held the terms twice at its peak, or a float32 copy of the weight beside them)."""
    vocab, hidden_size = weight.shape
    out = torch.empty(vocab, SPLIT_TERMS * hidden_size, dtype=torch.bfloat16, device=weight.device)
    buffer = torch.empty(min(vocab, TERM_ROWS), hidden_size, dtype=weight.dtype, device=weight.device)
    with torch.no_grad():
        for v0 in range(0, vocab, TERM_ROWS):
            rows = min(TERM_ROWS, vocab - v0)
            rest = buffer[:rows].copy_(weight[v0 : v0 + rows])
            for i in range(SPLIT_TERMS):
                term = out[v0 : v0 + rows, i * hidden_size : (i + 1) * hidden_size]
                term.copy_(rest)  # rounded to the nearest bf16, as `.to` rounds
                if i + 1 < SPLIT_TERMS:
                    rest.sub_(term)
    return out


def _term(terms: torch.Tensor, i: int) -> torch.Tensor:
    hidden_size = terms.shape[1] // SPLIT_TERMS
    return terms[:, i * hidden_size : (i + 1) * hidden_size]


def gemm_product(x, head) -> torch.Tensor:
    """x @ w.T, accumulated in float32: output in float32 (float64 for float64 inputs), or with `head.rounded`
    rounded to x's dtype, as TRL's head and plain torch keep their logits (half the bytes for its readers)."""
    if head.split and head.terms is None:
        raise RuntimeError("a split head's whole-vocabulary product needs its terms: Head.with_whole_terms()")
    if head.terms is not None:
        # one GEMM per term, summed in float32 from the smallest up: one GEMM over the terms side by side (K = terms x
        # H) was 5x further from float64 on an H200, its tensor cores summing a longer K with truncation
        x16 = x.to(torch.bfloat16)
        partial = [matmul_fp32(x16, _term(head.terms, j).T) for j in reversed(range(SPLIT_TERMS))]
        return functools.reduce(torch.add, partial)
    if not head.rounded or x.dtype in (torch.float32, torch.float64):
        return matmul_fp32(x, head.weight.T)
    # the GEMM's own 16-bit output (a buffer, so torch.compile keeps the rounding: a cast to 16 bits and back
    # inside a fused kernel would be elided)
    return torch.mm(x, head.weight.T)


def whole_terms_bytes(head) -> int:
    """The bytes of a split head's whole terms (`Head.with_whole_terms`): SPLIT_TERMS bf16 copies of the weight;
    0 for a head without a split."""
    return SPLIT_TERMS * 2 * head.weight.numel() if head.split else 0


def product_bytes(head) -> int:
    """Bytes per entry of `gemm_product`'s output: 2 where the head rounds a 16-bit GEMM's product, else 4 (the
    fused kernels that read it form the float32 logits in registers)."""
    return 2 if head.rounded and head.weight.dtype in (torch.float16, torch.bfloat16) else 4


def add_hidden_gradient(acc: torch.Tensor, g: torch.Tensor, head, first: bool = False) -> None:
    """acc (+)= g @ W (`add_matmul`); from split terms, the pairs (G_i, W_j) with i + j < HIDDEN_GRADIENT_TERMS."""
    if head.terms is None:
        add_matmul(acc, g, head.weight, first)
        return
    for i, g_i in enumerate(terms_kept(g, HIDDEN_GRADIENT_TERMS)):
        for j in range(HIDDEN_GRADIENT_TERMS - i):
            add_matmul(acc, g_i, _term(head.terms, j), first and i == j == 0)


def hidden_gradient_into(out: torch.Tensor, g: torch.Tensor, head) -> None:
    """out = g @ W, written in out's dtype (x's: 16-bit for a 16-bit head, float32 for the split one)."""
    if head.terms is None:
        torch.mm(g, head.weight, out=out)
    else:
        add_hidden_gradient(out, g, head, first=True)


def add_weight_gradient(acc: torch.Tensor, g_t: torch.Tensor, x: torch.Tensor, head, first: bool = False) -> None:
    """acc (+)= g_t @ x (`add_matmul`): dW's share of some tokens; from split terms, G's terms against x in bf16
    (exact). g_t is used up (its buffer holds what each term leaves)."""
    if head.terms is None:
        add_matmul(acc, g_t, x, first)
        return
    x16 = x.to(torch.bfloat16)
    for i, g_i in enumerate(terms_leaving_rest(g_t)):
        add_matmul(acc, g_i, x16, first and i == 0)


def weight_gradient_into(out: torch.Tensor, g_t: torch.Tensor, x: torch.Tensor, head) -> torch.Tensor:
    """out = g_t @ x, written in out's dtype (the weight's)."""
    if head.terms is None:
        return torch.mm(g_t, x, out=out)
    add_weight_gradient(out, g_t, x, head, first=True)
    return out
