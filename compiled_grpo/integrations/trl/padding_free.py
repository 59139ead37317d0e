"""CompiledGRPOTrainer's forwards on real tokens only (`packing`): the choice, the model check, the packed forwards.

`padding_free="pack"` packs each micro-batch where the model keeps packed sequences apart (checked once per trainer
on its eager layers, `packing_fails`) and trims it elsewhere; `"trim"` only trims; False runs TRL's padded forward;
`"auto"` (the default) is "pack" on a GPU where the packed attention is torch's varlen FlashAttention on compiled
decoder layers, or from hidden size `PACK_HIDDEN_SIZE`, "trim" elsewhere (`effective_mode`).
Packed forwards run under the attention implementation `attention_for` picks; where it is not the model's own, the
model dispatches each call by its own arguments (`packed_attention`), so that a layer recomputed by gradient
checkpointing attends as its forward did, and every other forward (generation, padded ones) keeps the model's own.
Not packed, trimmed instead (said once): multimodal inputs (not trimmed either), a MoE auxiliary loss (its balance
counts every position of the row), rows whose masks have holes. The trainer says its choice once at construction
and logs `padding_free/packed_fraction` and `padding_free/real_tokens` with its metrics.
"""

from __future__ import annotations

import contextlib

import torch

from . import packed_attention, regional_compile, settings, shared_prompts, zero_advantage
from .hidden_states import hidden_states_at_head
from .packing import PackedRows, Shapes, can_pack, pack, saved_tokens, targets
from .plan import Lengths

MODES = ("auto", "pack", "trim", False)
# Measured on an H200 (torch 2.11, Qwen2.5 shapes, long-tailed completion lengths, optimizer steps of 4 micro-batches
# with gradient checkpointing as train() runs; docs/performance.md), against GRPOTrainer's step: on compiled decoder
# layers, packing on varlen FlashAttention beat trimming at every size (0.5B 1.43x against 1.31x, 1.5B 2.05x against
# 1.45x); on eager layers packing paid from 7B (varlen 2.14x, FlexAttention 2.06x; trimmed rows at 1.5B 1.14x, at
# 0.5B 0.90x, where the eager step is bound by the host).
PACK_HIDDEN_SIZE = 2048
# Where varlen FlashAttention cannot run (torch < 2.9, fp32 attention, attention dropout): FlexAttention's packed step
# beat SDPA's at 7B (hidden size 3584), SDPA's beat it at 1.5B (1536), without checkpointing. FlashAttention, where
# the model already uses it, is kept.
FLEX_HIDDEN_SIZE = 2048
# A micro-batch packs only where its real tokens fill at most this share of its trimmed [B, prompt + completion]
# area: a packed row's attention covers every real token against every other (SDPA with the packed mask) or its
# diagonal blocks (FlexAttention), which costs more than the causal attention of a batch with little padding (7B,
# no padding: packed 0.70x GRPOTrainer's step with SDPA, 0.97x with FlexAttention; trimmed 1.01x).
PACK_BELOW = 0.9
# The real tokens of each of the two sequences the model check packs.
CHECK_TOKENS = 24


class PaddingFreeNotice(UserWarning):
    """Why CompiledGRPOTrainer trims rather than packs (or neither)."""


def check_options(mode, attention, bucket, share="auto") -> None:
    shared_prompts.check_mode(share)
    if mode not in MODES or isinstance(mode, (int, float)) and mode is not False:
        raise ValueError(f"padding_free: expected one of {MODES}, got {mode!r}")
    if attention is not None and not isinstance(attention, str):
        raise TypeError(
            f"packed_attention: expected 'auto', None or an attention implementation's name, got {attention!r}"
        )
    known = packed_attention.known_implementations()
    if attention not in (None, "auto", *known):
        raise ValueError(f"packed_attention: {attention!r} is none of 'auto', None, {', '.join(map(repr, known))}")
    if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1:
        raise ValueError(f"packed_bucket: expected a positive int (tokens), got {bucket!r}")


def configure(trainer, mode, attention, bucket: int, share="auto") -> None:
    """The trainer's padding-free settings: its mode, the attention its packed forwards run under, the bucket,
    whether the model can pack (None: not checked yet; "": it can; else why not), and whether packed rows share
    their prompts (`shared_prompts.configure`)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    device = trainer.accelerator.device
    in_16_bits = sixteen_bit(trainer, model)
    trainer.packed_attention = attention_for(attention, model, device, in_16_bits)
    compiled_varlen = trainer.packed_attention == packed_attention.VARLEN and trainer.compile_backbone
    hidden = model.config.get_text_config().hidden_size
    trainer.padding_free_mode = effective_mode(mode, hidden, device, compiled_varlen)
    trainer.packed_bucket = bucket
    # layers replayed as CUDA graphs, or run as one stack on static shapes, need the few shapes of fixed capacities
    trainer.packed_shapes = Shapes(bucket, fixed=trainer.compile_backbone in ("graphs", *regional_compile.STACKS))
    trainer.packing_refused = None
    if trainer.padding_free_mode == "pack":
        why_not = packed_attention.runs_on(trainer.packed_attention, device, in_16_bits)
        if why_not:
            raise ValueError(f"packed_attention={trainer.packed_attention!r}: {why_not}")
        if trainer.packed_attention is not None:
            packed_attention.install(transformers_model(model))
    shared_prompts.configure(trainer, share)
    say_once(trainer, chosen(trainer, mode, attention, model))


def chosen(trainer, mode, attention, model) -> str:
    """What the trainer's forwards run and why, in a sentence."""
    hidden, device = model.config.get_text_config().hidden_size, trainer.accelerator.device.type
    why = f"padding_free={mode!r}" + (f" on a {device} at hidden size {hidden}" if mode == "auto" else "")
    if trainer.padding_free_mode is False:
        return f"micro-batches run padded, as GRPOTrainer's ({why})"
    if trainer.padding_free_mode == "trim":
        return f"micro-batches are trimmed to their longest prompt and completion, not packed ({why})"
    own = packed_attention.own_implementation(model)
    runs = trainer.packed_attention or own
    how = "the model's own" if trainer.packed_attention is None else f"every other call keeps the model's own {own!r}"
    return (
        f"micro-batches are packed where it pays ({why}), their attention {runs!r} (packed_attention="
        f"{attention!r}: {how})"
    )


def sixteen_bit(trainer, model) -> bool:
    """Whether the model's attention runs in 16 bits: 16-bit weights, or bf16/fp16 autocast."""
    dtype = next(model.parameters()).dtype
    return dtype in (torch.bfloat16, torch.float16) or bool(trainer.args.bf16 or trainer.args.fp16)


def transformers_model(model):
    """The transformers model under a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def effective_mode(mode, hidden_size: int, device: torch.device, compiled_varlen: bool = False):
    """The mode a trainer runs: "auto" is "pack" on a GPU where packed forwards run varlen FlashAttention on compiled
    layers (`compiled_varlen`) or from hidden size `PACK_HIDDEN_SIZE`, else "trim"."""
    if mode != "auto":
        return mode
    return "pack" if device.type == "cuda" and (compiled_varlen or hidden_size >= PACK_HIDDEN_SIZE) else "trim"


def attention_for(choice: str | None, model, device: torch.device, sixteen_bit: bool = True) -> str | None:
    """The attention implementation packed forwards run under (None: the model's own). "auto": on a GPU, the model's
    FlashAttention where it uses one, else torch's varlen FlashAttention where it runs (`sixteen_bit` attention, no
    attention dropout), else FlexAttention from hidden size `FLEX_HIDDEN_SIZE` and SDPA below it; on the CPU the
    model's own."""
    own = packed_attention.own_implementation(model)
    if choice != "auto":
        return None if choice == own else choice
    if device.type != "cuda" or own is None or "flash" in own:
        return None
    config = model.config.get_text_config()
    dropout = getattr(config, "attention_dropout", 0.0) or 0.0
    if not dropout and packed_attention.varlen_unavailable(device, sixteen_bit) is None:
        return packed_attention.VARLEN
    return "flex_attention" if config.hidden_size >= FLEX_HIDDEN_SIZE else "sdpa"


def packs(trainer, check_forward, ids: torch.Tensor, lengths: Lengths) -> bool:
    """Whether this micro-batch runs packed: the trainer packs ("pack"), the model passed its checks (`check_model`, at
    the first call, on every rank alike), no MoE auxiliary loss, rows of one span each, padding enough to remove."""
    if trainer.padding_free_mode != "pack":
        return False
    if trainer.packing_refused is None:
        check_model(trainer, check_forward, ids, lengths)
    if trainer.aux_loss_enabled:
        say_once(trainer, "micro-batches are trimmed, not packed: the MoE auxiliary loss balances every position of "
                          "the model's row, padding included")  # fmt: skip
        return False
    if not can_pack(lengths):
        say_once(trainer, "a micro-batch is trimmed, not packed: a row's masks have a hole, or a row has no prompt")
        return False
    if trainer.packing_refused:
        return False
    groups = shared_prompts.groups_to_share(trainer, lengths)
    return padded_enough(
        lengths, saved_tokens(lengths, torch.arange(len(lengths.prompt)), groups) if groups is not None else 0
    )


def padded_enough(lengths: Lengths, shared: int = 0) -> bool:
    """Whether the tokens a packed row holds (the micro-batch's real tokens, less the `shared` prompt tokens it
    forwards once) fill at most `PACK_BELOW` of its trimmed area (else trimming serves)."""
    real = int(lengths.prompt.sum() + lengths.completion.sum()) - shared
    area = len(lengths.prompt) * (int(lengths.prompt.max()) + int(lengths.completion.max()))
    return real <= PACK_BELOW * area


def packed_forward(forward, ids: torch.Tensor, lengths: Lengths, plan, shapes, groups=None):
    """(final hidden states [N, H] of every packed row the loss reads, the trained rows' model outputs, the loss
    rows' targets in them): the rows with a gradient packed and forwarded with grad, those without (under the row
    plan) packed and forwarded without, their hidden states joined; rows of one of `groups` (host [B], None: none)
    in one forward share their prompt. (None, None, None) when nothing runs."""
    rows = torch.arange(len(lengths.prompt))
    trained, untrained = (rows, None) if plan is None else plan.rows
    parts, starts, outputs = [], torch.zeros(len(rows), dtype=torch.long), None
    if trained.numel():
        packed = pack(ids, lengths, trained, shapes, groups)
        hidden, outputs = forward(packed)
        parts.append(hidden)
        starts[trained] = packed.starts
    if untrained is not None and untrained.numel():
        with torch.no_grad():
            packed = pack(ids, lengths, untrained, shapes, groups)
            hidden, _ = forward(packed)
        if not plan.stand_in:  # a stand-in forward only keeps step with the other ranks
            starts[untrained] = packed.starts + sum(p.shape[0] for p in parts)
            parts.append(hidden if not parts else hidden.to(parts[0].dtype))
    if not parts:
        return None, None, None
    loss_rows = trained if plan is not None and plan.sliced else rows
    width = lengths.masks[1].shape[1]
    hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
    return hidden, outputs, targets(lengths, loss_rows, starts[loss_rows], width, hidden.device)


def check_model(trainer, forward, ids: torch.Tensor, lengths: Lengths) -> None:
    """Whether the model keeps packed sequences apart (`packing_fails`) and obeys a shared prompt's mask, said where
    not; on its eager layers, where compiled ones compiled no-grad graphs for them alone (30-40 s each on a stack)."""
    with regional_compile.eager_layers(trainer):
        trainer.packing_refused = packing_fails(forward, ids, lengths, trainer.packed_shapes) or ""
        if trainer.packing_refused:
            say_once(trainer, f"{trainer.packing_refused}; micro-batches are trimmed instead of packed")
        elif trainer.share_prompts and shared_prompts.check(trainer, forward, ids, lengths):
            say_once(trainer, f"{trainer.sharing_refused}; micro-batches are packed without sharing their prompts")


def packing_fails(forward, ids: torch.Tensor, lengths: Lengths, shapes=1) -> str | None:
    """Why this model cannot be packed (None: it can): two sequences (the first `CHECK_TOKENS` real tokens of the
    micro-batch's first two rows, or of its one row twice) packed, against each forwarded alone, no grad."""
    rows = torch.tensor([0, min(1, len(lengths.prompt) - 1)])
    prompt = lengths.prompt[rows].clamp(max=CHECK_TOKENS // 2)
    short = lengths._replace(prompt=lengths.prompt.clone(), completion=lengths.completion.clone())
    short.prompt[rows] = prompt
    short.completion[rows] = lengths.completion[rows].clamp(max=CHECK_TOKENS - prompt)
    spans = (short.prompt[rows] + short.completion[rows]).tolist()
    with torch.no_grad():
        both = forward(pack(ids, short, rows, shapes))[0][: sum(spans)]
        alone = [forward(pack(ids, short, rows[i : i + 1], shapes))[0][: spans[i]] for i in range(2)]
    joined = torch.cat(alone).float()
    error = float((both.float() - joined).norm() / joined.norm().clamp(min=1e-30))
    bound = 1e-4 if both.dtype in (torch.float32, torch.float64) else 3e-2
    if error <= bound:
        return None
    return (f"two packed sequences differ from each forwarded alone (relative error {error:.2e} > {bound:.0e}): the "
            "model does not keep packed sequences apart (its attention ignores the positions' restarts)")  # fmt: skip


def packed_ids_forward(model, lm_head, attention: str | None, stack=None):
    """forward(PackedRows) -> (final hidden states [N, H], the model's outputs), the head projecting one position;
    its layers attend with `attention` (None: the model's own), by the forward's own arguments (`packed_attention`),
    run as a few compiled calls where `stack` (`compiled_stack.Stack`) is given."""

    config = transformers_config(model)
    layers = stack.running if stack is not None else contextlib.nullcontext

    def forward(packed: PackedRows):
        inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
                  **packed_attention.forward_kwargs(attention, packed, config)}  # fmt: skip
        with packed_attention.packed_masks(attention), layers():
            hidden, outputs = hidden_states_at_head(model, lm_head, inputs)
        return hidden[0], outputs

    return forward


def transformers_config(model):
    """The transformers config of a model, of the model a wrapper holds (DDP's `module`; a DeepSpeed engine's own
    `config` is its settings), or None."""
    for candidate in (model, getattr(model, "module", None)):
        config = getattr(candidate, "config", None)
        if hasattr(config, "get_text_config"):
            return config
    return None


def say_once(trainer, message: str) -> None:
    zero_advantage.say_once(trainer, message, PaddingFreeNotice)


def forward(trainer, model, padded, model_inputs: dict, lengths: Lengths | None, plan):
    """(final hidden states, the model's outputs, the loss rows' packed targets or None): packed where the
    micro-batch can be (`packs`), else `padded(rows)` on its rows as given (trimmed where
    `lengths` is known), split by the row plan."""
    lm_head = settings.unwrapped(trainer, model).get_output_embeddings()
    stack = regional_compile.stack_of(trainer, model)
    rows_forward = packed_ids_forward(model, lm_head, trainer.packed_attention, stack)
    ids = model_inputs["input_ids"]
    check_forward = rows_forward if stack is None else packed_ids_forward(model, lm_head, trainer.packed_attention)
    packed = lengths is not None and packs(trainer, check_forward, ids, lengths)
    if lengths is not None and model.training:
        log_real_tokens(trainer, lengths, packed)
    if packed:
        groups = shared_prompts.groups_to_share(trainer, lengths)
        if model.training:
            log_saved_tokens(trainer, lengths, plan, groups)
        return packed_forward(rows_forward, ids, lengths, plan, trainer.packed_shapes, groups)
    return (*zero_advantage.split_forward(padded, model_inputs, plan), None)


def log_real_tokens(trainer, lengths: Lengths, packed: bool) -> None:
    """This rank's micro-batch among the trainer's metrics (averaged over a logging period, as TRL's): whether it was
    packed (the share of packed micro-batches) and its real prompt and completion tokens, known on the host."""
    metrics = trainer._metrics["train"]
    metrics["padding_free/packed_fraction"].append(float(packed))
    metrics["padding_free/real_tokens"].append(float(lengths.prompt.sum() + lengths.completion.sum()))


def log_saved_tokens(trainer, lengths: Lengths, plan, groups) -> None:
    """Where the trainer shares prompts, the prompt tokens this packed micro-batch's forwards do not forward again
    (`shared_prompts/saved_tokens`, averaged over a logging period)."""
    if not trainer.share_prompts:
        return
    rows = [torch.arange(len(lengths.prompt))] if plan is None else [r for r in plan.rows if r is not None]
    saved = sum(saved_tokens(lengths, r, groups) for r in rows) if groups is not None else 0
    trainer._metrics["train"]["shared_prompts/saved_tokens"].append(float(saved))
