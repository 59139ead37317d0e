"""A row plan holds only for the advantages it was read from. The rows at advantage 0 are found when a generation
batch is made (`plan.annotate`, in `_prepare_inputs`); a subclass that reshapes advantages afterwards (in
its `_compute_loss`, say) hands the loss other advantages. Whether the tensor is replaced or changed in place, the
micro-batch is planned again: loss, every gradient and every metric equal GRPOTrainer's on the changed advantages,
in both skip modes, and three optimizer steps end at its parameters. Trusting the stale plan turns them red."""

from __future__ import annotations

import pytest
import torch
from test_integration_trl import loss_and_grads, make_trainer, micro_batch
from test_skip_zero_advantage import ZEROS, assert_same, skipping_trainer, tiny_qwen2, trl_loss, with_zeros
from trl import GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, plan


def reshape_advantages(inputs: dict, how: str) -> None:
    """What a subclass might do between `_prepare_inputs` and the loss: rows at 0 get a nonzero advantage (the
    case a stale plan gets wrong: they would run without grad) and one row with a gradient goes to 0."""
    advantages = inputs["advantages"]
    changed = torch.where(advantages == 0, torch.full_like(advantages, 0.75), advantages)
    changed[0] = 0.0
    if how == "replaced":
        inputs["advantages"] = changed
    else:
        advantages.copy_(changed)


def planned_then_reshaped(trainer, how: str) -> dict:
    inputs = with_zeros(micro_batch(), ZEROS["some"], trainer)
    plan.annotate(trainer, [inputs], with_zeros=True)  # as `_prepare_inputs` plans a new generation batch
    reshape_advantages(inputs, how)
    return inputs


@pytest.mark.parametrize("how", ["replaced", "in place"])
@pytest.mark.parametrize("mode", ["backward", "all"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "vespo"])
def test_changed_advantages_are_planned_again(tmp_path, loss_type, mode, how):
    trainer = skipping_trainer(tmp_path, mode, loss_type=loss_type)
    inputs = planned_then_reshaped(trainer, how)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert_same(ours, theirs, metrics=mode == "backward")
    assert ours[2]["zero_advantage/skipped_backward"] == pytest.approx(1 / 4)


def test_an_unchanged_micro_batch_keeps_its_plan(tmp_path, monkeypatch):
    """The check costs no read-back where nothing changed: the plan found with the generation batch serves."""
    trainer = skipping_trainer(tmp_path)
    inputs = with_zeros(micro_batch(), ZEROS["some"], trainer)
    plan.annotate(trainer, [inputs], with_zeros=True)
    monkeypatch.setattr(plan, "read", lambda *a, **k: pytest.fail("planned again"))
    loss_and_grads(trainer._compute_loss, trainer, inputs)


@pytest.mark.parametrize("mode", ["backward", "all"])
def test_a_stale_plan_trusted_drops_gradients(tmp_path, monkeypatch, mode):
    """The check's sabotage: trusting the plan made before the change gives other gradients than TRL's."""
    monkeypatch.setattr(plan.ZeroRows, "fits", lambda self, advantages: True)
    trainer = skipping_trainer(tmp_path, mode)
    inputs = planned_then_reshaped(trainer, "replaced")
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    with pytest.raises(AssertionError):
        assert_same(ours, theirs, metrics=False)


class ReshapesAdvantages:
    """A subclass's `_compute_loss` that reshapes the advantages first (here: every advantage at 0 becomes 0.5)."""

    def _compute_loss(self, model, inputs):
        advantages = inputs["advantages"]
        inputs["advantages"] = torch.where(advantages == 0, torch.full_like(advantages, 0.5), advantages)
        return super()._compute_loss(model, inputs)


class ReshapingGRPOTrainer(ReshapesAdvantages, GRPOTrainer):
    pass


class ReshapingCompiledGRPOTrainer(ReshapesAdvantages, CompiledGRPOTrainer):
    pass


def zero_reward(prompts, completions, **kwargs):
    return [0.0 if p.startswith("a") else float(sum(ch.isdigit() for ch in c)) for p, c in
            zip(prompts, completions, strict=True)]  # fmt: skip


@pytest.mark.parametrize("mode", ["backward", "all"])
def test_a_subclass_reshaping_advantages_trains_as_grpo_trainer(tmp_path, mode):
    """Three optimizer steps (gradient accumulation 2, two iterations, plain SGD) end at the parameters of
    GRPOTrainer with the same subclass."""
    settings = {"max_steps": 3, "gradient_accumulation_steps": 2, "num_iterations": 2, "seed": 0, "optim": "sgd"}
    trained = []
    for cls, extra in ((ReshapingGRPOTrainer, {}), (ReshapingCompiledGRPOTrainer, {"skip": mode})):
        trainer = make_trainer(cls, tmp_path / cls.__name__, tiny_qwen2(), reward=zero_reward, **extra, **settings)
        trainer.train()
        trained.append({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    for name, theirs in trained[0].items():
        torch.testing.assert_close(trained[1][name], theirs, rtol=1e-4, atol=1e-6, msg=name)


def masks_changed_after_planning(trainer) -> dict:
    """A micro-batch planned, then its masks changed in place: a completion cut short, a prompt token padded."""
    inputs = micro_batch()
    plan.annotate(trainer, [inputs], with_zeros=trainer.skip_reason is None)
    inputs["completion_mask"][0, 2:] = 0
    inputs["prompt_mask"][1, 0] = 0
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum().double()
    return inputs


@pytest.mark.parametrize("padding_free", ["pack", "trim"])
def test_changed_masks_are_planned_again(tmp_path, padding_free):
    """The real spans a plan holds are read again where the masks changed: packed or trimmed, TRL's step."""
    trainer = skipping_trainer(tmp_path, "off", loss_type="dapo")
    trainer.padding_free_mode = padding_free
    inputs = masks_changed_after_planning(trainer)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert_same(ours, theirs)


def test_stale_spans_trusted_change_the_step(tmp_path, monkeypatch):
    """The check's sabotage: trusting the spans read before the change packs tokens the masks now exclude."""
    monkeypatch.setattr(plan.Lengths, "fits", lambda self, inputs: True)
    trainer = skipping_trainer(tmp_path, "off", loss_type="dapo")
    trainer.padding_free_mode = "pack"
    inputs = masks_changed_after_planning(trainer)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    with pytest.raises(AssertionError):
        assert_same(ours, theirs)
