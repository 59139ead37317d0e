"""verl's fused-kernel path on this library's primitive, `fused_linear_logprobs`.

With `actor_rollout_ref.model.use_fused_kernels=True`, verl swaps the model's forward for
`forward_with_triton_backend` or `forward_with_torch_backend` (dense models and the qwen2_vl, qwen3_vl, glm4v and
qwen3_5 variants alike). Each looks up, on every call, `verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`
(triton backend) or `verl.utils.experimental.torch_functional.FusedLinearForPPO` (torch backend) and gets
`(log_probs, entropy)` of the rolled labels (or of `shift_labels`) at every position of the (usually
padding-removed) batch. `install()` replaces both names with the functions below, so either backend runs on
`fused_linear_logprobs`: statistics in the forward, and a backward that recomputes logits only for the positions
whose upstream gradients are not both 0 (prompt tokens, zero-advantage groups) and forms no entropy term when
the entropy has no gradient (verl's default `entropy_coeff = 0`). The policy loss, its aggregation, the entropy
bonus and the KL stay verl's.

In a verl run the patch must reach every worker process; any one of:
- `actor_rollout_ref.model.external_lib=compiled_grpo.integrations.verl_kernels` (verl imports that module in
  each worker when it builds the model config; importing it calls `install()`);
- the environment variable `VERL_USE_EXTERNAL_MODULES=compiled_grpo.integrations.verl_kernels`, which every
  process that imports verl honours;
- `install()` in code that runs in each worker before the first forward.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from ..logprobs import fused_linear_logprobs


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None, *,
                         compiled: bool = True):  # fmt: skip
    """verl's `linear_cross_entropy` signature and outputs: (log_probs, entropy), each flat [num_tokens] float32
    (reduction "none"; "sum" and "mean" reduce both). `temperature` may also be a tensor broadcastable to
    `labels` (a per-sample temperature expanded to its tokens). `dist_process_group`: a vocabulary-parallel
    lm_head, each rank holding an equal slice of `weight`'s rows in rank order."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'none', 'sum' or 'mean', got {reduction!r}")
    vocab = {}
    if dist_process_group is not None:
        rank = torch.distributed.get_rank(dist_process_group)
        vocab = {"vocab_parallel_group": dist_process_group, "vocab_start": rank * weight.shape[0]}
    if isinstance(temperature, torch.Tensor) and temperature.dim() > 0:
        temperature = temperature.broadcast_to(labels.shape)
    logp, entropy = fused_linear_logprobs(hidden, weight, labels.long(), temperature=temperature,
                                          compiled=compiled, **vocab)  # fmt: skip
    logp, entropy = logp.reshape(-1), entropy.reshape(-1)
    if reduction == "sum":
        return logp.sum(), entropy.sum()
    if reduction == "mean":
        return logp.mean(), entropy.mean()
    return logp, entropy


class FusedLinearForPPO(torch.nn.Module):
    """verl's torch-backend module: `forward(hidden_states, vocab_weights, input_ids, temperature)` returns
    (log_probs, entropy) shaped like `input_ids`, float32."""

    compiled = True

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        self.chunk_size, self.impl_backend = chunk_size, impl_backend  # kept for verl's callers; unused here

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        logp, entropy = fused_linear_logprobs(hidden_states, vocab_weights, input_ids.long(), temperature=temperature,
                                              compiled=self.compiled)  # fmt: skip
        return logp, entropy


class EagerFusedLinearForPPO(FusedLinearForPPO):
    compiled = False


def _targets():
    """verl's two modules whose names the patched forwards look up on each call."""
    import verl.utils.experimental.torch_functional as torch_backend
    import verl.utils.kernel.linear_cross_entropy as triton_backend

    return triton_backend, torch_backend


def install(compiled: bool = True):
    """Make verl's fused-kernel forwards (both backends) run on `fused_linear_logprobs`, in this process. Returns
    a function that puts verl's own kernels back."""
    triton_backend, torch_backend = _targets()
    saved = (triton_backend.linear_cross_entropy, torch_backend.FusedLinearForPPO)
    triton_backend.linear_cross_entropy = functools.partial(linear_cross_entropy, compiled=compiled)
    torch_backend.FusedLinearForPPO = FusedLinearForPPO if compiled else EagerFusedLinearForPPO

    def uninstall():
        triton_backend.linear_cross_entropy, torch_backend.FusedLinearForPPO = saved

    return uninstall


@contextlib.contextmanager
def compiled_grpo_kernels(compiled: bool = True):
    """`install()` for the duration of a block."""
    uninstall = install(compiled)
    try:
        yield
    finally:
        uninstall()
