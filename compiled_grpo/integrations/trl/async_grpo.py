"""TRL 1.16's AsyncGRPOTrainer with its loss on this library's packed path.

    from compiled_grpo.integrations.trl.async_grpo import CompiledAsyncGRPOTrainer
    trainer = CompiledAsyncGRPOTrainer(model="Qwen/...", reward_funcs=..., args=AsyncGRPOConfig(...), ...)

TRL's async trainer packs a rank's micro-batch into one row (a prefix tree of its samples: a token shared by
several samples is forwarded once) and scores each trained token from the packed position that predicts it
(`token_index`; a shared position serves several loss terms). Its loss is the clipped surrogate (TRL's
`epsilon` and `epsilon_high`) summed over the loss terms, divided by the trained tokens per rank and by the
gradient accumulation steps: here, loss type "dapo" with `num_items_in_batch` = the micro-batch's trained tokens
and no steps-per-generation factor. This trainer runs the model on the packed row with the lm_head projecting a
single position, takes the final hidden states, and streams the loss terms through `FusedLinearGRPOLoss`'s packed
path (`row_index` = token_index, `segment_ids` = each term's sample), so no [positions, vocabulary] logits are
made. TRL's metrics (ratio, kl, entropy, the clip ratios, aux_loss) and its per-step accounting are logged under
TRL's names. Generation (the vLLM server and the rollout worker) is TRL's, unchanged. Samples at advantage 0 are
packed into a trie of their own that runs without grad, or not at all (`async_zero_advantage`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from trl.experimental.async_grpo import AsyncGRPOTrainer

from ...loss import FusedLinearGRPOLoss
from . import async_zero_advantage, sharded_head, zero_advantage
from .hidden_states import hidden_states_at_head
from .settings import head_scaling, read_back, unwrapped

TREE_KEYS = ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")


@dataclass(frozen=True)
class LossTerms:
    """The loss terms of one packed row: for each, the packed position that predicts it, its target, the
    generator's log-probability, its advantage and its sample."""

    token_index: torch.Tensor
    targets: torch.Tensor
    old_logps: torch.Tensor
    advantages: torch.Tensor
    segment_id: torch.Tensor


def unpack(inputs: dict) -> tuple[dict, LossTerms]:
    """The model's inputs for this rank's packed row (padding between ranks' rows dropped), and its loss terms."""
    keep = inputs["attention_mask"].bool()
    terms = inputs["token_index"] >= 0
    model_inputs = {
        "input_ids": inputs["input_ids"][keep].unsqueeze(0),
        "position_ids": inputs["position_ids"][keep].unsqueeze(0),
        **{key: inputs[key][inputs[key] >= 0] for key in TREE_KEYS},
    }
    model_inputs["tree_max_seqlen_q"], model_inputs["tree_max_seqlen_k"] = inputs["tree_max_seqlens"][0].tolist()
    token_index = inputs["token_index"][terms]
    targets = inputs["shift_labels"][keep][token_index]
    pick = lambda key: inputs[key][terms]
    return model_inputs, LossTerms(token_index, targets, pick("old_log_probs"), pick("advantages"), pick("segment_id"))


def async_loss_settings(trainer) -> dict:
    logit_scale, softcap = head_scaling(trainer.accelerator.unwrap_model(trainer.model).config)
    return {
        "loss_type": "dapo",
        "epsilon_low": trainer.epsilon_low,
        "epsilon_high": trainer.epsilon_high,
        "temperature": trainer.temperature,
        "logit_scale": logit_scale,
        "final_logit_softcapping": softcap,
    }


class CompiledAsyncGRPOTrainer(AsyncGRPOTrainer):
    """AsyncGRPOTrainer whose `compute_loss` is compiled_grpo's fused loss on the packed row. `compiled` and
    `schedule` are passed to `FusedLinearGRPOLoss`; `skip_zero_advantage` ("auto", "backward", "all", False) packs
    the samples at advantage 0 apart and runs their forward without grad, or not at all
    (`async_zero_advantage`); everything else is TRL's."""

    def __init__(self, *args, compiled: bool = True, schedule: str = "auto", skip_zero_advantage="auto", **kwargs):
        zero_advantage.check_mode(skip_zero_advantage)
        super().__init__(*args, **kwargs)
        self.fused_loss = FusedLinearGRPOLoss(compiled=compiled, schedule=schedule, **async_loss_settings(self))
        weight = self.accelerator.unwrap_model(self.model).get_output_embeddings().weight
        hidden_size = sharded_head.full_shape(weight)[1]
        self.shards_parameters = sharded_head.trainer_shards_parameters(self)
        self.skip_zero_advantage = skip_zero_advantage
        self.skip_reason = async_zero_advantage.reason_not_to_split(self, skip_zero_advantage, hidden_size)

    def get_train_dataloader(self):
        """TRL's, its collator packing the samples at advantage 0 apart (`async_zero_advantage.SplitCollator`)."""
        if self.skip_reason is not None:
            return super().get_train_dataloader()
        forward_untrained = self.skip_zero_advantage != "all"
        with async_zero_advantage.split_collator(forward_untrained):
            return super().get_train_dataloader()

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        return packed_row_loss(self, model, inputs)


def packed_row_loss(trainer, model, inputs: dict) -> torch.Tensor:
    """TRL 1.16's `AsyncGRPOTrainer.compute_loss` on `trainer.fused_loss`: the same loss, metrics and accounting."""
    model_inputs, terms = unpack(inputs)
    if trainer.aux_loss_enabled:  # MoE: the forward returns the load-balancing loss
        model_inputs["output_router_logits"] = True
    lm_head = unwrapped(trainer, model).get_output_embeddings()
    forward_start = time.time()
    hidden, outputs = hidden_states_at_head(model, lm_head, model_inputs)
    hidden, terms, mask = with_second_row(model, lm_head, inputs, hidden[0], terms)
    world = trainer.accelerator.num_processes
    trained = inputs["global_n_tokens"][0]
    sequences = int(terms.segment_id.max()) + 1 if terms.segment_id.numel() else 0
    # inside a call of the lm_head, so that an engine that shards it gathers its weight (`sharded_head`)
    compute = lambda weight, bias, hidden: trainer.fused_loss(  # noqa: E731
        hidden,
        weight,
        terms.targets,
        mask,
        terms.advantages,
        bias=bias,
        old_per_token_logps=terms.old_logps,
        segment_ids=terms.segment_id,
        num_sequences=sequences,
        row_index=terms.token_index,
        # TRL divides by max(trained / ranks, 1); the loss divides by max(num_items, 1) / ranks
        num_items_in_batch=(trained / world).clamp(min=1.0) * world,
        num_processes=world,
        gradient_accumulation_steps=trainer.current_gradient_accumulation_steps,
        steps_per_generation=1,
    )
    out = sharded_head.loss_within_head(lm_head, compute, hidden, model)
    trainer._last_forward_time_s = time.time() - forward_start
    loss = out.loss
    if trainer.aux_loss_enabled:
        aux = outputs.aux_loss
        loss = loss + trainer.router_aux_loss_coef * aux / trainer.current_gradient_accumulation_steps
    log_metrics(trainer, out, terms, outputs.aux_loss if trainer.aux_loss_enabled else None)
    account_step(trainer, inputs, trained)
    return loss


def with_second_row(model, lm_head, inputs: dict, hidden, terms: LossTerms):
    """(hidden states, loss terms, their mask): the row's, joined by those of the samples at advantage 0 packed
    apart (`async_zero_advantage`: their forward without grad; a stand-in's run, then dropped)."""
    second = async_zero_advantage.second_row(inputs)
    counts = async_zero_advantage.first_row_counts(inputs)
    if second is None:
        return hidden, terms, torch.full_like(terms.targets, int(counts))
    model_inputs, zero_terms = unpack(second)
    with torch.no_grad():
        rest, _ = hidden_states_at_head(model, lm_head, model_inputs)
    if bool(second["stand_in"][0]):
        return hidden, terms, torch.ones_like(terms.targets)
    offsets = (hidden.shape[0], int(terms.segment_id.max()) + 1 if terms.segment_id.numel() else 0)
    joined = LossTerms(
        torch.cat([terms.token_index, zero_terms.token_index + offsets[0]]),
        torch.cat([terms.targets, zero_terms.targets]),
        torch.cat([terms.old_logps, zero_terms.old_logps]),
        torch.cat([terms.advantages, zero_terms.advantages]),
        torch.cat([terms.segment_id, zero_terms.segment_id + offsets[1]]),
    )
    return torch.cat([hidden, rest[0].to(hidden.dtype)]), joined, torch.ones_like(joined.targets)


def log_metrics(trainer, out, terms: LossTerms, aux_loss) -> None:
    """TRL's async metrics over every rank's loss terms: the mean ratio and the k3 KL estimate of the ratio, and the
    loss's own (already over every rank): mean entropy, the clip ratios, the lowest low-clip and highest high-clip
    fraction of a sample; the auxiliary loss averaged over ranks. One wait on the device for all of them."""
    acc, world = trainer.accelerator, trainer.accelerator.num_processes
    with torch.no_grad():
        log_ratio = out.per_token_logps - terms.old_logps
        ratio = torch.exp(log_ratio)
        sums = torch.stack([ratio.sum(), (ratio - 1 - log_ratio).sum(), ratio.new_full((), float(ratio.numel()))])
        ratio_sum, kl_sum, count = acc.reduce(sums, reduction="sum").unbind(0)
        values = {"ratio": ratio_sum / count, "kl": kl_sum / count}
        for name in ASYNC_METRICS:
            values[name] = out.metrics[name]
        if aux_loss is not None:
            values["aux_loss"] = acc.reduce(aux_loss.detach().float(), reduction="sum") / world
    for name, value in read_back(values).items():
        trainer._metrics["train"][name].append(value)


ASYNC_METRICS = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                 "clip_ratio/low_min", "clip_ratio/high_max")  # fmt: skip


def account_step(trainer, inputs: dict, trained) -> None:
    """TRL's per-step accounting, summed over the micro-batches of an optimizer step (flushed by TRL)."""
    forward_tokens = float(inputs["global_n_forward_tokens"][0])
    mean_length = float(inputs["mean_seq_len"][0])
    trainer._step_forward_tokens += forward_tokens
    trainer._step_trained_tokens += float(trained)
    trainer._step_seq_len_weighted += mean_length * forward_tokens
    trainer._step_samples += forward_tokens / mean_length
    trainer._step_forward_s += trainer._last_forward_time_s
