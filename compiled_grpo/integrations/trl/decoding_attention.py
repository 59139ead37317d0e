"""One decoding step's attention with fewer key and value heads than query heads, without repeating them.

transformers' SDPA attention (5.17) repeats every key and value head for each query head that shares it whenever it
passes a mask (`repeat_kv`), and a static cache's decoding step always passes one: per layer and token, a copy of
the whole cache as many times larger as the heads' groups (6x at Qwen2.5-1.5B, 7x at 7B), written and read again,
about as many bytes as the weights themselves. With one query position, the query heads of a group can stand in
for query positions instead: [batch, key heads, group, head_dim] against the cache's [batch, key heads, length,
head_dim], under the same mask (one row per sequence, broadcast), the same softmax over the same keys. Other calls
(several query positions, no groups, a mask per head) run the model's own function.
"""

from __future__ import annotations

import torch

GROUPED_DECODING = "grouped-decoding"


def groups_as_positions(query: torch.Tensor, key: torch.Tensor, attention_mask) -> bool:
    """Whether a call can run grouped: one query position, query heads in groups over the key heads, a 4D mask shared
    by every head (without a mask, SDPA's own call already runs the groups unrepeated)."""
    single, grouped = query.shape[2] == 1, query.shape[1] > key.shape[1]
    shared_mask = attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
    return single and grouped and shared_mask


def grouped_decoding_attention(own, module, query, key, value, attention_mask, *, dropout=0.0, scaling=None,
                               **kwargs):  # fmt: skip
    """SDPA of one query position per sequence, each group's query heads as positions over their shared key head;
    ([batch, 1, heads, head_dim], None) as transformers' attention functions return. `own`: the model's function,
    for every other call."""
    if dropout or not groups_as_positions(query, key, attention_mask):
        return own(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    grouped = query.reshape(batch, key.shape[1], heads // key.shape[1], dim)  # head h = key head h // group
    # the mask, [batch, 1, 1, length], holds for every row of every group
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask,
                                                           scale=scaling)  # fmt: skip
    return out.reshape(batch, 1, heads, dim), None
