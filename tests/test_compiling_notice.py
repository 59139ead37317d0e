"""The compiling notice names the user's line, also when the first compiled tile runs inside an autograd Function
(torch's frames skipped, like this package's)."""

from __future__ import annotations

import warnings

import torch
from cases import TILES, make_inputs

from compiled_grpo import CompilingNotice, FusedLinearGRPOLoss, fused_linear_logprobs, kernels, logprobs


def first_notice(monkeypatch, call):
    """The CompilingNotice of `call()`, with torch.compile made the identity (the notice comes before any compile;
    compiling is the compiled tests' business)."""
    monkeypatch.setattr(kernels, "_compiling_noticed", False)
    monkeypatch.setattr(kernels.torch, "compile", lambda f, **options: f)
    logprobs.kernels.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            call()
    finally:
        logprobs.kernels.cache_clear()  # the next caller gets the real compiled kernels again
    notices = [w for w in seen if issubclass(w.category, CompilingNotice)]
    assert len(notices) == 1
    return notices[0]


def test_the_notice_of_the_loss_names_the_users_line(monkeypatch):
    x = make_inputs(seed=3, dtype=torch.float32)
    hidden = x["hidden"].requires_grad_()  # the memory schedule's statistics run inside an autograd Function
    args = (hidden, x["weight"], x["completion_ids"], x["completion_mask"], x["advantages"])
    notice = first_notice(monkeypatch, lambda: FusedLinearGRPOLoss(schedule="memory", **TILES)(*args))
    assert notice.filename == __file__, notice.filename


def test_the_notice_of_the_primitive_names_the_users_line(monkeypatch):
    hidden = torch.randn(6, 8, requires_grad=True)
    weight = torch.randn(50, 8)
    notice = first_notice(monkeypatch, lambda: fused_linear_logprobs(hidden, weight, torch.randint(0, 50, (6,))))
    assert notice.filename == __file__, notice.filename


def test_the_notice_of_a_trainers_train_names_the_users_line(monkeypatch, tmp_path):
    """Under `trainer.train()` the loss is reached through transformers', accelerate's and TRL's frames: skipped too."""
    from test_integration_trl import make_trainer, tiny_model

    from compiled_grpo.integrations.trl import CompiledGRPOTrainer

    trainer = make_trainer(CompiledGRPOTrainer, tmp_path, tiny_model(dtype=torch.float32), gradient_checkpointing=True)
    trainer.fused_loss = FusedLinearGRPOLoss(compiled=True, schedule="memory", **TILES)  # its kernels compiled
    notice = first_notice(monkeypatch, trainer.train)
    assert notice.filename == __file__, notice.filename
