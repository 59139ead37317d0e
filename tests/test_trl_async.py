"""CompiledAsyncGRPOTrainer against TRL 1.16's own AsyncGRPOTrainer: its `compute_loss` on batches packed by TRL's
own collator (prefix trees whose shared positions serve several loss terms), and a whole training step of each
trainer on the same prepared batch. TRL's generation side (a vLLM server) cannot run here: the rollout worker and
the weight transfer are stand-ins, and the batches are made from sampled token ids.
"""

from __future__ import annotations

import copy
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from test_integration_trl import tokenizer  # noqa: E402 - a word-level tokenizer, nothing downloaded
from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from compiled_grpo import FusedLinearGRPOLoss  # noqa: E402
from compiled_grpo.integrations.trl.async_grpo import (  # noqa: E402
    ASYNC_METRICS,
    CompiledAsyncGRPOTrainer,
    async_loss_settings,
    packed_row_loss,
)

VOCAB = 97
TEMPERATURE = 0.9


def tiny_model(seed=0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, tie_word_embeddings=False)  # fmt: skip
    config._attn_implementation = "eager"
    return Qwen2ForCausalLM(config).float()


def packed_batch(groups=3, per_group=3, prompt=5, seed=0) -> dict:
    """One rank's micro-batch as TRL's collator packs it: each group's samples share their prompt (and, for the
    first two samples of a group, the first completion token), so a shared position serves several loss terms."""
    g = torch.Generator().manual_seed(seed)
    row = TreeRow()
    for group in range(groups):
        head = torch.randint(3, VOCAB, (prompt + 1,), generator=g)
        for i in range(per_group):
            length = int(torch.randint(3, 9, (1,), generator=g))
            tail = torch.randint(3, VOCAB, (length,), generator=g)
            ids = torch.cat([head if i < 2 else head[:-1], tail])
            mask = torch.zeros(len(ids), dtype=torch.long)
            mask[prompt:] = 1
            mask[-1] = int(i != 1)  # a completion whose last token is not trained
            row.add({
                "input_ids": ids,
                "completion_mask": mask,
                "old_log_probs": -4.5 + torch.randn(len(ids), generator=g),  # ratios far from 1: both clips taken
                "advantage": float(torch.randn((), generator=g)),
                "group_id": group,
                "metrics": {},
            })  # fmt: skip
    collator = DataCollatorForRollout(pad_token_id=0, num_processes=1)
    return collator.torch_call([[row]])


class OneProcessAccelerator:
    num_processes = 1

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    def unwrap_model(self, model):
        return model


def stand_in(model, **overrides):
    """The attributes TRL's `compute_loss` (and this library's) read."""
    t = SimpleNamespace(
        epsilon_low=0.2, epsilon_high=0.28, temperature=TEMPERATURE, aux_loss_enabled=False, router_aux_loss_coef=0.0,
        accelerator=OneProcessAccelerator(), current_gradient_accumulation_steps=2, model=model,
        _metrics={"train": defaultdict(list)}, _step_forward_tokens=0.0, _step_trained_tokens=0.0,
        _step_seq_len_weighted=0.0, _step_samples=0.0, _step_forward_s=0.0, _last_forward_time_s=0.0,
    )  # fmt: skip
    for k, v in overrides.items():
        setattr(t, k, v)
    return t


def loss_and_gradients(loss_of, model, inputs):
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("schedule", ["memory", "speed", "auto"])
def test_compute_loss_matches_trls_on_its_packed_batches(schedule):
    model = tiny_model()
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    inputs = packed_batch()
    assert inputs["token_index"].unique().numel() < inputs["token_index"].numel()  # shared positions exist
    theirs = stand_in(model)
    ours = stand_in(model)
    ours.fused_loss = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **async_loss_settings(ours))
    trl_loss, trl_grads = loss_and_gradients(
        lambda m, x: AsyncGRPOTrainer.compute_loss(theirs, m, x), model, copy.deepcopy(inputs)
    )
    loss, grads = loss_and_gradients(lambda m, x: packed_row_loss(ours, m, x), model, copy.deepcopy(inputs))
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-7)
    assert grads.keys() == trl_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    for name in ("ratio", "kl", *ASYNC_METRICS):
        assert ours._metrics["train"][name] == pytest.approx(theirs._metrics["train"][name], rel=1e-5), name
    low, high = theirs._metrics["train"]["clip_ratio/low_mean"][0], theirs._metrics["train"]["clip_ratio/high_mean"][0]
    assert low > 0 and high > 0  # both clip branches reached
    for field in ("_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted", "_step_samples"):
        assert getattr(ours, field) == getattr(theirs, field), field


class StandInRolloutWorker:
    rollout_buffer = None

    def start(self):
        pass

    def stop(self):
        pass

    def update_model_version(self, version):
        pass

    def check_health(self, stale_after_s):
        pass


def trainer(cls, path, out, **extra):
    args = AsyncGRPOConfig(output_dir=str(out), per_device_train_batch_size=4, learning_rate=1e-2, report_to=[],
                           use_cpu=True, temperature=TEMPERATURE, epsilon_high=0.28, save_strategy="no")  # fmt: skip
    t = cls(model=str(path), args=args, train_dataset=[{"prompt": "a"}], processing_class=tokenizer(),
            rollout_worker=StandInRolloutWorker(), weight_transfer=SimpleNamespace(), **extra)  # fmt: skip
    t.model.set_attn_implementation("eager")  # TRL's tree attention needs a FlashAttention-3 kernel from the Hub
    t.current_gradient_accumulation_steps = 1
    return t


def test_one_training_step_matches_trls(tmp_path, monkeypatch):
    from trl.experimental.async_grpo import async_grpo_trainer

    # TRL's constructor reads the GPU's name for its throughput metrics; this machine has none
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: 1e12)
    path = tmp_path / "model"
    tiny_model(seed=1).save_pretrained(path)
    inputs = packed_batch(seed=3)
    before = {n: p.detach().clone() for n, p in tiny_model(seed=1).named_parameters()}
    after = []
    for cls, extra in ((AsyncGRPOTrainer, {}), (CompiledAsyncGRPOTrainer, {"compiled": False})):
        t = trainer(cls, path, tmp_path / cls.__name__, **extra)
        t.create_optimizer()
        t.training_step(t.model, copy.deepcopy(inputs), None)
        t.optimizer.step()
        after.append({n: p.detach().clone() for n, p in t.model.named_parameters()})
        assert t._metrics["train"]["entropy"], "the step logged TRL's metrics"
    assert after[0].keys() == after[1].keys()
    for name, value in after[1].items():
        torch.testing.assert_close(value, after[0][name], rtol=1e-5, atol=1e-6, msg=name)
    assert sum(not torch.equal(after[1][n], before[n]) for n in before) > len(before) // 2  # the step moved them


def test_trls_own_async_loss_on_the_compiled_head(monkeypatch):
    """TRL's own `compute_loss` inside `compiled_fused_head()`: its fused head (which the async trainer calls with
    `fused_lm_head=True`) runs on `fused_linear_logprobs`, with TRL's loss on top: the same loss and gradients."""
    from compiled_grpo.integrations.trl import compiled_fused_head
    from compiled_grpo.integrations.trl import head as integration

    calls = []
    primitive = integration.fused_linear_logprobs
    monkeypatch.setattr(integration, "fused_linear_logprobs", lambda *a, **k: calls.append(1) or primitive(*a, **k))

    model = tiny_model()
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    inputs = packed_batch(seed=5)
    trl_loss, trl_grads = loss_and_gradients(
        lambda m, x: AsyncGRPOTrainer.compute_loss(stand_in(m), m, x), model, copy.deepcopy(inputs)
    )
    with compiled_fused_head(compiled=False):
        loss, grads = loss_and_gradients(
            lambda m, x: AsyncGRPOTrainer.compute_loss(stand_in(m), m, x), model, copy.deepcopy(inputs)
        )
    assert calls, "TRL's head did not run on this library"
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-7)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-4, atol=1e-6, msg=name)
