"""`compile_generation="loop"` (`decoding_loop`): each token's whole decoding step one compiled call (Inductor's C++
kernels on the CPU here, float32). Greedy tokens equal `generate`'s on left-padded prompts of different lengths,
where every sequence ends early and where the limit ends them; sampled tokens follow the model's distribution (after
a first token, the second one too: the compiled step's draw) and the processors' (top-k); calls it does not take
run `generate` itself; the trainer decodes on it and gives TRL's eager tokens, and `train()` on it (checkpointed, a
LoRA adapter too) equals GRPOTrainer's steps on the same completions."""

from __future__ import annotations

import pytest
import torch
from scipy import stats
from test_compiled_generation import completions, generator, prompts, varied_model
from test_integration_trl import VOCAB
from test_train_checkpointed import assert_steps_equal, train
from transformers import GenerationConfig
from trl import GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, decoding_loop


def left_padded(count: int, seed: int) -> dict:
    """`count` prompts of 1-12 tokens, left-padded (id 0) to the longest, with their mask."""
    rows = prompts(12, seed, count)
    ids = torch.zeros(count, 12, dtype=torch.long)
    mask = torch.zeros(count, 12, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, 12 - len(row) :], mask[i, 12 - len(row) :] = torch.tensor(row), 1
    return {"input_ids": ids, "attention_mask": mask}


def config(limit: int, ends, **settings) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=limit, pad_token_id=0, eos_token_id=ends, **settings)


def no_compile(monkeypatch):
    """The loop's step run eagerly (the greedy test shows the compiled step decodes as it does)."""
    monkeypatch.setattr(torch, "compile", lambda step, **options: step)


@pytest.mark.compiled
def test_greedy_tokens_equal_generate_on_left_padded_prompts():
    model, inputs = varied_model(seed=3), left_padded(6, seed=4)
    loops: dict = {}
    for ends, limit in (([1, *range(3, len(VOCAB), 4)], 40), ([1], 6)):  # a quarter of the tokens end: all end early
        greedy = config(limit, ends, do_sample=False)
        with torch.no_grad():
            expected = model.generate(**inputs, generation_config=greedy)
        got = decoding_loop.generate(model, loops, 256 + limit, greedy, **inputs)
        assert torch.equal(got, expected), (got, expected)
        assert (expected.shape[1] < 12 + limit) == (limit == 40)  # the first ended early, the second at the limit
    assert [loop.length for loop in loops.values()] == [256 + 40]  # the shorter call ran on the longer cache


def test_sampled_tokens_follow_the_models_distribution(monkeypatch):
    """Over 1,200 draws of two tokens from one prompt, the first token's frequencies agree with the model's
    probabilities, and the second's after the commonest first token with the model's there (chi-square, p > 1e-3)."""
    no_compile(monkeypatch)
    model = varied_model(seed=5)
    prompt = torch.tensor([[5, 9, 12]]).repeat(200, 1)
    inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
    torch.manual_seed(0)
    drawn = torch.cat([decoding_loop.generate(model, {}, 16, config(2, [1], do_sample=True), **inputs)[:, 3:]
                       for _ in range(6)])  # fmt: skip
    first = torch.mode(drawn[:, 0]).values
    with torch.no_grad():
        probs = model(torch.tensor([[5, 9, 12, int(first)]])).logits[0, -2:].softmax(-1).double()
    assert_follows(drawn[:, 0], probs[0])
    assert_follows(drawn[drawn[:, 0] == first, 1], probs[1])


def assert_follows(tokens: torch.Tensor, probs: torch.Tensor) -> None:
    seen = torch.bincount(tokens, minlength=len(probs)).double()
    likely = probs * len(tokens) >= 5  # chi-square's cells: the tokens expected at least 5 times, the rest pooled
    observed = torch.cat([seen[likely], seen[~likely].sum().reshape(1)])
    expected = torch.cat([probs[likely], probs[~likely].sum().reshape(1)])
    assert stats.chisquare(observed.numpy(), (expected / expected.sum() * len(tokens)).numpy()).pvalue > 1e-3


def test_top_k_keeps_the_draws_among_the_k_likeliest(monkeypatch):
    no_compile(monkeypatch)
    model, inputs = varied_model(seed=5), left_padded(32, seed=6)
    torch.manual_seed(1)
    drawn = decoding_loop.generate(model, {}, 16, config(1, [1], do_sample=True, top_k=3), **inputs)[:, -1]
    with torch.no_grad():
        top = model(**inputs).logits[:, -1].topk(3).indices
    assert bool((top == drawn[:, None]).any(1).all()), (drawn, top)


def test_calls_the_loop_does_not_take_run_generate_itself(monkeypatch):
    no_compile(monkeypatch)
    model, inputs = varied_model(seed=3), left_padded(4, seed=7)
    penalized = config(8, [1], do_sample=False, repetition_penalty=1.3)  # a processor that reads the tokens so far
    loops: dict = {}
    with torch.no_grad():
        expected = model.generate(**inputs, generation_config=penalized)
    with pytest.warns(decoding_loop.LoopNotice, match="generate itself: logits processors .*RepetitionPenalty"):
        assert torch.equal(decoding_loop.generate(model, loops, 64, penalized, **inputs), expected) and not loops
    merged, processors = decoding_loop.processors_and_config(model, penalized, inputs["input_ids"])
    reason = decoding_loop.reason_not_to_loop(merged, processors, inputs)
    assert "RepetitionPenaltyLogitsProcessor" in reason
    assert "inputs beyond" in decoding_loop.reason_not_to_loop(merged, [], {**inputs, "pixel_values": None})


@pytest.mark.compiled
def test_the_trainer_decodes_on_the_loop_and_gives_trl_eager_tokens(tmp_path):
    ours = generator(tmp_path / "ours", CompiledGRPOTrainer, compile_generation="loop")
    eager = generator(tmp_path / "eager", GRPOTrainer)
    for seed, longest in enumerate((20, 3, 300, 7)):
        assert completions(ours, prompts(longest, seed)) == completions(eager, prompts(longest, seed))
    # one cache kept, the longest, shorter prompts after it decoded on it; compiles only for the buckets reached
    # (how many depends on the process's earlier compiles of the step: dynamo makes a recompiled length dynamic)
    assert [loop.length for loop in ours.generation_loops.values()] == [520]
    assert {length for length, _, _ in ours.generation_compiles.compiles} <= {264, 520}
    assert "generate" not in vars(ours.model)  # the model's own generate back after each call


@pytest.mark.compiled
@pytest.mark.parametrize("adapter", [False, True])
def test_train_on_the_loop_equals_grpo_trainer_on_its_completions(tmp_path, adapter, monkeypatch):
    """`train()` with TRL's sampling on the loop (gradient checkpointing on as TRL turns it on; with a LoRA adapter,
    PEFT unmerged, the loop decodes through the adapted model): its completions vary within groups, and GRPOTrainer
    trained on those same completions (its generation replaced by them: the loop draws from another random stream)
    gives every step's loss and gradients."""
    if adapter:
        pytest.importorskip("peft", reason="peft is in the test extras")
    drawn, own = [], CompiledGRPOTrainer._generate_single_turn

    def recorded(self, *args, **kwargs):
        drawn.append(own(self, *args, **kwargs))
        return drawn[-1]

    monkeypatch.setattr(CompiledGRPOTrainer, "_generate_single_turn", recorded)
    ours = train(tmp_path / "ours", CompiledGRPOTrainer, "eager", False, adapter, compile_generation="loop")
    assert len(ours[2].generation_loops) == 1 and ours[2].generation_compiles.fallback is None
    groups = [completions[i : i + 4] for completions, _ in drawn for i in range(0, len(completions), 4)]
    assert any(len({tuple(c) for c in group}) > 1 for group in groups)  # sampled: a group's completions differ
    replayed = iter(drawn)
    monkeypatch.setattr(GRPOTrainer, "_generate_single_turn", lambda self, *args, **kwargs: next(replayed))
    theirs = train(tmp_path / "theirs", GRPOTrainer, "eager", False, adapter)
    assert_steps_equal(ours[:2], theirs[:2])
    assert any(float(g.abs().max()) > 0 for step in ours[1] for g in step.values())  # the steps trained
