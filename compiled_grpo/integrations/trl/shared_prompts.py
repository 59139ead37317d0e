"""A GRPO group's prompt forwarded once: the completions of one prompt that a packed forward holds share it.

GRPO samples each prompt `num_generations` times, and a packed micro-batch would forward the same prompt once per
completion. Where two or more of its rows have the same real prompt (`plan.prompt_groups`), the packed row holds
that prompt once but its last token, then each row's last prompt token and completion (`packing.segments`),
positions continuing from the prompt's; each such segment attends to the shared tokens and causally to itself, never
to a sibling. A causal layer's hidden state at a position depends only on the tokens before it, so every hidden
state the loss reads is the one the row has alone (to rounding: the attention's sums run in another order), and the
prompt's gradient is the sum of what each completion sends back through it. A group of k rows with a prompt of p
tokens then forwards p - 1 + k of its k p prompt tokens.

The attention of a shared row: torch's varlen FlashAttention with each segment's keys gathered (its shared prompt's,
then its own: `packed_attention.varlen_attention`), or a mask of the segments' rule for SDPA, eager attention and
FlexAttention (`shared_masks`), passed with the forward's arguments in the form the model takes a ready-made mask,
so that a checkpointed layer's recomputation attends as its forward did. Other implementations (the model's own
FlashAttention, which finds the sequences from the positions) do not share. At the first packed micro-batch two
completions of one prompt packed sharing it are checked against the same rows packed apart (`sharing_fails`); a
model that fails (its layers build their own masks, or ignore the positions) is packed unshared from then on, said
once. `share_prompts="auto"` (the default) shares wherever micro-batches are packed; True is a ValueError where they
are not packed or their attention cannot share; False never shares. The trainer logs `shared_prompts/saved_tokens`
(the prompt tokens a micro-batch did not forward again) with its metrics.
"""

from __future__ import annotations

import torch

from . import packed_attention, shared_masks
from .packing import pack, targets
from .plan import Lengths

MODES = ("auto", True, False)
# The tokens of the prompt and of each of the two completions the check packs.
CHECK_TOKENS = 12


def check_mode(mode) -> None:
    if not (mode is True or mode is False or mode == "auto"):
        raise ValueError(f"share_prompts: expected 'auto', True or False, got {mode!r}")


def configure(trainer, mode) -> None:
    """The trainer's sharing: on where its micro-batches are packed and their attention can share (`why_not`);
    `sharing_refused` None until the first shared micro-batch is checked, "" where it passed."""
    check_mode(mode)
    trainer.share_prompts, trainer.sharing_refused = False, None
    if mode is True and trainer.padding_free_mode != "pack":
        raise ValueError(f"share_prompts=True: micro-batches are not packed here (padding_free resolved to "
                         f"{trainer.padding_free_mode!r}); pass padding_free='pack'")  # fmt: skip
    if mode is False or trainer.padding_free_mode != "pack":
        return
    config = trainer.accelerator.unwrap_model(trainer.model).config
    why = why_not(trainer.packed_attention or packed_attention.own_implementation_of(config))
    if why is None:
        trainer.share_prompts = True
    elif mode is True:
        raise ValueError(f"share_prompts=True: {why}")


def why_not(attention: str) -> str | None:
    """Why packed forwards under `attention` cannot share prompts (None: they can)."""
    if attention == packed_attention.VARLEN or attention in shared_masks.MASKED:
        return None
    return (f"packed forwards run {attention!r}, which finds the packed sequences from their positions and has no "
            "way to let a completion see a shared prompt (packed_attention='varlen', 'sdpa', 'eager' or "
            "'flex_attention' can)")  # fmt: skip


def check_batch(ids: torch.Tensor) -> tuple[torch.Tensor, Lengths]:
    """Two completions of one prompt, `CHECK_TOKENS` tokens each part, of the micro-batch's token ids scrambled (any
    ids of the model's vocabulary serve; the two completions differ where it holds two ids): their [2, prompt +
    completion] ids and lengths, the two rows one group."""
    n, tokens = CHECK_TOKENS, torch.unique(ids)
    source = tokens[torch.arange(3 * n, device=ids.device) * 7919 % len(tokens)]
    prompt, first, second = source[:n], source[n : 2 * n], source[2 * n :]
    both = torch.stack([torch.cat([prompt, first]), torch.cat([prompt, second])])
    ones = torch.ones(2, n, dtype=torch.long, device=ids.device)
    full = torch.tensor([n, n])
    return both, Lengths(full, full, True, (ones, ones), (), torch.tensor([0, 0]))


def sharing_fails(forward, ids: torch.Tensor, shapes) -> str | None:
    """Why this model cannot share prompts (None: it can): two completions of one prompt (`check_batch`) packed
    sharing it, against the same rows packed apart, no grad, at every position that predicts a completion token.
    The same check whatever the micro-batch holds, so every rank runs the same forwards."""
    both, lengths = check_batch(ids)
    rows = torch.arange(2)
    found = []
    with torch.no_grad():
        for grouped in (lengths.groups, None):
            packed = pack(both, lengths, rows, shapes, grouped)
            hidden = forward(packed)[0]
            found.append(hidden[targets(lengths, rows, packed.starts, CHECK_TOKENS, hidden.device).row_index])
    shared, apart = (hidden.float() for hidden in found)
    error = float((shared - apart).norm() / apart.norm().clamp(min=1e-30))
    bound = 3e-2 if computed_in_16_bits(found[0]) else 1e-4
    if error <= bound:
        return None
    return (f"two completions sharing their prompt differ from the same rows packed apart (relative error "
            f"{error:.2e} > {bound:.0e}): the model does not attend by the mask passed to it")  # fmt: skip


def computed_in_16_bits(hidden: torch.Tensor) -> bool:
    """Whether the forward that gave `hidden` computed in 16 bits: 16-bit hidden states, or float32 ones of a model
    run under bf16/fp16 autocast (its matmuls in 16 bits, so two packings differ by 16-bit rounding)."""
    kind, half = hidden.device.type, (torch.float16, torch.bfloat16)
    return hidden.dtype in half or (torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) in half)


def check(trainer, forward, ids: torch.Tensor, lengths: Lengths) -> str:
    """At the trainer's first packed micro-batch (on every rank alike): why its prompts are not shared ("": they
    are), said once."""
    if trainer.sharing_refused is None:
        try:
            trainer.sharing_refused = sharing_fails(forward, ids, trainer.packed_shapes) or ""
        except Exception as error:  # noqa: BLE001 - a probe: a model that cannot take the masks fails here, said
            said = " ".join(str(error).split())[:400]  # on one line: dynamo's first names only the kind of failure
            trainer.sharing_refused = f"a forward sharing a prompt failed ({type(error).__name__}: {said})"
    return trainer.sharing_refused


def groups_to_share(trainer, lengths: Lengths) -> torch.Tensor | None:
    """The micro-batch's groups (host [B]) where it shares its prompts: the trainer shares, its check passed, and
    two of its rows have the same prompt; else None."""
    found = lengths.groups
    if not trainer.share_prompts or trainer.sharing_refused != "" or found is None:
        return None
    return found if len(found.unique()) < len(found) else None
