"""The lm_head as the tiles see it, and where this rank's vocabulary slice sits.

`Head` is a NamedTuple of tensors (plus the softcap flag): torch.compile traces its fields like separate
arguments, and since the scale, temperature and cap travel as one small tensor, new values never recompile a
tile. Only the presence of a bias and of a softcap shape the graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import distributed, products

SCALE, INV_TEMP, CAP = 0, 1, 2  # positions in `Head.values`


class Head(NamedTuple):
    weight: torch.Tensor  # [V, H] (a vocabulary slice of it, inside a tile loop)
    bias: torch.Tensor | None  # [V]
    values: torch.Tensor  # [logit_scale, 1 / temperature, softcap], in the statistics dtype
    softcap: bool  # whether the model caps its logits (Gemma's final_logit_softcapping)
    # [slots] 1 / temperature of each row, in place of values[INV_TEMP] (a per-token or per-sequence temperature
    # of `fused_linear_logprobs`); None: one temperature for every row
    row_inv_temp: torch.Tensor | None = None
    # the GEMM's product rounded to the inputs' dtype before the softmax (`round_logits`: TRL's head and plain torch
    # do so), read at 2 bytes per logit instead of 4; False: float32, the default
    rounded: bool = False
    # the float32 weight's bf16 terms side by side, [V, terms x H] (`products.weight_terms`), read by the GEMMs in
    # its place; None: the weight's own GEMMs, or, with `split`, terms made per vocabulary slice (`vocab_slice`)
    terms: torch.Tensor | None = None
    # products from the float32 weight's bf16 terms (`products.splits`): held whole in `terms` for the passes over
    # the whole vocabulary (`with_whole_terms`), or made slice by slice by the vocabulary-outer passes, which then
    # hold one slice's terms instead of the whole weight's (3 bf16 copies of it)
    split: bool = False

    def rows(self, start: int, size: int) -> Head:
        """The head as slots start..start + size see it (their per-row temperatures)."""
        if self.row_inv_temp is None:
            return self
        return self._replace(row_inv_temp=self.row_inv_temp[start : start + size])

    def vocab_slice(self, start: int, size: int) -> Head:
        """The head of vocabulary rows start..start + size (a split head's terms: the whole terms' rows, or the
        slice's own, made here)."""
        bias = None if self.bias is None else self.bias[start : start + size]
        weight = self.weight[start : start + size]
        terms = None if self.terms is None else self.terms[start : start + size]
        if self.split and terms is None:
            terms = products.weight_terms(weight)
        return self._replace(weight=weight, bias=bias, terms=terms)

    @property
    def sliced_terms(self) -> bool:
        """A split head whose terms are made per vocabulary slice (none held whole)."""
        return self.split and self.terms is None

    def with_whole_terms(self) -> Head:
        """The head with the whole weight's terms held (for the passes over the whole vocabulary per token tile)."""
        return self._replace(terms=products.weight_terms(self.weight)) if self.sliced_terms else self

    def with_fresh_terms(self) -> Head:
        """The head with its weight's whole terms made anew from the weight (a captured pass makes them inside its
        graph, so that a replay reads the weight as it is then; terms made per slice are made there already)."""
        return self if self.terms is None else self._replace(terms=products.weight_terms(self.weight))

    def detached(self) -> Head:
        bias = None if self.bias is None else self.bias.detach()
        return self._replace(weight=self.weight.detach(), bias=bias)


def make_head(weight, bias, cfg, dtype, rounded: bool = False, split: bool = False) -> Head:
    """The head of a loss config (logit_scale, temperature, final_logit_softcapping); `split`: its products from
    the float32 weight's bf16 terms (`products.splits`), made per vocabulary slice until a pass over the whole
    vocabulary asks for them whole (`Head.with_whole_terms`)."""
    cap = cfg.final_logit_softcapping
    values = device_constant((cfg.logit_scale, 1.0 / cfg.temperature, cap or 1.0), dtype, weight.device)
    return Head(weight, bias, values, cap is not None, rounded=rounded, split=split)


@functools.cache
def device_constant(values: tuple, dtype, device) -> torch.Tensor:
    """A small constant tensor, made once: each host-to-device copy waits for every kernel queued before it."""
    return torch.tensor(values, dtype=dtype, device=torch.device(device))


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocabulary-parallel lm_head: rows start..start + V_local of the full vocabulary,
    the other slices on the ranks of `group` (distributed.LOCAL: the whole vocabulary is here)."""

    group: object = distributed.LOCAL
    start: int = 0

    @property
    def parallel(self) -> bool:
        return self.group is not distributed.LOCAL
