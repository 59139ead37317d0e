"""The micro-batches `benchmarks.trl_step` times: each kind's prompts, completions, lengths and advantages, built
from seeded generators (random token ids; the same batch for every row of a run)."""

from __future__ import annotations

import torch

# kind: (top_entropy_quantile, groups at advantage 0 of every four)
BATCHES = {"dense": (1.0, 0), "q0.2": (0.2, 0), "half0": (1.0, 2), "zero75": (1.0, 3), "both": (0.2, 2),
           "varied": (1.0, 0), "tail": (1.0, 0), "tail-half0": (1.0, 2), "longprompt": (1.0, 0)}  # fmt: skip
# `longprompt` rows: groups of LONG_GROUP completions of one LONG_PROMPT-token prompt, `tail` completion lengths of at
# most LONG_COMPLETION tokens (long system prompts, tool outputs: where a group's shared prompt is most of its tokens)
LONG_PROMPT, LONG_COMPLETION, LONG_GROUP = 512, 256, 8
# `tail` completion lengths: lognormal, median TAIL_MEDIAN x the completion length, sigma TAIL_SIGMA, clipped to
# [TAIL_SHORTEST, completion length]; the batch's first row truncated at the completion length (so GRPOTrainer pads
# every micro-batch to it)
TAIL_MEDIAN, TAIL_SIGMA, TAIL_SHORTEST = 0.3, 0.6, 32
TAIL_NOTE = (
    f" `tail` rows: completion lengths lognormal (median {TAIL_MEDIAN} x the completion length, sigma {TAIL_SIGMA}, "
    f"clipped to [{TAIL_SHORTEST}, the completion length]), one truncated at the completion length, so GRPOTrainer "
    "pads every micro-batch to it (`tail-half0`: half the groups at advantage 0); the bound is the backbone on that "
    "padding."
)
LONG_NOTE = (
    f" `longprompt` rows: groups of {LONG_GROUP} completions of one {LONG_PROMPT}-token prompt, completion lengths as "
    f"`tail`'s of at most {LONG_COMPLETION} tokens; `noshare`: the default with `share_prompts=False`."
)
VARIED_LONGEST = (1.0, 0.8, 0.6, 0.9)  # the `varied` micro-batches' longest completions, of the completion length


def zero_groups(B: int, zeros: int, group: int) -> torch.Tensor:
    """Which of B rows are at advantage 0: `zeros` of every four groups of `group` rows (the first ones)."""
    return (torch.arange(B) // group) % 4 < zeros if zeros != 2 else (torch.arange(B) // group) % 2 == 0


def micro_batch(vocab: int, device, B: int, zeros: int, P=64, C=1024, seed=0, group=None) -> dict:
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randn(B, generator=g)
    if zeros:  # groups of 4; three of four groups on one micro-batch of 8 need groups of 2
        group = group or (4 if zeros == 2 else max(B // 4, 1))
        advantages = torch.where(zero_groups(B, zeros, group), 0.0, advantages)
    inputs = {
        "prompt_ids": torch.randint(3, vocab, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (B, C), generator=g),
        "completion_mask": torch.ones(B, C, dtype=torch.long),
        "advantages": advantages,
    }
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()
    return {k: v.to(device) for k, v in inputs.items()}


def tail_lengths(n: int, C: int, seed: int = 0) -> torch.Tensor:
    """`n` completion lengths of the `tail` kinds (the first at C: a truncated completion)."""
    g = torch.Generator().manual_seed(seed)
    lengths = (TAIL_MEDIAN * C * torch.exp(TAIL_SIGMA * torch.randn(n, generator=g))).clamp(min(TAIL_SHORTEST, C), C)
    lengths = lengths.long()
    lengths[0] = C
    return lengths


def with_tail(inputs: dict, seed: int = 0) -> dict:
    """`inputs` with `tail_lengths` completions (right-padded masks)."""
    B, C = inputs["completion_ids"].shape
    lengths = tail_lengths(B, C, seed).to(inputs["completion_mask"].device)
    mask = (torch.arange(C, device=lengths.device) < lengths[:, None]).long()
    return {**inputs, "completion_mask": mask, "num_items_in_batch": mask.sum().float()}


def with_shared_prompts(inputs: dict, group: int) -> dict:
    """`inputs` whose consecutive rows in groups of `group` have their group's first prompt (as TRL's generation
    batch has them, before it shuffles the rows)."""
    first = torch.arange(len(inputs["prompt_ids"]), device=inputs["prompt_ids"].device) // group * group
    return {**inputs, "prompt_ids": inputs["prompt_ids"][first]}


def long_prompt_batch(vocab: int, device, B: int) -> dict:
    """B rows of the `longprompt` kind (`LONG_PROMPT`, `LONG_COMPLETION`, `LONG_GROUP`)."""
    inputs = with_tail(micro_batch(vocab, device, B, 0, P=LONG_PROMPT, C=LONG_COMPLETION))
    return with_shared_prompts(inputs, LONG_GROUP)


def real_tokens(inputs: dict) -> int:
    return int(inputs["prompt_mask"].sum() + inputs["completion_mask"].sum())


def micro_batches(vocab: int, device, B: int, kind: str, C=1024) -> list[dict]:
    """The micro-batches a step of `kind` cycles through: one, or for `varied` one per `VARIED_LONGEST`, each row's
    completion a random length between half the batch's longest and it (one row at the longest)."""
    _, zeros = BATCHES[kind]
    if kind == "longprompt":
        return [long_prompt_batch(vocab, device, B)]
    if kind.startswith("tail"):
        return [with_tail(micro_batch(vocab, device, B, zeros, C=C))]
    if kind != "varied":
        return [micro_batch(vocab, device, B, zeros, C=C)]
    batches = []
    for i, fraction in enumerate(VARIED_LONGEST):
        longest = int(C * fraction)
        inputs = micro_batch(vocab, device, B, zeros, C=longest, seed=i)
        g = torch.Generator().manual_seed(100 + i)
        lengths = torch.randint(longest // 2, longest + 1, (B,), generator=g)
        lengths[0] = longest
        mask = (torch.arange(longest) < lengths[:, None]).long().to(device)
        inputs["completion_mask"], inputs["num_items_in_batch"] = mask, mask.sum().float()
        batches.append(inputs)
    return batches
