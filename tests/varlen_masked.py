"""torch's varlen FlashAttention (CUDA only) standing in on a CPU for compiled code: the same attention as
`test_train_checkpointed.varlen_on_the_cpu`, computed as one SDPA over the packed row with a dense mask built on
the device from the boundaries (no read back to the host, so dynamo traces it whole, inside the stack's nested
regions too): each query attends to its own sequence's keys, causal from the end (its last query sees every key)."""

from __future__ import annotations

import torch

from compiled_grpo.integrations.trl import packed_attention

CAUSAL = (-1, 0)


def segments(bounds: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the sequence of each of `count` packed tokens, its offset in that sequence) from cumulative `bounds`."""
    token = torch.arange(count, device=bounds.device)
    sequence = torch.searchsorted(bounds[1:].long(), token, right=True)
    return sequence, token - bounds.long()[sequence]


def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """`torch.nn.attention.varlen.varlen_attn`'s signature and result ([tokens, heads, head_dim]; causal only)."""
    assert window_size == CAUSAL and cu_q.dtype == cu_k.dtype == torch.int32, (window_size, cu_q.dtype)
    seq_q, at_q = segments(cu_q, q.shape[0])
    seq_k, at_k = segments(cu_k, k.shape[0])
    surplus = (cu_k[1:] - cu_k[:-1] - (cu_q[1:] - cu_q[:-1])).long()[seq_q]  # keys before a sequence's first query
    seen = (seq_q[:, None] == seq_k[None, :]) & (at_k[None, :] <= (at_q + surplus)[:, None])
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=seen, scale=scale,
                                                           enable_gqa=enable_gqa)  # fmt: skip
    return out[0].transpose(0, 1)


def install(monkeypatch) -> None:
    """Packed forwards on this stand-in wherever they would run torch's varlen FlashAttention."""
    monkeypatch.setattr(packed_attention, "varlen_attn", varlen_attn)
    monkeypatch.setattr(packed_attention, "varlen_unavailable", lambda device, sixteen_bit: None)
