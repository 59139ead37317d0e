"""A GRPO group's prompt forwarded once: a packed row in which completions share their prompt gives every hidden
state the loss reads as the rows packed apart, and CompiledGRPOTrainer's shared step equals GRPOTrainer's padded
`_compute_loss` (loss, every gradient, every metric) across loss types, group sizes, skip modes and checkpointing.
Each trainer comparison also checks that the step shared (tokens saved), so a silent fallback cannot pass; a
completion let to see a sibling turns them red."""

from __future__ import annotations

import pytest
import torch
from test_integration_trl import VOCAB, loss_and_grads, make_trainer
from test_padding_free import LOSS_TYPES
from test_skip_zero_advantage import assert_same, tiny_qwen2, trl_loss
from trl import GRPOTrainer

from compiled_grpo.integrations.trl import (
    CompiledGRPOTrainer,
    packing,
    padding_free,
    plan,
    regroup,
    shared_masks,
    shared_prompts,
)

B, P, C = 8, 7, 6


def grouped_batch(G: int, seed=0, zeros=(), pad_to=None) -> dict:
    """B rows in groups of G completions of one prompt (left-padded prompts of 2-7 real tokens, one group's of a
    single token), right-padded completions of 1-6 tokens, rows of a group not next to each other."""
    g = torch.Generator().manual_seed(seed)
    groups = B // G
    prompt_len = torch.tensor([7, 2, 5, 1, 4, 6, 3, 2])[:groups]
    prompts = torch.randint(3, len(VOCAB), (groups, P), generator=g)
    order = torch.randperm(B, generator=g)  # TRL shuffles a generation batch's rows
    group_of = (torch.arange(B) // G)[order]
    completion = torch.randint(1, C + 1, (B,), generator=g)
    inputs = {
        "prompt_ids": prompts[group_of],
        "prompt_mask": (torch.arange(P) >= P - prompt_len[group_of][:, None]).long(),
        "completion_ids": torch.randint(3, len(VOCAB), (B, C), generator=g),
        "completion_mask": (torch.arange(C) < completion[:, None]).long(),
        "advantages": torch.randn(B, generator=g),
    }
    inputs["prompt_ids"] = inputs["prompt_ids"].masked_fill(inputs["prompt_mask"] == 0, 0)  # TRL pads with pad ids
    inputs["advantages"][list(zeros)] = 0.0
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()
    return inputs


def with_logps(trainer, inputs: dict, beta: float) -> dict:
    """Off-policy old log-probs (and reference ones) from TRL's own scoring, as `_prepare_inputs` makes them."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        logp, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, C)
    g = torch.Generator().manual_seed(1)
    inputs["old_per_token_logps"] = (logp + 0.1 * torch.randn(logp.shape, generator=g)).clamp(max=0.0)
    if beta:
        inputs["ref_per_token_logps"] = (logp + 0.2 * torch.randn(logp.shape, generator=g)).clamp(max=0.0)
    return inputs


def lengths_of(inputs: dict) -> plan.Lengths:
    spans = plan.real_spans(inputs)
    return plan.lengths_of(spans, (inputs["prompt_mask"], inputs["completion_mask"]))


def expected_saved(inputs: dict, rows=None) -> int:
    """(k - 1)(p - 1) for each group of k rows of a p-token prompt among `rows`."""
    lengths = lengths_of(inputs)
    rows = range(B) if rows is None else rows
    saved = 0
    for group in set(int(lengths.groups[r]) for r in rows):
        k = sum(1 for r in rows if int(lengths.groups[r]) == group)
        saved += (k - 1) * max(int(lengths.prompt[group]) - 1, 0)
    return saved


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("G", [2, 4, 8])
def test_shared_prompts_give_the_hidden_states_and_gradients_of_rows_packed_apart(attention, G):
    model = tiny_qwen2()
    model.config._attn_implementation = attention
    inputs = grouped_batch(G)
    lengths = lengths_of(inputs)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    lm_head = model.get_output_embeddings()
    forward = padding_free.packed_ids_forward(model, lm_head, None)
    rows, weights = torch.arange(B), torch.randn(int(lengths.completion.sum()), 32)
    found = []
    for groups in (lengths.groups, None):
        model.zero_grad()
        packed = packing.pack(ids, lengths, rows, 16, groups)
        assert (packed.keys is not None) == (groups is not None)
        hidden = forward(packed)[0]
        read = hidden[packing.targets(lengths, rows, packed.starts, C, hidden.device).row_index]
        (read * weights).sum().backward()
        found.append((read.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, packed))
    (shared, shared_grads, packed), (apart, apart_grads, unshared) = found
    torch.testing.assert_close(shared, apart, rtol=1e-5, atol=1e-6)
    for name, grad in apart_grads.items():  # to rounding: the prompt's gradient sums its completions' in one place
        err, scale = float((shared_grads[name] - grad).abs().max()), float(grad.abs().max())
        assert err <= 2e-6 * scale, f"{name}: {err:.2e} (scale {scale:.2e})"
    saved = packing.saved_tokens(lengths, rows, lengths.groups)
    assert saved == expected_saved(inputs) > 0
    real = int(lengths.prompt.sum() + lengths.completion.sum())
    assert packed.cu_seqlens[-2] == real - saved  # the dummy sequence aside, the shared row holds that many tokens


def let_completions_see_their_siblings(monkeypatch) -> None:
    """The sabotage: the segments' rule widened so that every position of a group sees its earlier positions,
    siblings' included."""
    rule = shared_masks.visible

    def sees_siblings(packed, window=None):
        group = packed.keys.group.to(packed.input_ids.device)
        position = packed.position_ids[0]
        return rule(packed, window) | ((group[:, None] == group[None, :]) & (position[None, :] <= position[:, None]))

    monkeypatch.setattr(shared_masks, "visible", sees_siblings)


def test_a_completion_that_sees_its_sibling_is_caught(monkeypatch):
    """The sabotage: members of a group attend to each other's tokens; the check refuses it and the hidden states
    differ from the rows packed apart."""
    model = tiny_qwen2()
    inputs = grouped_batch(4)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    forward = padding_free.packed_ids_forward(model, model.get_output_embeddings(), None)
    assert shared_prompts.sharing_fails(forward, ids, 16) is None
    let_completions_see_their_siblings(monkeypatch)
    why = shared_prompts.sharing_fails(forward, ids, 16)
    assert why is not None and "differ from the same rows packed apart" in why


def test_the_check_under_autocast_bounds_by_16_bit_rounding(monkeypatch):
    """A float32 model under bf16 autocast (TRL's `bf16=True` on float32 weights) computes its matmuls in bf16: the
    check passes it (two packings differ by bf16 rounding, not by a float32 bound) and still catches a completion
    that sees its sibling."""
    model = tiny_qwen2()
    inputs = grouped_batch(4)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    packed_forward = padding_free.packed_ids_forward(model, model.get_output_embeddings(), None)
    dtypes = []

    def forward(packed):
        out = packed_forward(packed)
        dtypes.append(out[0].dtype)
        return out

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert shared_prompts.sharing_fails(forward, ids, 16) is None
        assert set(dtypes) == {torch.float32}  # what the float32 bound was once chosen by
        let_completions_see_their_siblings(monkeypatch)
        why = shared_prompts.sharing_fails(forward, ids, 16)
    assert why is not None and "> 3e-02" in why


def trainer_for(tmp_path, share=True, skip="off", accumulation=2, **settings):
    model = tiny_qwen2()
    trainer = make_trainer(CompiledGRPOTrainer, tmp_path, model, skip=skip, **settings)
    trainer.padding_free_mode, trainer.packed_attention = "pack", None  # "auto" trims on the CPU
    shared_prompts.configure(trainer, share)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    return trainer


def shared_step_matches_trl(trainer, inputs, metrics=True, rows=None):
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    trainer._metrics["train"].clear()
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert trainer.packing_refused == "" and trainer.sharing_refused == ""
    saved = trainer._metrics["train"]["shared_prompts/saved_tokens"]
    assert saved == [float(expected_saved(inputs, rows))] and saved[0] > 0, "the step did not share"
    ours = (ours[0], ours[1], {k: v for k, v in ours[2].items() if not k.startswith("shared_prompts/")})
    assert_same(ours, theirs, metrics=metrics)


@pytest.mark.parametrize("q", [1.0, 0.5])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_shared_equals_trl(tmp_path, loss_type, q):
    trainer = trainer_for(tmp_path, loss_type=loss_type, top_entropy_quantile=q)
    shared_step_matches_trl(trainer, with_logps(trainer, grouped_batch(4), 0.0))


@pytest.mark.parametrize("G", [2, 4, 8])
@pytest.mark.parametrize("checkpointing", [None, True, False])  # off, reentrant, non-reentrant
def test_group_sizes_and_checkpointing_shared_equal_trl(tmp_path, G, checkpointing):
    trainer = trainer_for(tmp_path, loss_type="grpo", beta=0.04)
    if checkpointing is not None:  # as train() runs it: the layers recompute their forwards in the backward
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": checkpointing})
        trainer.model.enable_input_require_grads()
    assert trainer.model.is_gradient_checkpointing == (checkpointing is not None)
    shared_step_matches_trl(trainer, with_logps(trainer, grouped_batch(G, seed=G), 0.04))


@pytest.mark.parametrize("mode", ["backward", "all"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo"])
def test_skip_modes_shared_equal_trl(tmp_path, loss_type, mode):
    """A group at advantage 0 skips its prompt's backward ("backward": forwarded without grad, its prompt shared
    there) or everything ("all"); the other rows share theirs."""
    inputs = grouped_batch(2, seed=3)
    group_rows = torch.nonzero(plan.real_spans(inputs)[:, 3] == plan.real_spans(inputs)[0, 3]).flatten().tolist()
    trainer = trainer_for(tmp_path, skip=mode, loss_type=loss_type)
    inputs = with_logps(trainer, grouped_batch(2, seed=3, zeros=group_rows), 0.0)
    trained = [r for r in range(B) if r not in group_rows]
    rows = trained if mode == "all" else None
    expected = expected_saved(inputs, trained) + (0 if mode == "all" else expected_saved(inputs, group_rows))
    assert rows is not None or expected == expected_saved(inputs, trained) + expected_saved(inputs, group_rows)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    trainer._metrics["train"].clear()
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert trainer._metrics["train"]["shared_prompts/saved_tokens"] == [float(expected)]
    ours = (ours[0], ours[1], {k: v for k, v in ours[2].items() if not k.startswith("shared_prompts/")})
    assert_same(ours, theirs, metrics=mode == "backward")


def test_old_logps_shared_equal_trls(tmp_path):
    """The old log-probs scored packed with shared prompts, in chunks of `batch_size` rows, are TRL's padded ones."""
    trainer = trainer_for(tmp_path, loss_type="dapo")
    inputs = grouped_batch(4)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    calls, pack = [], packing.pack

    def counting(*args, **kwargs):
        calls.append(pack(*args, **kwargs))
        return calls[-1]

    import compiled_grpo.integrations.trl.scoring as scoring

    scoring.pack = counting
    try:
        with torch.no_grad():
            ours, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C, batch_size=4)
            theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, C, 4)
    finally:
        scoring.pack = pack
    assert any(p.keys is not None for p in calls), "scoring did not share"
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-6)
    assert bool((ours[inputs["completion_mask"] == 0] == 0).all())


def test_share_prompts_option(tmp_path):
    with pytest.raises(ValueError, match="share_prompts"):
        make_trainer(CompiledGRPOTrainer, tmp_path, tiny_qwen2(), options={"share_prompts": "yes"})
    trainer = make_trainer(CompiledGRPOTrainer, tmp_path, tiny_qwen2(), options={"padding_free": "pack"})
    assert trainer.share_prompts is True  # "auto" shares where micro-batches are packed
    options = {"padding_free": "pack", "share_prompts": False}
    assert make_trainer(CompiledGRPOTrainer, tmp_path, tiny_qwen2(), options=options).share_prompts is False
    assert make_trainer(CompiledGRPOTrainer, tmp_path, tiny_qwen2()).share_prompts is False  # trimmed on the CPU
    with pytest.raises(ValueError, match="share_prompts=True: micro-batches are not packed"):
        make_trainer(CompiledGRPOTrainer, tmp_path, tiny_qwen2(), options={"share_prompts": True})
    assert shared_prompts.why_not("flash_attention_2") is not None
    assert shared_prompts.why_not("varlen") is None and shared_prompts.why_not("sdpa") is None


def test_no_sharing_when_no_two_rows_share_a_prompt(tmp_path):
    trainer = trainer_for(tmp_path, loss_type="grpo")
    inputs = with_logps(trainer, grouped_batch(1), 0.0)  # B groups of one
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    trainer._metrics["train"].clear()
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert trainer._metrics["train"]["shared_prompts/saved_tokens"] == [0.0]
    ours = (ours[0], ours[1], {k: v for k, v in ours[2].items() if not k.startswith("shared_prompts/")})
    assert_same(ours, theirs)


def test_a_step_whose_completions_see_their_siblings_differs_from_trls(tmp_path, monkeypatch):
    """The sabotage on the trainer's step, its check bypassed: the loss or a gradient must differ from TRL's."""
    trainer = trainer_for(tmp_path, loss_type="dapo")
    inputs = with_logps(trainer, grouped_batch(4), 0.0)
    let_completions_see_their_siblings(monkeypatch)
    trainer.packing_refused, trainer.sharing_refused = "", ""  # as if the check had passed
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    with pytest.raises(AssertionError):
        assert_same((ours[0], ours[1], {}), theirs, metrics=False)


@pytest.mark.parametrize("skip", ["all", False])
def test_regrouping_puts_a_prompts_completions_side_by_side(skip):
    """Within each optimizer step, the rows of one prompt side by side in the order the prompts first appear (after
    the rows with a gradient, under "all"); rows keep their values and never cross an optimizer step."""

    def batch(prompts, advantages):
        ids = torch.tensor(prompts)[:, None].repeat(1, 3)
        return {"prompt_ids": ids, "prompt_mask": torch.ones_like(ids), "advantages": torch.tensor(advantages),
                "tag": [f"{p}:{a}" for p, a in zip(prompts, advantages, strict=True)]}  # fmt: skip

    micro = [batch([5, 7, 5], [1.0, 0.0, 2.0]), batch([7, 9, 9], [3.0, 0.0, 4.0]), batch([9, 5, 7], [5.0, 6.0, 0.0])]
    args = type("A", (), {"gradient_accumulation_steps": 3})()
    trainer = type("T", (), {"args": args, "skip_zero_advantage": skip, "share_prompts": True})()
    out = [b["tag"] for b in regroup.regroup(trainer, micro)]
    if skip == "all":
        assert out == [["5:1.0", "5:2.0", "5:6.0"], ["7:3.0", "9:4.0", "9:5.0"], ["7:0.0", "7:0.0", "9:0.0"]]
    else:
        assert out == [["5:1.0", "5:2.0", "5:6.0"], ["7:0.0", "7:3.0", "7:0.0"], ["9:0.0", "9:4.0", "9:5.0"]]


def test_prompt_groups_compare_exactly_a_block_at_a_time(monkeypatch):
    """Each row's first row with the same real prompt: the same ids under another mask (one more left-padded token)
    is another prompt; compared two rows at a time, the same answer."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (12, 30), generator=g)
    ids[5], ids[9], ids[11] = ids[2], ids[2], ids[0]
    mask = torch.ones_like(ids)
    mask[9, 0] = 0  # row 9: row 2's ids, its first one padding
    expected = [0, 1, 2, 3, 4, 2, 6, 7, 8, 9, 10, 0]
    assert plan.prompt_groups(ids, mask).tolist() == expected
    monkeypatch.setattr(plan, "COMPARED_AT_ONCE", 2 * ids.numel())
    assert plan.prompt_groups(ids, mask).tolist() == expected
