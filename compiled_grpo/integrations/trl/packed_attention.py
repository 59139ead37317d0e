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
  other call (generation, padded forwards, the reference model's) runs the model's own function, but the decoding
  loop's steps, which pass `GROUPED_DECODING` (`decoding_attention`: the model's own function, its key and value
  heads not repeated).
- the mask: transformers builds it once per forward, outside the layers, and passes it to each layer as an argument
  (replayed as it is); while a packed forward runs (`packed_masks`), it is the packed implementation's mask.

Besides transformers' implementations, packed forwards can run `VARLEN`: torch's own FlashAttention kernel for
sequences of several lengths (`torch.nn.attention.varlen.varlen_attn`, CUDA, 16-bit), causal, GQA (by
`enable_gqa` where torch has it; before, the kernel takes fewer key and value heads as they are), a sliding window
where the layer has one. No mask at all: the sequences' boundaries
(`cu_seq_lens_q`, `max_length_q`) come from the micro-batch's plan on the host and travel among the forward's
keyword arguments like the implementation's name.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import sys

import torch

from ...packing import to_device
from . import shared_masks
from .decoding_attention import GROUPED_DECODING, grouped_decoding_attention

PACKED_KWARG = "compiled_grpo_packed_attention"
KEY_INDEX = "compiled_grpo_key_index"  # where segments share a prompt: the packed positions of each one's keys
VARLEN = "varlen"
PREFIX = "compiled_grpo_over_"
_packed_mask_of = contextvars.ContextVar("compiled_grpo_packed_mask_of", default=None)


try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # torch < 2.9
    varlen_attn = None


def varlen_parameters() -> frozenset[str]:
    """The keyword arguments this torch's `varlen_attn` takes (torch 2.11's has no `enable_gqa`)."""
    return frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn is not None else frozenset()


VARLEN_PARAMETERS = varlen_parameters()  # read once here, not inside the (compiled) layers
# Filled by `install`, read by every dispatched call: transformers' registry of attention functions and of masks,
# and each attention module class's own eager function. Nothing is imported inside a layer's call: dynamo cannot
# trace an import of transformers' lazy modules and breaks the compiled layer's graph there.
_registry: dict = {}
_eager_of: dict[type, object] = {}


def registered_name(own: str) -> str:
    return f"{PREFIX}{own}"


def own_implementation(model) -> str:
    """The model's own attention implementation (through the dispatcher, the one it falls back to)."""
    return own_implementation_of(model.config)


def installed(model) -> bool:
    return (model.config._attn_implementation or "").startswith(PREFIX)


def install(model) -> None:
    """The model (a transformers PreTrainedModel, its submodels too) on the dispatching implementation over its own
    one; idempotent. Every call without `PACKED_KWARG` computes exactly what it did before."""
    if installed(model):
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    own = own_implementation(model)
    if own not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"packed attention: the model's attention implementation {own!r} has no mask function "
                         "in transformers' AttentionMaskInterface, so its calls cannot be dispatched")  # fmt: skip
    _registry.update(functions=ALL_ATTENTION_FUNCTIONS, masks=ALL_MASK_ATTENTION_FUNCTIONS)
    _eager_of.update(eager_functions(model))
    name = registered_name(own)
    AttentionInterface.register(name, functools.partial(attend, own))
    AttentionMaskInterface.register(name, functools.partial(mask, own))
    model.set_attn_implementation(name)


def eager_functions(model) -> dict[type, object]:
    """{module class: its modeling file's `eager_attention_forward`} for the model's modules (Llama's where a file
    has none)."""
    from transformers.models.llama.modeling_llama import eager_attention_forward as llama_eager

    classes = {type(m) for m in model.modules()}
    return {c: getattr(sys.modules.get(c.__module__), "eager_attention_forward", llama_eager) for c in classes}


def known_implementations() -> tuple[str, ...]:
    """The names packed forwards can run under: transformers' registered attention implementations (this library's
    dispatchers aside), "eager" and `VARLEN`."""
    from transformers import AttentionInterface

    registered = [name for name in AttentionInterface().valid_keys() if not name.startswith(PREFIX)]
    return ("eager", VARLEN, *registered)


def attend(own: str, module, query, key, value, attention_mask, **kwargs):
    """The attention of one layer's call: the packed forward's implementation where the call carries one, else the
    model's own."""
    chosen = kwargs.pop(PACKED_KWARG, None) or own
    if chosen == GROUPED_DECODING:
        return grouped_decoding_attention(attention_function(own, module), module, query, key, value, attention_mask,
                                          **kwargs)  # fmt: skip
    return attention_function(chosen, module)(module, query, key, value, attention_mask, **kwargs)


def attention_function(name: str, module):
    """transformers' attention function `name`; "eager" is the module's own modeling file's eager function; `VARLEN`
    `varlen_attention`."""
    if name == VARLEN:
        return varlen_attention
    if name == "eager":
        return _eager_of[type(module)]
    return _registry["functions"][name]


def mask(own: str, *args, **kwargs):
    """The mask of a forward: the packed implementation's while a packed forward runs, else the model's own."""
    name = _packed_mask_of.get() or own
    if name == VARLEN:  # the boundaries travel as cu_seq_lens_q: no mask
        return None
    return _registry["masks"][name](*args, **kwargs)


def varlen_attention(module, query, key, value, attention_mask, *, cu_seq_lens_q, max_length_q, scaling=None,
                     sliding_window=None, dropout=0.0, **kwargs):  # fmt: skip
    """One packed row's attention ([1, heads, N, head_dim] query, key and value, as transformers hands them) by
    `varlen_attn`: each sequence of `cu_seq_lens_q` causal within itself (and within `sliding_window` positions);
    where segments share a prompt, each attends to the keys `KEY_INDEX` gathers for it (`cu_seq_lens_k`: its shared
    prompt's, then its own), causal from the end (its last query sees every key); ([1, N, heads, head_dim], None) as
    transformers' attention functions return."""
    if dropout:
        raise ValueError("packed_attention='varlen' runs no attention dropout; the model's is on in training")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, head_dim]
    cu_k, max_k, index = kwargs.get("cu_seq_lens_k"), kwargs.get("max_length_k"), kwargs.get(KEY_INDEX)
    if index is not None:
        k, v = k.index_select(0, index), v.index_select(0, index)
    else:
        cu_k, max_k = cu_seq_lens_q, max_length_q
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_k, max_length_q, max_k, scale=scaling,
                      **causal_options(sliding_window, k.shape[1] != q.shape[1]))  # fmt: skip
    return out.unsqueeze(0), None


def causal_options(sliding_window: int | None, grouped: bool) -> dict:
    """`varlen_attn`'s keywords for causal attention within each sequence (and `sliding_window` positions), with
    fewer key and value heads than query heads where `grouped`, in this torch's terms."""
    if "window_size" not in VARLEN_PARAMETERS:  # an older signature: causal by a flag, no window
        if sliding_window:
            raise ValueError(f"packed_attention='varlen': torch {torch.__version__}'s varlen_attn takes no sliding "
                             "window; choose packed_attention='flex_attention' or 'sdpa'")  # fmt: skip
        return {"is_causal": True}
    options = {"window_size": (-1, 0) if not sliding_window else (sliding_window - 1, 0)}
    if grouped and "enable_gqa" in VARLEN_PARAMETERS:
        options["enable_gqa"] = True
    return options


@contextlib.contextmanager
def packed_masks(name: str | None):
    """Masks built while the block runs are implementation `name`'s (None: the model's own)."""
    token = _packed_mask_of.set(name)
    try:
        yield
    finally:
        _packed_mask_of.reset(token)


def no_masks(config):
    """No mask, in the form the model takes one ready-made (`shared_masks.as_model_takes`): a mapping with no mask for
    each of its layer types, or an empty 4D tensor that transformers passes on as it is. A model given it builds
    none (and reads nothing back to find the packed sequences: `VARLEN` has their boundaries from the plan)."""
    return shared_masks.as_model_takes(config, lambda window: torch.empty(1, 1, 0, 0))


def forward_kwargs(name: str | None, packed, config) -> dict:
    """The keyword arguments that make a forward's layers attend with `name` (none for the model's own) over
    `packed` (`packing.PackedRows`): for `VARLEN`, its sequences' boundaries too, copied to the device without a
    wait, and (where the model's `config` is known) an empty mask mapping (`no_masks`). Segments that share a
    prompt (`packed.keys`) take their keys' boundaries and positions too (`VARLEN`) or a mask of their own for
    each layer type (`shared_masks`)."""
    if packed.keys is not None:
        return shared_forward_kwargs(name, packed, config)
    if name is None:
        return {}
    if name != VARLEN:
        return {PACKED_KWARG: name}
    bounds = to_device(packed.cu_seqlens, packed.input_ids.device)
    kwargs = {PACKED_KWARG: name, "cu_seq_lens_q": bounds, "max_length_q": packed.longest}
    return kwargs if config is None else {**kwargs, "attention_mask": no_masks(config)}


def shared_forward_kwargs(name: str | None, packed, config) -> dict:
    """`forward_kwargs` of a packed row whose segments share prompts."""
    keys, device = packed.keys, packed.input_ids.device
    runs = name or own_implementation_of(config)
    chosen = {} if name is None else {PACKED_KWARG: name}
    if runs != VARLEN:
        return {**chosen, "attention_mask": shared_masks.masks(runs, packed, config)}
    bounds = to_device(torch.cat([packed.cu_seqlens, keys.cu_seqlens, keys.index.to(torch.int32)]), device)
    q, k = len(packed.cu_seqlens), len(keys.cu_seqlens)
    # one copy to the device, then tensors of their own: the inputs of a nested compile region (the stack's layer
    # calls) may not alias one another, which two views of one copy would
    boundaries = {"cu_seq_lens_q": bounds[:q], "max_length_q": packed.longest,
                  "cu_seq_lens_k": bounds[q : q + k].clone(), "max_length_k": keys.longest,
                  KEY_INDEX: bounds[q + k :].long()}  # fmt: skip
    return {**chosen, **boundaries, "attention_mask": no_masks(config)}


def own_implementation_of(config) -> str:
    """The attention implementation a model of `config` runs (through the dispatcher, the one it falls back to)."""
    return (config._attn_implementation or "eager").removeprefix(PREFIX)


def runs_on(name: str | None, device: torch.device, sixteen_bit: bool) -> str | None:
    """Why packed attention `name` cannot run on `device` with this torch (None: it can); `sixteen_bit`: whether
    the model's attention runs in bf16 or fp16."""
    if name == "flex_attention" and device.type != "cuda":
        return ("FlexAttention's backward runs on a GPU only with this torch: choose packed_attention='sdpa' or "
                "'eager' on a CPU")  # fmt: skip
    if name == VARLEN:
        return varlen_unavailable(device, sixteen_bit)
    return None


def varlen_unavailable(device: torch.device, sixteen_bit: bool) -> str | None:
    """Why torch's varlen FlashAttention cannot run here (None: it can)."""
    if varlen_attn is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.9 has)"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return "torch's varlen FlashAttention runs on CUDA GPUs of compute capability 8.0 and up only"
    if not sixteen_bit:
        return "torch's varlen FlashAttention runs in bf16 or fp16: train with bf16 (or fp16), or a 16-bit model"
    return None
