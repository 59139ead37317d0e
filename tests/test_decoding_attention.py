"""`decoding_attention`: one query position's attention with each group's query heads as positions over their shared
key head equals SDPA over the key and value heads repeated for every query head (as transformers' SDPA function
repeats them under a mask), float32; calls it does not take run the model's own function; the decoding loop's steps
take it."""

from __future__ import annotations

import torch
from test_compiled_generation import varied_model
from test_decoding_loop import config, left_padded
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from compiled_grpo.integrations.trl import decoding_attention, decoding_loop


class Layer(torch.nn.Module):
    """What transformers' SDPA function reads of an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def inputs(batch=3, heads=12, key_heads=2, length=40, queries=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, heads, queries, 16, generator=g)
    key, value = (torch.randn(batch, key_heads, length, 16, generator=g) for _ in range(2))
    mask = torch.rand(batch, 1, queries, length, generator=g) > 0.3  # padding and a cache's empty slots
    mask[..., 0] = True
    return query, key, value, mask


def test_grouped_heads_equal_repeated_ones():
    query, key, value, mask = inputs()
    repeated = (t.repeat_interleave(6, dim=1) for t in (key, value))  # head h reads key head h // 6
    expected = torch.nn.functional.scaled_dot_product_attention(query, *repeated, attn_mask=mask, scale=0.25)
    expected = expected.transpose(1, 2)
    got, _ = decoding_attention.grouped_decoding_attention(sdpa_attention_forward, Layer(6), query, key, value, mask,
                                                           scaling=0.25)  # fmt: skip
    assert got.shape == expected.shape == (3, 1, 12, 16)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for mode in (torch.no_grad, torch.inference_mode):  # as decoding runs it
        with mode():
            again, _ = decoding_attention.grouped_decoding_attention(sdpa_attention_forward, Layer(6), query, key,
                                                                     value, mask, scaling=0.25)  # fmt: skip
        torch.testing.assert_close(again, expected, rtol=1e-5, atol=1e-6)
    swapped = key.flip(1)  # the key heads in the other order: the groups meet the wrong keys
    wrong, _ = decoding_attention.grouped_decoding_attention(sdpa_attention_forward, Layer(6), query, swapped, value,
                                                             mask, scaling=0.25)  # fmt: skip
    assert not torch.allclose(wrong, expected, rtol=1e-3, atol=1e-4)


def test_other_calls_run_the_models_own_function():
    calls = []

    def own(*args, **kwargs):
        calls.append(args[1].shape)
        return sdpa_attention_forward(*args, **kwargs)

    for query, key, value, mask in (inputs(queries=4), inputs(key_heads=12), inputs()[:3] + (None,)):
        decoding_attention.grouped_decoding_attention(own, Layer(12 // key.shape[1]), query, key, value, mask)
    assert len(calls) == 3  # several query positions, no groups, no mask


def test_the_loops_steps_attend_grouped(monkeypatch):
    """The loop's greedy tokens equal `generate`'s while its steps run the grouped attention (counted)."""
    monkeypatch.setattr(torch, "compile", lambda step, **options: step)
    grouped, real = [], decoding_attention.grouped_decoding_attention

    def counted(own, module, query, *args, **kwargs):
        grouped.append(decoding_attention.groups_as_positions(query, args[0], args[2]))
        return real(own, module, query, *args, **kwargs)

    monkeypatch.setattr(decoding_loop.packed_attention, "grouped_decoding_attention", counted)
    model, prompts = varied_model(seed=3), left_padded(4, seed=6)
    greedy = config(10, [1], do_sample=False)
    with torch.no_grad():
        expected = model.generate(**prompts, generation_config=greedy)
    got = decoding_loop.generate(model, {}, 64, greedy, **prompts)
    assert torch.equal(got, expected)
    assert len(grouped) == 2 * 9 and all(grouped)  # two layers, nine steps after the prompt's forward
