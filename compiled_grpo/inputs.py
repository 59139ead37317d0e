"""The tensors of one call, as one record."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from . import products

HEAD_TENSORS = ("hidden", "weight", "bias", "ref_hidden", "ref_weight", "ref_bias")
PER_TOKEN = ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps")
CONSTANT_INPUTS = ("advantages", *PER_TOKEN, "importance_sampling_ratio")


@dataclass(frozen=True)
class LossInputs:
    hidden: torch.Tensor  # [B, T, H]: the states that predict completion_ids (already shifted)
    weight: torch.Tensor  # [V, H]: the lm_head (this rank's rows of it when vocabulary-parallel)
    completion_ids: torch.Tensor  # [B, T] integer
    completion_mask: torch.Tensor  # [B, T] 0/1
    advantages: torch.Tensor  # [B] or [B, T]
    bias: torch.Tensor | None = None  # [V]
    old_per_token_logps: torch.Tensor | None = None  # [B, T]
    ref_per_token_logps: torch.Tensor | None = None  # [B, T]
    sampling_per_token_logps: torch.Tensor | None = None  # [B, T], NaN for tokens vLLM could not score
    importance_sampling_ratio: torch.Tensor | None = None  # [B, T], [B, 1] or [B]
    ref_hidden: torch.Tensor | None = None  # [B, T, H]: a reference model's states, for ref log-probs
    ref_weight: torch.Tensor | None = None  # [V, H]: a separate reference lm_head
    ref_bias: torch.Tensor | None = None  # [V]
    # Packed calls (`packing.Packing`): hidden and ref_hidden are [rows, H] and this is the hidden row of each of
    # the B * T positions; None: hidden is [B, T, H].
    hidden_rows: torch.Tensor | None = None
    # the policy's and the reference's head products from the float32 weight's bf16 terms (`widened`)
    split_head: bool = False
    split_ref_head: bool = False

    @property
    def packed(self) -> bool:
        return self.hidden_rows is not None

    def per_token(self) -> dict[str, torch.Tensor | None]:
        return {name: getattr(self, name) for name in PER_TOKEN}

    def unpacked(self, packing) -> LossInputs:
        """A packed call's inputs in the padded layout of `packing` ([M] -> [S, T]; [S] inputs and the hidden
        states stay as they are)."""
        lay_out = lambda t, fill: t if t is None or t.shape[0] != packing.position.numel() else packing.unpack(t, fill)
        sequences = packing.sequences
        per_target = {
            "completion_ids": lay_out(self.completion_ids, 0),
            "completion_mask": lay_out(self.completion_mask, 0),
            "advantages": self.advantages if self.advantages.shape[0] == sequences else lay_out(self.advantages, 0),
            **{name: lay_out(getattr(self, name), 0) for name in PER_TOKEN},
        }
        ratio = self.importance_sampling_ratio
        if ratio is not None and ratio.shape[0] != sequences:
            per_target["importance_sampling_ratio"] = lay_out(ratio, 1)
        if packing.identity:  # the padded batch itself: hidden states as a [S, T, H] view
            as_padded = lambda h: None if h is None else h.view(sequences, packing.length, h.shape[-1])
            return dataclasses.replace(self, **per_target, hidden=as_padded(self.hidden),
                                       ref_hidden=as_padded(self.ref_hidden))  # fmt: skip
        return dataclasses.replace(self, **per_target, hidden_rows=packing.rows)

    def with_row_advantages(self) -> LossInputs:
        """[B, 1] advantages (TRL's layout) as [B], the same values per sequence; T = 1 keeps them per token."""
        adv = self.advantages
        if self.packed or adv.dim() != 2 or adv.shape[1] != 1 or self.completion_mask.shape[1] == 1:
            return self
        return dataclasses.replace(self, advantages=adv.reshape(-1))

    def with_constants_detached(self) -> LossInputs:
        """The advantages, the old, reference and sampling log-probs and the IS ratio detached: the loss treats them
        as constants on every schedule, as TRL does (it computes them without gradient). A tensor that carries a
        graph (old log-probs computed outside no_grad, say) would otherwise send gradient back through it."""
        detach = lambda t: t.detach() if isinstance(t, torch.Tensor) else t
        return dataclasses.replace(self, **{name: detach(getattr(self, name)) for name in CONSTANT_INPUTS})

    def cast_head(self, convert) -> LossInputs:
        """The same inputs with `convert` applied to the lm_head's tensors (hidden states, weights, biases)."""
        return dataclasses.replace(self, **{name: convert(getattr(self, name)) for name in HEAD_TENSORS})

    def under_autocast(self) -> LossInputs:
        """Under autocast, the lm_head's floating tensors in the autocast dtype (as TRL's fused head computes):
        fp32 master weights get 16-bit GEMMs, and their gradients come back in fp32 through the cast."""
        device_type = self.hidden.device.type if isinstance(self.hidden, torch.Tensor) else "cpu"
        if not torch.is_autocast_enabled(device_type):
            return self
        dtype = torch.get_autocast_dtype(device_type)
        return self.cast_head(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t)

    def widened(self) -> LossInputs:
        """16-bit hidden states against a float32 lm_head weight (an fp32 head, as `cast_lm_head_to_fp32` makes it)
        widened to float32, exactly: the head is then a float32 one throughout, and their gradient comes back in
        their dtype through the cast. Where `products.splits`, its GEMMs come from the weight's bf16 terms."""
        ref_weight = self.weight if self.ref_weight is None else self.ref_weight
        ref_hidden = self.hidden if self.ref_hidden is None else self.ref_hidden
        split, split_ref = products.splits(self.hidden, self.weight), products.splits(ref_hidden, ref_weight)
        return dataclasses.replace(self, hidden=products.widened(self.hidden, self.weight),
                                   ref_hidden=products.widened(self.ref_hidden, ref_weight), split_head=split,
                                   split_ref_head=split_ref)  # fmt: skip
