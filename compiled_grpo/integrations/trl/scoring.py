"""The old and reference log-probs (TRL's `_get_per_token_logps_and_entropies`) on real tokens only: each chunk of
rows TRL scores together packed into one row, or the batch trimmed to its longest prompt and completion, and the
log-probs put back in TRL's [B, logits_to_keep] layout (0 where no completion token is, as TRL's fused head
leaves them). TRL's own forward scores them (`fused_lm_head=True`, its `shift_labels` naming the token each packed
position predicts), so its temperature, fp32 head and this library's kernels apply as they do unpacked. Entropies,
a MoE auxiliary loss and multimodal inputs go to TRL's method as they are.
"""

from __future__ import annotations

import torch

from . import packed_attention, padding_free, settings, shared_prompts
from .packing import pack, targets
from .plan import Lengths, lengths_of, real_spans


def per_token_logps(trainer, padded, model, input_ids, attention_mask, logits_to_keep, *, batch_size=None,
                    compute_entropy=False, compute_aux_loss=False, **extra):  # fmt: skip
    """TRL's (log-probs, entropies, aux loss) of `padded` (its own method), on the real tokens where it may."""
    as_given = trainer.padding_free_mode is False or compute_entropy or compute_aux_loss
    if as_given or any(value is not None for value in extra.values()):
        return padded(model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size,
                      compute_entropy=compute_entropy, compute_aux_loss=compute_aux_loss, **extra)  # fmt: skip
    P = input_ids.shape[1] - logits_to_keep
    masks = (attention_mask[:, :P], attention_mask[:, P:])
    spans = real_spans({"prompt_ids": input_ids[:, :P], "prompt_mask": masks[0], "completion_mask": masks[1]})
    lengths = lengths_of(spans.cpu(), masks)
    lm_head = settings.unwrapped(trainer, model).get_output_embeddings()
    forward = padding_free.packed_ids_forward(model, lm_head, trainer.packed_attention)
    if padding_free.packs(trainer, forward, input_ids, lengths):
        return packed_logps(trainer, model, input_ids, lengths, batch_size), None, None
    keep_p, keep_c = int(lengths.prompt.max()), max(int(lengths.completion.max()), 1)
    columns = slice(P - keep_p, P + keep_c)
    logps, _, _ = padded(model, input_ids[:, columns], attention_mask[:, columns], keep_c, batch_size=batch_size)
    return torch.nn.functional.pad(logps, (0, logits_to_keep - keep_c)), None, None


def packed_logps(trainer, model, input_ids, lengths: Lengths, batch_size: int | None) -> torch.Tensor:
    """[B, C] log-probs of the completion tokens, each chunk of `batch_size` rows scored as one packed row."""
    B, C = input_ids.shape[0], lengths.masks[1].shape[1]
    completions = input_ids[:, input_ids.shape[1] - C :]
    chunks = []
    for start in range(0, B, batch_size or B):
        rows = torch.arange(start, min(start + (batch_size or B), B))
        packed = pack(input_ids, lengths, rows, trainer.packed_shapes, shared_prompts.groups_to_share(trainer, lengths))
        t = targets(lengths, rows, packed.starts, C, input_ids.device)
        labels = torch.full_like(packed.input_ids, -100)
        labels[0, t.row_index] = completions[rows[0] : rows[-1] + 1].reshape(-1).index_select(0, t.flat)
        attention = trainer.packed_attention
        kwargs = packed_attention.forward_kwargs(attention, packed, settings.unwrapped(trainer, model).config)
        with trainer.accelerator.autocast(), packed_attention.packed_masks(attention):
            out = model(input_ids=packed.input_ids, position_ids=packed.position_ids, shift_labels=labels,
                        fused_lm_head=True, **kwargs)  # fmt: skip
        chunk = out.log_probs.new_zeros(len(rows) * C).index_put((t.flat,), out.log_probs[0, t.row_index])
        chunks.append(chunk.view(len(rows), C))
    return torch.cat(chunks)
