"""The attention of packed forwards, carried by each forward's own arguments (so a recomputed layer sees what its
forward saw).

A packed forward may run another attention implementation than the model's own (FlexAttention's block mask, SDPA's
dense mask for an eager model...). Switching the model's implementation for the forward alone is wrong under
gradient checkpointing: the backward recomputes each checkpointed layer after the switch is undone, under the
model's own implementation with the packed forward's mask (an error at best, a wrong gradient without a word under
reentrant checkpointing). Instead, `install` gives the model one implementation registered with transformers'
`AttentionInterface`, "compiled_grpo_over_<own>", that dispatches on the call:

- the attention function: a packed forward passes `PACKED_KWARG=<implementation>` among the model's keyword
  arguments, which transformers hands to every layer's attention and checkpointing replays with the layer; every
  other call (generation, padded forwards, the reference model's) runs the model's own function.
- the mask: transformers builds it once per forward, outside the layers, and passes it to each layer as an argument
  (replayed as it is); while a packed forward runs (`packed_masks`), it is the packed implementation's mask.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys

import torch

PACKED_KWARG = "compiled_grpo_packed_attention"
PREFIX = "compiled_grpo_over_"
_packed_mask_of = contextvars.ContextVar("compiled_grpo_packed_mask_of", default=None)


def registered_name(own: str) -> str:
    return f"{PREFIX}{own}"


def own_implementation(model) -> str:
    """The model's own attention implementation (through the dispatcher, the one it falls back to)."""
    name = model.config._attn_implementation or "eager"
    return name.removeprefix(PREFIX)


def installed(model) -> bool:
    return (model.config._attn_implementation or "").startswith(PREFIX)


def install(model) -> None:
    """The model (a transformers PreTrainedModel, its submodels too) on the dispatching implementation over its own
    one; idempotent. Every call without `PACKED_KWARG` computes exactly what it did before."""
    if installed(model):
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    own = own_implementation(model)
    if own not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"packed attention: the model's attention implementation {own!r} has no mask function "
                         "in transformers' AttentionMaskInterface, so its calls cannot be dispatched")  # fmt: skip
    name = registered_name(own)
    AttentionInterface.register(name, functools.partial(attend, own))
    AttentionMaskInterface.register(name, functools.partial(mask, own))
    model.set_attn_implementation(name)


def uninstall(model) -> None:
    """The model back on its own implementation (the dispatcher's registration stays: it is shared and harmless)."""
    if installed(model):
        model.set_attn_implementation(own_implementation(model))


def attend(own: str, module, query, key, value, attention_mask, **kwargs):
    """The attention of one layer's call: the packed forward's implementation where the call carries one, else the
    model's own."""
    chosen = kwargs.pop(PACKED_KWARG, None) or own
    return attention_function(chosen, module)(module, query, key, value, attention_mask, **kwargs)


def attention_function(name: str, module):
    """transformers' attention function `name`; "eager" is the model's own module-level eager function."""
    if name == "eager":
        own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if own is None:
            from transformers.models.llama.modeling_llama import eager_attention_forward as own
        return own
    from transformers import AttentionInterface

    return AttentionInterface()[name]


def mask(own: str, *args, **kwargs):
    """The mask of a forward: the packed implementation's while a packed forward runs, else the model's own."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = _packed_mask_of.get() or own
    return ALL_MASK_ATTENTION_FUNCTIONS[name](*args, **kwargs)


@contextlib.contextmanager
def packed_masks(name: str | None):
    """Masks built while the block runs are implementation `name`'s (None: the model's own)."""
    token = _packed_mask_of.set(name)
    try:
        yield
    finally:
        _packed_mask_of.reset(token)


def forward_kwargs(name: str | None) -> dict:
    """The keyword arguments that make a forward's layers attend with `name` (none for the model's own)."""
    return {} if name is None else {PACKED_KWARG: name}


def runs_on(name: str | None, device: torch.device) -> str | None:
    """Why packed attention `name` cannot run on `device` with this torch (None: it can)."""
    if name == "flex_attention" and device.type != "cuda":
        return ("FlexAttention's backward runs on a GPU only with this torch: choose packed_attention='sdpa' or "
                "'eager' on a CPU")  # fmt: skip
    return None
