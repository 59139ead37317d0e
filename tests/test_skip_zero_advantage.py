"""Sequences at advantage 0 skip the backbone's backward (`skip_zero_advantage`): on a tiny Qwen2 in float32, the
loss, every gradient and every metric equal TRL 1.16's GRPOTrainer on micro-batches with none, some and all of
their sequences at advantage 0, for every loss type, q 1 and 0.5; "all" (no forward either) gives the same loss and
gradients, and the metrics of the sequences with a gradient; three optimizer steps with gradient accumulation and
two iterations end at TRL's parameters; beta, the entropy bonus and eval mode split nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from test_integration_trl import VOCAB, loss_and_grads, make_trainer, micro_batch
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, regroup, zero_advantage

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
ZEROS = {"none": [], "some": [1, 2], "all": [0, 1, 2, 3]}
SKIP_METRICS = ("zero_advantage/skipped_backward", "zero_advantage/skipped_forward")


def tiny_qwen2(seed=0, tie=True):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        tie_word_embeddings=tie,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def skipping_trainer(tmp_path, mode="backward", model=None, **settings):
    trainer = make_trainer(CompiledGRPOTrainer, tmp_path, model or tiny_qwen2(), skip=mode, **settings)
    # the split by rows on TRL's padded rows: its packed form is checked in test_padding_free.py
    trainer.padding_free_mode = False
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 2
    return trainer


def with_zeros(inputs: dict, rows: list[int], trainer) -> dict:
    """`inputs` with the advantages of `rows` at 0 and off-policy old log-probs of the trainer's model."""
    inputs = dict(inputs)
    inputs["advantages"] = inputs["advantages"].float().clone()
    inputs["advantages"][rows] = 0.0
    with torch.no_grad():
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
        C = inputs["completion_ids"].shape[1]
        logp, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C)
    g = torch.Generator().manual_seed(1)
    inputs["old_per_token_logps"] = (logp + 0.1 * torch.randn(logp.shape, generator=g)).clamp(max=0.0)
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()
    return inputs


def assert_same(ours, theirs, metrics=True):
    torch.testing.assert_close(ours[0], theirs[0].to(ours[0].dtype), rtol=2e-5, atol=1e-7)
    assert ours[1].keys() == theirs[1].keys()
    for name, g in theirs[1].items():
        err, scale = float((ours[1][name] - g).abs().max()), float(g.abs().max())
        assert err <= 2e-5 * max(scale, 1e-6), f"{name}: {err:.2e} (scale {scale:.2e})"
    if metrics:
        mine = {k: v for k, v in ours[2].items() if k not in SKIP_METRICS}
        assert mine.keys() == theirs[2].keys()
        for name, value in theirs[2].items():
            assert mine[name] == pytest.approx(value, rel=2e-5, abs=1e-6, nan_ok=True), name


def trl_loss(trainer):
    return lambda m, i: GRPOTrainer._compute_loss(trainer, m, i)


@pytest.mark.parametrize("zeros", list(ZEROS))
@pytest.mark.parametrize("q", [1.0, 0.5])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_backward_skip_equals_trl(tmp_path, loss_type, q, zeros):
    trainer = skipping_trainer(tmp_path, loss_type=loss_type, top_entropy_quantile=q)
    inputs = with_zeros(micro_batch(), ZEROS[zeros], trainer)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert_same(ours, theirs)
    assert ours[2]["zero_advantage/skipped_backward"] == pytest.approx(len(ZEROS[zeros]) / 4)
    assert ours[2]["zero_advantage/skipped_forward"] == 0.0


@pytest.mark.parametrize("zeros", ["some", "all"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_skips_the_forward_with_trls_loss_and_gradients(tmp_path, loss_type, zeros):
    """The loss and gradients of the whole micro-batch; the metrics TRL logs for the sequences with a gradient."""
    trainer = skipping_trainer(tmp_path, "all", loss_type=loss_type)
    inputs = with_zeros(micro_batch(), ZEROS[zeros], trainer)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert_same(ours, theirs, metrics=False)
    assert ours[2]["zero_advantage/skipped_forward"] == pytest.approx(len(ZEROS[zeros]) / 4)
    if zeros == "all":  # nothing has a gradient: no loss metric is logged for this micro-batch
        assert set(ours[2]) == set(SKIP_METRICS)
        return
    kept = [r for r in range(4) if r not in ZEROS[zeros]]
    sub = {k: v[kept] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in inputs.items()}
    on_kept = loss_and_grads(trl_loss(trainer), trainer, sub)
    for name, value in on_kept[2].items():
        assert ours[2][name] == pytest.approx(value, rel=2e-5, abs=1e-6, nan_ok=True), name


@pytest.mark.parametrize("splits", [False, True])
def test_all_with_a_quantile_runs_as_auto_and_says_so(tmp_path, splits, monkeypatch):
    """The threshold needs every sequence's entropy, so "all" cannot skip a forward: it runs as the default, which
    splits the forward at large hidden sizes (here made small) and not below."""
    if splits:
        monkeypatch.setattr(zero_advantage, "AUTO_HIDDEN_SIZE", 16)
    with pytest.warns(zero_advantage.SkipNotice, match="runs as 'auto'"):
        trainer = skipping_trainer(tmp_path, "all", top_entropy_quantile=0.5)
    assert trainer.skip_zero_advantage == "auto" and (trainer.skip_reason is None) == splits
    calls = count_forwards(trainer)
    inputs = with_zeros(micro_batch(), ZEROS["some"], trainer)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    calls.clear()
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert calls == ([(True, 2), (False, 2)] if splits else [(True, 4)])
    assert_same(ours, theirs)


def count_forwards(trainer):
    calls = []
    trainer.model.model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(
        (torch.is_grad_enabled(), kwargs["input_ids"].shape[0])), with_kwargs=True)  # fmt: skip
    return calls


def test_the_split_forward_runs_the_sequences_with_a_gradient_with_grad_and_the_others_without(tmp_path):
    trainer = skipping_trainer(tmp_path)
    calls = count_forwards(trainer)
    loss_and_grads(trainer._compute_loss, trainer, with_zeros(micro_batch(), ZEROS["some"], trainer))
    assert calls[-2:] == [(True, 2), (False, 2)]
    calls.clear()
    loss_and_grads(trainer._compute_loss, trainer, with_zeros(micro_batch(), [], trainer))
    assert calls[-1:] == [(True, 4)]


@pytest.mark.parametrize("settings, reason", [({"beta": 0.04}, "beta"), ({"entropy_coef": 0.01}, "entropy bonus")])
def test_a_term_with_a_gradient_at_advantage_0_splits_nothing_and_says_why(tmp_path, settings, reason):
    with pytest.warns(zero_advantage.SkipNotice, match=reason):
        trainer = skipping_trainer(tmp_path, **settings)
    calls = count_forwards(trainer)
    inputs = with_zeros(micro_batch(), ZEROS["some"], trainer)
    if settings.get("beta"):
        inputs["ref_per_token_logps"] = inputs["old_per_token_logps"] - 0.05
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    calls.clear()
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert calls == [(True, 4)]
    assert_same(ours, theirs)


def test_eval_and_auto_below_its_hidden_size_split_nothing(tmp_path):
    trainer = skipping_trainer(tmp_path)
    calls = count_forwards(trainer)
    inputs = with_zeros(micro_batch(), ZEROS["some"], trainer)
    trainer.model.eval()
    calls.clear()
    loss_and_grads(trainer._compute_loss, trainer, inputs, mode="eval")
    assert calls == [(True, 4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", zero_advantage.SkipNotice)
        auto = skipping_trainer(tmp_path, "auto")  # hidden size 32 < AUTO_HIDDEN_SIZE: the default's choice, unsaid
        off = skipping_trainer(tmp_path, "off")  # the user's choice: nothing to say
    assert auto.skip_reason.startswith("skip_zero_advantage='auto' at hidden size 32")
    assert off.skip_reason == "skip_zero_advantage=False"


@pytest.mark.parametrize("mode", ["backward", "all"])
def test_an_all_zero_micro_batch_backwards_to_zero_gradients_without_a_forward_with_grad(tmp_path, mode):
    """Every trainable parameter gets a zero gradient (as from TRL's full backward: AdamW still moves it), and
    the model runs no forward with grad ("backward": one without, for the metrics; "all": none)."""
    trainer = skipping_trainer(tmp_path, mode)
    calls = count_forwards(trainer)
    inputs = with_zeros(micro_batch(), ZEROS["all"], trainer)
    calls.clear()
    loss, grads, _ = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert calls == ([(False, 4)] if mode == "backward" else [])
    assert float(loss) == 0.0
    assert grads.keys() == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(float(g.abs().max()) == 0.0 for g in grads.values())


def test_a_bad_mode_is_refused(tmp_path):
    for bad in ("yes", True, 1, 0):
        with pytest.raises(ValueError, match="skip_zero_advantage"):
            skipping_trainer(tmp_path, bad)


def zero_reward_for_some_prompts(prompts, completions, **kwargs):
    """Every completion of a prompt starting with "a" gets 0 (a zero-std group: advantage 0), the others the
    count of their digits."""
    pairs = zip(prompts, completions, strict=True)
    return [0.0 if p.startswith("a") else float(sum(ch.isdigit() for ch in c)) for p, c in pairs]


@pytest.mark.parametrize("mode", ["backward", "all"])
def test_three_optimizer_steps_end_at_trls_parameters(tmp_path, mode):
    """Gradient accumulation 2, two iterations per generation, groups at advantage 0 among the others ("all"
    regroups each generation batch: a micro-batch left with no sequence to train runs no forward). Plain SGD:
    Adam's per-parameter scaling would hide a gradient off by a factor, and would blow the rounding noise of a
    gradient that is exactly 0 in exact arithmetic (a key bias: softmax ignores a shift) up to learning-rate steps."""
    settings = {"max_steps": 3, "gradient_accumulation_steps": 2, "num_iterations": 2, "seed": 0, "optim": "sgd"}
    trained, forwards = [], []
    for cls, extra in ((GRPOTrainer, {}), (CompiledGRPOTrainer, {"skip": mode})):
        trainer = make_trainer(cls, tmp_path / cls.__name__, tiny_qwen2(), reward=zero_reward_for_some_prompts,
                               **extra, **settings)  # fmt: skip
        calls = count_forwards(trainer)
        trainer.train()
        trained.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
        forwards.append(sum(grad for grad, _ in calls))
        if cls is CompiledGRPOTrainer:
            logged = [e for e in trainer.state.log_history if "zero_advantage/skipped_backward" in e]
            assert logged and max(e["zero_advantage/skipped_backward"] for e in logged) > 0
    for name, theirs in trained[0].items():
        torch.testing.assert_close(trained[1][name], theirs, rtol=1e-4, atol=1e-6, msg=name)
    assert forwards[0] == 6  # 3 optimizer steps x 2 micro-batches, each one forward with grad
    if mode == "all":  # at least one micro-batch was left with nothing to train by the regrouping
        assert forwards[1] < 6


def test_regrouping_gathers_the_sequences_with_a_gradient_first():
    """Rows keep their values, 0-d values stay, lists follow their rows, and no row crosses an optimizer step."""

    def batch(adv, tag):
        n = len(adv)
        return {"advantages": torch.tensor(adv), "ids": torch.arange(n)[:, None] + tag, "names": [f"{tag}{i}" for i in
                range(n)], "num_items_in_batch": torch.tensor(7.0), "pixel_values": None}  # fmt: skip

    micro = [batch([0.0, 1.0], 0), batch([0.0, -2.0], 10), batch([3.0, 0.0], 20), batch([0.0, 0.0], 30)]
    args = type("A", (), {"gradient_accumulation_steps": 2})()
    trainer = type("T", (), {"args": args, "skip_zero_advantage": "all", "share_prompts": False})()
    out = regroup.regroup(trainer, micro)
    assert [b["advantages"].tolist() for b in out] == [[1.0, -2.0], [0.0, 0.0], [3.0, 0.0], [0.0, 0.0]]
    assert [b["names"] for b in out] == [["01", "101"], ["00", "100"], ["200", "201"], ["300", "301"]]
    assert [b["ids"].flatten().tolist() for b in out] == [[1, 11], [0, 10], [20, 21], [30, 31]]
    assert all(float(b["num_items_in_batch"]) == 7.0 and b["pixel_values"] is None for b in out)
