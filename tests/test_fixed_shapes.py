"""Packed rows of fixed shapes (`packing.Shapes(fixed=True)`, what `compile_backbone="graphs"` packs): padded to a
few capacities, their segment boundaries to a power of two of entries (the extra segments empty), their longest
lengths to the capacities. The step equals GRPOTrainer's (every loss type, checkpointing both ways, skip modes,
shared prompts) on SDPA and on a CPU stand-in of varlen FlashAttention, and over 50 steps of random lengths the
attention sees no more shapes than there are capacities in the range (without fixed shapes it sees many more)."""

from __future__ import annotations

import pytest
import torch
from test_integration_trl import loss_and_grads, make_trainer
from test_padding_free import LOSS_TYPES, C, P, varied_batch, with_logps
from test_skip_zero_advantage import assert_same, tiny_qwen2, trl_loss
from test_train_checkpointed import varlen_on_the_cpu, varlen_stand_in  # noqa: F401

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, packed_attention, packing


def test_capacities_are_few_and_pad_at_most_a_quarter():
    capacities = sorted({packing.capacity(t, 256) for t in range(1, 16385)})
    assert capacities[:4] == [256, 512, 768, 1024]
    assert capacities[4:] == [1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288,
                              14336, 16384]  # fmt: skip
    for tokens in range(1, 16385, 7):
        found = packing.capacity(tokens, 256)
        assert found >= tokens and (tokens <= 1024 or found <= 1.25 * tokens)
    assert [packing.segment_slots(n) for n in (1, 16, 17, 40)] == [17, 17, 33, 65]


def fixed_trainer(tmp_path, attention="auto", skip="off", fixed=True, **settings):
    options = {"padding_free": "pack", "packed_attention": attention}
    trainer = make_trainer(CompiledGRPOTrainer, tmp_path, tiny_qwen2(), skip=skip, options=options, **settings)
    trainer.packed_shapes = packing.Shapes(16, fixed=fixed)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def matches_trl(trainer, inputs, metrics=True):
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert trainer.packing_refused == "" and trainer._metrics["train"]["padding_free/packed_fraction"] == [1.0]
    ours = (ours[0], ours[1], {k: v for k, v in ours[2].items() if not k.startswith("shared_prompts/")})
    assert_same(ours, theirs, metrics=metrics)


@pytest.mark.parametrize("q", [1.0, 0.5])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_on_fixed_shapes_equals_trl(tmp_path, varlen_stand_in, loss_type, q):  # noqa: F811
    trainer = fixed_trainer(tmp_path, "varlen", loss_type=loss_type, top_entropy_quantile=q)
    matches_trl(trainer, with_logps(trainer, varied_batch(), 0.0))


@pytest.mark.parametrize("checkpointing", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("attention", ["varlen", "auto"])
def test_checkpointed_fixed_shapes_equal_trl(tmp_path, varlen_stand_in, attention, checkpointing):  # noqa: F811
    trainer = fixed_trainer(tmp_path, attention, loss_type="grpo", beta=0.04)
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
    trainer.model.enable_input_require_grads()
    matches_trl(trainer, with_logps(trainer, varied_batch(), 0.04))


@pytest.mark.parametrize("mode", ["backward", "all"])
def test_skip_modes_on_fixed_shapes_equal_trl(tmp_path, varlen_stand_in, mode):  # noqa: F811
    trainer = fixed_trainer(tmp_path, "varlen", skip=mode, loss_type="grpo")
    matches_trl(trainer, with_logps(trainer, varied_batch(zeros=(1, 2, 4)), 0.0), metrics=mode == "backward")


def test_shared_prompts_on_fixed_shapes_equal_trl(tmp_path, varlen_stand_in):  # noqa: F811
    """Shared prompts' keys padded to a capacity too (the dummy sequence takes the extra keys)."""
    import test_shared_prompts as shared

    trainer = fixed_trainer(tmp_path, "varlen", loss_type="dapo")
    inputs = shared.with_logps(trainer, shared.grouped_batch(4), 0.0)
    matches_trl(trainer, inputs)
    assert trainer._metrics["train"]["shared_prompts/saved_tokens"][0] > 0


def random_lengths_batch(step: int, g: torch.Generator) -> dict:
    """`varied_batch` with random prompt (1-P) and completion (1-C) lengths; on odd steps rows 0-2 share a prompt."""
    inputs = varied_batch(seed=step)
    prompt, completion = torch.randint(1, P + 1, (6,), generator=g), torch.randint(1, C + 1, (6,), generator=g)
    inputs["prompt_mask"] = (torch.arange(P) >= P - prompt[:, None]).long()
    inputs["completion_mask"] = (torch.arange(C) < completion[:, None]).long()
    if step % 2:  # rows 0-2 one prompt: a shared row
        inputs["prompt_ids"][:3], inputs["prompt_mask"][:3] = inputs["prompt_ids"][0], inputs["prompt_mask"][0]
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()
    return inputs


@pytest.mark.parametrize("fixed", [True, False])
def test_fifty_steps_of_random_lengths_meet_few_shapes(tmp_path, monkeypatch, varlen_stand_in, fixed):  # noqa: F811
    """What the attention is called with (query tokens, boundaries' entries, longest query, key tokens, longest key)
    over 50 micro-batches of random prompt and completion lengths (8-84 real tokens, some groups sharing a prompt):
    with fixed shapes, query and key tokens each one of the capacities between 16 and 96 tokens (6), the longest
    lengths equal to them, the boundaries of one size: at most two calls per capacity (shared prompts' keys may be a
    capacity above their queries); without fixed shapes, many more."""
    seen = set()

    def recording(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
        seen.add((q.shape[0], len(cu_q), max_q, k.shape[0], max_k))
        return varlen_on_the_cpu(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    monkeypatch.setattr(packed_attention, "varlen_attn", recording)
    trainer = fixed_trainer(tmp_path, "varlen", fixed=fixed, loss_type="dapo")
    g = torch.Generator().manual_seed(0)
    for step in range(50):
        trainer._compute_loss(trainer.model, random_lengths_batch(step, g)).backward()
    capacities = {packing.capacity(t, 16) for t in range(16, 97)}
    if fixed:
        assert all(n in capacities and n == max_q and k in capacities and k == max_k for n, _, max_q, k, max_k in seen)
        assert len({slots for _, slots, *_ in seen}) == 1 and len(seen) <= 2 * len(capacities), sorted(seen)
    else:
        assert len(seen) > 2 * len(capacities), sorted(seen)
