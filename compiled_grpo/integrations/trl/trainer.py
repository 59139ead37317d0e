"""CompiledGRPOTrainer: TRL 1.16's GRPOTrainer with its loss, and its old and reference log-probs, on this
library's fused head (the package's docstring says what it covers)."""

from __future__ import annotations

import warnings

import torch
import trl
from trl import GRPOTrainer

from ... import logprobs
from ...loss import FusedLinearGRPOLoss, GRPOLossOutput
from . import entropy_bonus, packing, regional_compile, regroup, rollouts, scoring, sharded_head, zero_advantage
from . import padding_free as real_tokens
from . import plan as micro_batch_plan
from .head import compiled_fused_head
from .hidden_states import completion_hidden_states
from .settings import captures_by_default, check_loss_options, loss_settings, settle, trainer_budget, unwrapped

if trl.__version__ != "1.16.0":
    warnings.warn(
        f"compiled_grpo follows TRL 1.16.0's loss to the letter and was tested with it; trl {trl.__version__} is "
        "installed, whose GRPOTrainer may compute or call its loss differently",
        stacklevel=2,
    )

MODEL_EXTRA_INPUTS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "token_type_ids", "mm_token_type_ids",
    "spatial_shapes", "image_position_ids",
)  # fmt: skip


class CompiledGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose `_compute_loss` is compiled_grpo's fused loss, and whose old and reference log-probs come from
    `fused_linear_logprobs` (`compiled_fused_head`). `compiled`, `schedule` and `loss_options` (tile sizes,
    `logits_budget_bytes`...) go to `FusedLinearGRPOLoss`; everything else is TRL's. Unless `loss_options` sets it, the
    lm_head's workspace is bounded by what TRL's own head would hold (`trainer_budget`), so an uncaptured step's peak
    stays under GRPOTrainer's. On a GPU, up to hidden size 2048, the loss's calls are captured as CUDA graph replays
    (`captures_by_default`; `loss_options={"capture": False}` turns it off, `True` on at any size), their pool inside
    that budget (its static buffers and free part held between steps: docs/performance.md). Metrics stay tensors until
    logged: a step does not wait on the GPU for them."""

    def __init__(self, *args, compiled: bool = True, schedule: str = "auto", loss_options: dict | None = None,
                 skip_zero_advantage="auto", padding_free="auto", packed_attention="auto", packed_bucket: int = 256,
                 compile_backbone="auto", compile_generation="auto", share_prompts="auto", **kwargs):  # fmt: skip
        regional_compile.check_mode(compile_backbone)
        check_loss_options(loss_options)
        zero_advantage.check_mode(skip_zero_advantage)
        real_tokens.check_options(padding_free, packed_attention, packed_bucket, share_prompts)
        super().__init__(*args, **kwargs)
        # an engine that shards the lm_head gathers it to a new address each call: graphs keyed on it would not serve
        self.shards_parameters = sharded_head.trainer_shards_parameters(self)
        regional_compile.configure(self, compile_backbone)
        rollouts.configure(self, compile_generation)
        real_tokens.configure(self, padding_free, packed_attention, packed_bucket, share_prompts)
        weight = sharded_head.shape_only(self.accelerator.unwrap_model(self.model).get_output_embeddings().weight)
        options = {"capture": captures_by_default(weight) and not self.shards_parameters, **(loss_options or {})}
        self.fused_loss = FusedLinearGRPOLoss(compiled=compiled, schedule=schedule, **options, **loss_settings(self))
        if "logits_budget_bytes" not in options:
            self.fused_loss.logits_budget_bytes = trainer_budget(self.fused_loss, weight, self.accelerator.device)
        self.skip_zero_advantage = zero_advantage.effective_mode(self, skip_zero_advantage)
        self.skip_reason = zero_advantage.reason_not_to_split(self, self.skip_zero_advantage, weight.shape[1])

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        settle(self._metrics["train" if self.model.training else "eval"])
        self.fused_loss.check()  # a value check still pending from the last step (read back with the metrics)
        logprobs.PRIMITIVE_DEFERRED.raise_pending()
        super().log(logs, start_time)

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        """Old and reference log-probs (and TRL's own scoring) on this library's kernels, like the loss's (at its
        `round_logits`, so an on-policy ratio stays exactly 1)."""
        narrowed = widened_hidden_dtype(self) if self.args.cast_lm_head_to_fp32 else None
        with compiled_fused_head(self.fused_loss.kernels.compiled, round_logits=self.fused_loss.round_logits,
                                 hidden_dtype=narrowed):  # fmt: skip
            return regional_compile.forward_or_fall_back(
                self,
                lambda: scoring.per_token_logps(
                    self, super(CompiledGRPOTrainer, self)._get_per_token_logps_and_entropies, *args, **kwargs
                ),
            )

    def _prepare_inputs(self, generation_batch):
        """TRL's micro-batch; a new generation batch's micro-batches carry their rows at advantage 0 (one read-back
        for them all), and under skip_zero_advantage="all" its sequences with a gradient are first gathered into
        the first micro-batches of each optimizer step (`regroup`)."""
        regional_compile.compile_trainer_backbone(self)  # once, after accelerate wrapped the model (FSDP2, DDP)
        buffered = self._buffered_inputs
        inputs = super()._prepare_inputs(generation_batch)
        fresh = self._buffered_inputs is not buffered and self.model.training
        if not fresh or any(inputs.get(k) is not None for k in MODEL_EXTRA_INPUTS):
            return inputs
        regional_compile.watch_graph_recording(self)  # once per generation batch
        if regroup.applies(self):
            self._buffered_inputs = regroup.regroup(self, self._buffered_inputs)
        # each micro-batch's plan (its rows at 0, its real tokens), found once
        micro_batch_plan.annotate(self, self._buffered_inputs, with_zeros=self.skip_reason is None)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def _generate(self, prompts: list):  # the layers' own compiled calls set aside (`rollouts` compiles decoding)
        with regional_compile.eager_layers(self):
            return super()._generate(prompts)

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):  # on compiled decoding where it runs (`rollouts`)
        run = lambda: super(CompiledGRPOTrainer, self)._generate_single_turn(prompt_ids, *args, **kwargs)  # noqa: E731
        return rollouts.generate(self, run, prompt_ids)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        multimodal = any(inputs.get(k) is not None for k in MODEL_EXTRA_INPUTS)
        plan = zero_advantage.row_plan(self, inputs, mode, multimodal)  # sequences at advantage 0 skip their backward
        lengths = None if multimodal or self.padding_free_mode is False else micro_batch_plan.lengths(self, inputs)
        if lengths is not None:  # its own longest prompt and completion, or packed (`_forward`)
            inputs, lengths = packing.trimmed(inputs, lengths)
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        model_inputs = {
            "input_ids": torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            "attention_mask": torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
            **{k: inputs[k] for k in MODEL_EXTRA_INPUTS if inputs.get(k) is not None},
        }
        if self.aux_loss_enabled:
            model_inputs["output_router_logits"] = True
        lm_head = unwrapped(self, model).get_output_embeddings()
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        padded = lambda rows: completion_hidden_states(model, lm_head, rows, completion_ids.size(1))  # noqa: E731
        with self.accelerator.autocast():
            hidden, outputs, targets = regional_compile.forward_or_fall_back(
                self, lambda: real_tokens.forward(self, model, padded, model_inputs, lengths, plan)
            )
            if hidden is None:  # no sequence to train and nothing to log: no forward at all
                zero_advantage.log_skipped(self, plan, mode)
                return zero_advantage.zero_gradients_loss(model)
            rows = zero_advantage.loss_rows(self, inputs, mask, plan)
            packed = {} if targets is None else packing.per_target(rows.inputs, rows.mask, targets)
            given = {**rows.inputs, "completion_mask": rows.mask, **packed}  # completion_mask: the loss's mask
            with torch.set_grad_enabled(hidden.requires_grad):  # no loss graph when no row has a gradient
                out = self._fused_loss(hidden, lm_head, given, mode)
        loss = out.loss * rows.share
        if not hidden.requires_grad:  # every row ran without grad: their parameters' gradients are zeros
            loss = loss + zero_advantage.zero_gradients_loss(model)
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / accumulation
            aux = self.accelerator.gather_for_metrics(outputs.aux_loss.detach()).mean()
            self._metrics[mode]["aux_loss"].append(aux)
        for name, value in out.metrics.items() if rows.log_metrics else ():  # read back when logged (`settle`)
            self._metrics[mode][name].append(value.detach())
        zero_advantage.log_skipped(self, plan, mode)
        if self._entropy_bonus_enabled:
            entropy_bonus.update_entropy_controller(self, out, given["completion_mask"], mode)
        return loss

    def _fused_loss(self, hidden, lm_head, inputs: dict, mode) -> GRPOLossOutput:
        """The fused loss of this micro-batch, padded or packed (`packing.per_target`), its mask
        `inputs["completion_mask"]`, run where an engine that shards the lm_head gathers it (`sharded_head`)."""
        call = loss_call(self, inputs, mode, hidden.device)
        completion_ids, mask, advantages = inputs["completion_ids"], inputs["completion_mask"], inputs["advantages"]

        def compute(weight, bias, hidden):
            return loss_on_head(self, hidden, (weight, bias), (completion_ids, mask, advantages), call)

        return sharded_head.loss_within_head(lm_head, compute, hidden, self.model)


def loss_call(trainer, inputs: dict, mode: str, device) -> dict:
    """The fused loss's keyword inputs for this micro-batch, from TRL's (in eval mode without gradient
    accumulation, as TRL)."""
    args = trainer.args
    ratio = inputs.get("importance_sampling_ratio")
    use_ratio = (trainer.use_vllm and trainer.vllm_importance_sampling_correction) or args.loss_type == "vespo"
    return {
        "old_per_token_logps": inputs.get("old_per_token_logps"),
        "ref_per_token_logps": inputs.get("ref_per_token_logps") if args.beta != 0.0 else None,
        "importance_sampling_ratio": ratio if use_ratio else None,
        "sampling_per_token_logps": inputs.get("sampling_per_token_logps"),
        "num_items_in_batch": inputs.get("num_items_in_batch"),
        "num_processes": trainer.accelerator.num_processes,
        "gradient_accumulation_steps": trainer.current_gradient_accumulation_steps if mode == "train" else 1,
        "steps_per_generation": args.steps_per_generation if mode == "train" else 1,
        "entropy_coef": entropy_bonus.entropy_coef_to_apply(trainer, device),
        **{k: inputs[k] for k in ("segment_ids", "num_sequences", "row_index") if k in inputs},
    }


def widened_hidden_dtype(trainer) -> torch.dtype | None:
    """Under `cast_lm_head_to_fp32`, the 16-bit dtype of the model's final hidden states, which TRL widens to float32
    for its head (that of the model's last parameter outside the lm_head, its final norm's): narrowed back, the
    old and reference log-probs come from the fp32 head's products as the loss's do. None where it is not 16-bit."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    head = {id(p) for p in model.get_output_embeddings().parameters()}
    last = [p for p in model.parameters() if id(p) not in head and p.is_floating_point()][-1:]
    return last[0].dtype if last and last[0].dtype in (torch.bfloat16, torch.float16) else None


def loss_on_head(trainer, hidden, head: tuple, rows: tuple, call: dict) -> GRPOLossOutput:
    """The trainer's fused loss on the lm_head's (weight, bias); `rows`: (completion ids, mask, advantages)."""
    weight, bias = head
    if not trainer.args.cast_lm_head_to_fp32:
        return trainer.fused_loss(hidden, weight, *rows, bias=bias, **call)
    # the fp32 head: the float32 weight against the hidden states as they are (16-bit ones are widened by the
    # loss, exactly, and its products come from bf16 terms on a GPU), autocast off as TRL computes it
    if hidden.dtype not in (torch.bfloat16, torch.float16):
        hidden = hidden.float()  # as TRL casts them (a float64 model's)
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if bias is None else bias.float()
        return trainer.fused_loss(hidden, weight.float(), *rows, bias=bias, **call)
