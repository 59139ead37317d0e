"""A batch packed by TRL 1.16's own async packing (`trl.experimental.async_grpo.packing.TreeRow`): a prefix
trie of two prompts with three completions each, whose shared opening tokens are forwarded once and predicted
from one position for all three completions. The per-token log-probs and entropies equal those of the model
TRL's `AsyncGRPOTrainer.compute_loss` runs (here: the lm_head on fixed hidden states), and the loss, its
gradients and the shared metrics equal that `compute_loss`'s, run on the same batch. TRL's async loss is a
clipped token-level objective normalized by the trained tokens of the batch: the library's dapo with
num_items_in_batch = those tokens and steps_per_generation = 1.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl_standin import OneProcessAccelerator

from compiled_grpo import FusedLinearGRPOLoss

packing = pytest.importorskip("trl.experimental.async_grpo.packing")
async_trainer = pytest.importorskip("trl.experimental.async_grpo.async_grpo_trainer")

H, V = 16, 97


def tree_row(seed: int):
    g = torch.Generator().manual_seed(seed)
    row = packing.TreeRow()
    for group in range(2):
        prompt = torch.randint(0, V, (5 + group,), generator=g)
        opening = torch.randint(0, V, (2,), generator=g)  # the group's completions open alike, then diverge
        for _ in range(3):
            rest = torch.randint(0, V, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
            completion = torch.cat([opening, rest])
            ids = torch.cat([prompt, completion])
            mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(completion))]).long()
            mask[-1] = int(torch.rand(1, generator=g) > 0.3)  # a tool-masked last token now and then
            row.add({
                "input_ids": ids,
                "completion_mask": mask,
                "old_log_probs": -4.6 + 0.2 * torch.randn(len(ids), generator=g),
                "advantage": float(torch.randn(1, generator=g)),
                "group_id": group,
            })  # fmt: skip
    return row.pack(), g


class HeadOnHiddenStates(torch.nn.Module):
    """Stands in for the model: per-position log-prob of `shift_labels` and entropy from fixed hidden states."""

    def __init__(self, hidden, weight):
        super().__init__()
        self.hidden, self.weight = hidden, weight

    def forward(self, input_ids, position_ids, shift_labels, fused_lm_head, **tree):
        log_p = torch.log_softmax(self.hidden @ self.weight.T, -1)
        labels = shift_labels[0].clamp(min=0)
        log_probs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_p.exp() * log_p).sum(-1)
        return SimpleNamespace(log_probs=log_probs.unsqueeze(0), entropy=entropy.unsqueeze(0))


def trl_async_loss(packed, hidden, weight, epsilon):
    """AsyncGRPOTrainer.compute_loss itself, on a stand-in for the trainer's state."""
    M, N = packed["token_index"].numel(), packed["input_ids"].numel()
    inputs = {k: v.unsqueeze(0) for k, v in packed.items()}
    inputs["attention_mask"] = torch.ones(1, N, dtype=torch.long)
    inputs["global_n_tokens"] = torch.tensor([float(M)])
    inputs["global_n_forward_tokens"] = torch.tensor([float(N)])
    inputs["mean_seq_len"] = torch.tensor([float(N) / 6])
    state = SimpleNamespace(
        epsilon_low=epsilon, epsilon_high=epsilon, accelerator=OneProcessAccelerator(),
        current_gradient_accumulation_steps=1, aux_loss_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)), _step_forward_tokens=0.0, _step_trained_tokens=0.0,
        _step_seq_len_weighted=0.0, _step_samples=0.0, _step_forward_s=0.0,
    )  # fmt: skip
    model = HeadOnHiddenStates(hidden, weight)
    loss = async_trainer.AsyncGRPOTrainer.compute_loss(state, model, inputs)
    return loss, {k: v[-1] for k, v in state._metrics["train"].items()}, model


@pytest.mark.parametrize("schedule", ["memory", "speed", "sparse"])
def test_trl_tree_packed_batch_matches_trl_async_loss(schedule):
    packed, g = tree_row(seed=31)
    N, token_index = packed["input_ids"].numel(), packed["token_index"]
    assert token_index.unique().numel() < token_index.numel()  # positions shared by several targets
    hidden = torch.randn(N, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) / 2

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    trl_loss, trl_metrics, model = trl_async_loss(packed, h1, w1, epsilon=0.2)
    trl_loss.backward()

    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, loss_type="dapo", epsilon_low=0.2,
                                  token_tile=16, tail_tile=8, vocab_tile=32, speed_tile=16, sparse_tile=8)  # fmt: skip
    out = loss_fn(
        h2, w2, packed["shift_labels"][token_index], torch.ones_like(token_index), packed["advantages"],
        segment_ids=packed["segment_id"], row_index=token_index, old_per_token_logps=packed["old_log_probs"],
        num_items_in_batch=token_index.numel(), steps_per_generation=1,
    )  # fmt: skip
    out.loss.backward()

    with torch.no_grad():
        trl_out = model(None, None, packed["shift_labels"].unsqueeze(0), True)
    torch.testing.assert_close(out.per_token_logps, trl_out.log_probs[0][token_index], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.entropy, trl_out.entropy[0][token_index], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.loss, trl_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-9, atol=1e-12)
    shared = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
              "clip_ratio/low_min", "clip_ratio/high_max")  # fmt: skip
    for name in shared:
        # TRL sums the per-sequence counts in float32
        assert float(out.metrics[name]) == pytest.approx(trl_metrics[name], rel=1e-6, nan_ok=True), name
