"""How much resident memory a checkpointed backward through 8 decoder layers adds at its peak, run as a script in a
process of its own (`python tests/stack_memory.py [reentrant|non-reentrant|gradients]`, one JSON line): the layers
eager and not checkpointed, eager and checkpointed layer by layer, and on `compiled_stack`'s compiled function
(checkpointed as the layers would be); with `gradients`, the parameter gradients a step holds at once. Large buffers
are mapped and unmapped one by one (`MALLOC_MMAP_THRESHOLD_`, set by the caller), so that the process's resident
high-water mark follows the tensors alive; it is reset before each step measured (the stack's last: its first
compiles)."""

from __future__ import annotations

import functools
import json
import sys

import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from compiled_grpo.integrations.trl import compiled_stack

HIDDEN, LAYERS, TOKENS = 256, 8, 4096


def resident_peak_mib() -> int:
    """The process's resident high-water mark (VmHWM), in MiB."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmHWM"))


def reset_resident_peak() -> None:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the high-water mark back to the resident size now


def eager(layers, hidden, kwargs, checkpoint):
    """The layers as a model runs them eagerly, each checkpointed with `checkpoint` (None: not checkpointed)."""
    for layer in layers:
        call = functools.partial(compiled_stack.call_layer, layer, kwargs=kwargs)
        out = call(hidden) if checkpoint is None else torch.utils.checkpoint.checkpoint(call, hidden, **checkpoint)
        hidden = out[0] if isinstance(out, tuple) else out
    return hidden


def peak_growth(forward, layers, x, kwargs, checkpoint, steps=1) -> int:
    """MiB that a step's forward and backward add to the resident memory at their peak (the last of `steps`)."""
    for _ in range(steps):
        hidden = x.clone().requires_grad_()
        reset_resident_peak()
        before = resident_peak_mib()
        out = forward(layers, hidden, kwargs, checkpoint)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        del out
    return resident_peak_mib() - before


def in_groups(stack: compiled_stack.Stack, per_call: int):
    """The stack's compiled function called on groups of `per_call` layers, one after the other."""

    def forward(layers, hidden, kwargs, checkpoint):
        for start in range(0, len(layers), per_call):
            out = stack.compiled(layers[start : start + per_call], hidden, kwargs, checkpoint)
            hidden = out[0] if isinstance(out, tuple) else out
        return out

    return forward


def decoder_layers(hidden: int, tokens: int):
    """(layers, their input, their keyword arguments): `LAYERS` Qwen2 decoder layers of `hidden` on `tokens`."""
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=hidden, intermediate_size=4 * hidden, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=LAYERS, vocab_size=64)  # fmt: skip
    config._attn_implementation = "sdpa"
    layers = torch.nn.ModuleList(Qwen2DecoderLayer(config, i) for i in range(LAYERS))
    x, positions = torch.randn(1, tokens, hidden), torch.arange(tokens)[None]
    return layers, x, {"position_embeddings": Qwen2RotaryEmbedding(config)(x, positions), "position_ids": positions}


def activations(checkpointing: str) -> dict:
    """Peaks of a step on many tokens (activations dominate), no gradients held before it."""
    layers, x, kwargs = decoder_layers(HIDDEN, TOKENS)
    checkpoint = {"use_reentrant": checkpointing == "reentrant"}
    stack = compiled_stack.Stack(list(layers))
    return {
        "not checkpointed": peak_growth(eager, layers, x, kwargs, None),
        "checkpointed": peak_growth(eager, layers, x, kwargs, checkpoint),
        "stack": peak_growth(stack.compiled, layers, x, kwargs, checkpoint, steps=2),  # the first compiles
    }


def gradients() -> dict:
    """Peaks of a step on few tokens of wide layers (parameter gradients dominate), `.grad` held from the step before
    (gradient accumulation): eager checkpointed layers, the stack's compiled function on all the layers at once and
    on groups of two; and one layer's gradients, in MiB."""
    layers, x, kwargs = decoder_layers(4 * HIDDEN, TOKENS // 16)
    checkpoint = {"use_reentrant": False}
    stack = compiled_stack.Stack(list(layers))
    return {
        "checkpointed": peak_growth(eager, layers, x, kwargs, checkpoint, steps=2),
        "stack": peak_growth(stack.compiled, layers, x, kwargs, checkpoint, steps=3),
        "stack in groups of 2": peak_growth(in_groups(stack, 2), layers, x, kwargs, checkpoint, steps=3),
        "layer": sum(p.numel() * p.element_size() for p in layers[0].parameters()) // 2**20,
    }


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else "non-reentrant"
    print(json.dumps(gradients() if what == "gradients" else activations(what)))
