"""The final hidden states of a model's forward, taken where they enter the lm_head, which projects one position."""

from __future__ import annotations


def completion_hidden_states(model, lm_head, model_inputs: dict, completion_length: int):
    """The final hidden states that predict the completion tokens [B, C, H], and the model's output (the model
    keeps the last C + 1 positions, `logits_to_keep`)."""
    kept = {**model_inputs, "logits_to_keep": completion_length + 1}
    hidden, outputs = hidden_states_at_head(model, lm_head, kept)
    return hidden[:, :-1], outputs


def hidden_states_at_head(model, lm_head, model_inputs: dict):
    """The input of the output embedding (the final hidden states of the positions the model keeps) and the
    model's output. A forward pre-hook takes that input and hands the head only the last position, so no
    [positions, V] logits are made."""
    captured = {}

    def take_input(module, args):
        captured["hidden"] = args[0]
        return (args[0][:, -1:], *args[1:])

    handle = lm_head.register_forward_pre_hook(take_input)
    try:
        outputs = model(**model_inputs, use_cache=False)
    finally:
        handle.remove()
    return captured["hidden"], outputs
