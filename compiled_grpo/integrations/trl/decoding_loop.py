"""A decoding loop whose every token is one compiled call (`compile_generation="loop"`, and "auto" on a GPU).

transformers' compiled decoding compiles the model's forward alone: for every token the host still runs `generate`'s
loop around it (the inputs prepared, the compiled call's guards and graph replay, the logits processors, sampling,
the stopping criteria, "all finished?" read back). Timed in `train()` on an H100 host, a token of 32 sequences took
~7.4 ms at Qwen2.5-1.5B and ~15.7 ms at 7B, five times the weights: ~5 ms a token that does not grow with the
model, the host's. Here each token's whole step (the forward on a static cache, the logits processors, the choice of
the token, the finished flags) is one compiled function, replayed as a CUDA graph on a GPU, and the host reads
whether every sequence has finished one step late, from a copy it does not wait for. An SDPA model's layers attend
without repeating their key and value heads for every query head (`decoding_attention`). On an H100 at 1.5B a token
of 32 sequences took 3.23 ms so, against 7.03 ms on transformers' compiled decode step.

It decodes as `generate` does for the configurations it takes: the logits processors are `generate`'s own (built by
transformers from the call's merged generation config), accepted where they read the scores alone (temperature,
top-k, top-p, min-p); greedy decoding takes the argmax; sampling draws from the softmax by an exponential race (the
index of the largest p / E, E exponential: distributed as p), the same distribution as `torch.multinomial` from
another random stream; a finished sequence takes the pad token; the output stops where `generate` stops (every
sequence finished, or `max_new_tokens`). Anything else (other processors, inputs beyond the ids and their mask,
stop strings, returned dicts, beams) runs `generate` itself (`reason_not_to_loop`).
"""

from __future__ import annotations

import contextlib

import torch

from . import packed_attention
from .decoding_attention import GROUPED_DECODING
from .padding_free import transformers_model
from .zero_advantage import say_once

GPU_MODE = "reduce-overhead"  # the step's torch.compile mode on a GPU (CUDA graphs; "max-autotune" also tunes GEMMs)
GROUPED_ATTENTION = True  # SDPA models' steps attend without repeating key and value heads (`decoding_attention`)
SCORE_ONLY = ("TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper")


class LoopNotice(UserWarning):
    """Why a generation runs transformers' `generate` itself instead of the loop."""


def processors_and_config(model, generation_config, input_ids):
    """`generate`'s merged generation config for this call and its logits processors."""
    from transformers import LogitsProcessorList

    config, model_kwargs = model._prepare_generation_config(generation_config)
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=input_ids.shape[1],
                                             encoder_input_ids=input_ids, logits_processor=LogitsProcessorList(),
                                             device=input_ids.device, model_kwargs=model_kwargs)  # fmt: skip
    return config, list(processors)


def reason_not_to_loop(config, processors: list, inputs: dict) -> str | None:
    """Why this call runs `generate` itself, or None where the loop decodes it."""
    if set(inputs) - {"input_ids", "attention_mask"}:
        return f"inputs beyond the ids and their mask ({sorted(set(inputs) - {'input_ids', 'attention_mask'})})"
    if (config.num_beams or 1) != 1 or config.return_dict_in_generate or config.stop_strings or config.max_time:
        return "beams, returned dicts, stop strings or a time limit"
    if config.pad_token_id is None or config.max_new_tokens is None:
        return "no pad token or no max_new_tokens"
    other = [type(p).__name__ for p in processors if type(p).__name__ not in SCORE_ONLY]
    return f"logits processors that read more than the scores ({other})" if other else None


def choose(logits: torch.Tensor, processors: list, greedy: bool, history: torch.Tensor) -> torch.Tensor:
    """The next token of each row from its last logits: the processors' scores' argmax, or a draw from their softmax
    (an exponential race)."""
    scores = logits.float()
    for processor in processors:
        scores = processor(history, scores)
    if greedy:
        return scores.argmax(-1)
    probs = scores.softmax(-1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


class Loop:
    """One compiled decoding step and the static cache and attention mask it runs on, for a batch and cache length."""

    def __init__(self, model, batch: int, cache_length: int, processors: list, greedy: bool, device):
        from transformers import StaticCache

        self.length = cache_length
        self.cache = StaticCache(config=model.config, max_cache_len=cache_length)
        self.mask = torch.ones(batch, cache_length, dtype=torch.long, device=device)
        self.model, self.processors, self.greedy = model, processors, greedy
        self.attention = step_attention(model)
        on_gpu = torch.device(device).type == "cuda"
        self.step = torch.compile(self.eager_step, mode=GPU_MODE if on_gpu else None)

    def eager_step(self, token, position, cache_position, unfinished, ends, pad):
        out = self.model(input_ids=token[:, None], attention_mask=self.mask, position_ids=position[:, None],
                         past_key_values=self.cache, cache_position=cache_position, use_cache=True,
                         **self.attention)  # fmt: skip
        chosen = choose(out.logits[:, -1], self.processors, self.greedy, token[:, None])
        chosen = torch.where(unfinished, chosen, pad)
        return chosen, unfinished & ~torch.isin(chosen, ends)


def step_attention(model) -> dict:
    """The steps' keyword arguments that make an SDPA model's layers attend without repeating their key and value
    heads (`decoding_attention`, through `packed_attention`'s dispatcher); none for other implementations."""
    if not GROUPED_ATTENTION or packed_attention.own_implementation(model) != "sdpa":
        return {}
    packed_attention.install(transformers_model(model))
    return {packed_attention.PACKED_KWARG: GROUPED_DECODING}


def decode(loop: Loop, input_ids, attention_mask, new_tokens: int, ends, pad) -> torch.Tensor:
    """The prompts and `new_tokens` tokens after them (fewer where every row finished first), as `generate` returns
    them: the prompt's forward eager on the loop's cache, then the compiled step per token."""
    width = input_ids.shape[1]
    device, on_gpu = input_ids.device, input_ids.is_cuda
    loop.cache.reset()
    loop.mask.fill_(1)
    loop.mask[:, :width] = attention_mask
    positions = (attention_mask.long().cumsum(1) - 1).masked_fill(attention_mask == 0, 1)
    out = loop.model(input_ids=input_ids, attention_mask=loop.mask, position_ids=positions, past_key_values=loop.cache,
                     cache_position=torch.arange(width, device=device), use_cache=True, logits_to_keep=1)  # fmt: skip
    token = choose(out.logits[:, -1], loop.processors, loop.greedy, input_ids)
    unfinished, tokens, done = ~torch.isin(token, ends), [token], LateFlag(on_gpu)
    last = attention_mask.long().sum(1) - 1  # each row's last position in the prompt
    for i in range(1, new_tokens):
        if done.read(~unfinished.any()):
            break
        if on_gpu:
            torch.compiler.cudagraph_mark_step_begin()
        cache_position = torch.full((1,), width + i - 1, device=device)
        token, unfinished = loop.step(token, last + i, cache_position, unfinished, ends, pad)
        token, unfinished = token.clone(), unfinished.clone()  # out of the graphs' pool, which the next step reuses
        tokens.append(token)
    chosen = torch.stack(tokens, 1)
    return torch.cat([input_ids, chosen[:, : steps_run(chosen, ends)]], 1)


def steps_run(tokens: torch.Tensor, ends: torch.Tensor) -> int:
    """The steps `generate` runs for these tokens: up to the step where the last row meets an end token (all)."""
    ended = torch.isin(tokens, ends)
    first = torch.where(ended.any(1), ended.int().argmax(1) + 1, tokens.shape[1])
    return int(first.max())


class LateFlag:
    """A device boolean read on the host one step late: `read(flag)` copies this step's without waiting and returns
    the last step's (False the first time); on the CPU, this step's."""

    def __init__(self, on_gpu: bool):
        self.on_gpu, self.pending = on_gpu, None
        if on_gpu:
            self.slots = [(torch.zeros((), dtype=torch.bool, pin_memory=True), torch.cuda.Event()) for _ in range(2)]

    def read(self, flag: torch.Tensor) -> bool:
        if not self.on_gpu:
            return bool(flag)
        host, event = self.slots[0]
        host.copy_(flag, non_blocking=True)
        event.record()
        last, self.pending = self.pending, self.slots[0]
        self.slots.reverse()
        if last is None:
            return False
        last[1].synchronize()
        return bool(last[0])


def generate(model, loops: dict, cache_length: int, generation_config=None, **inputs) -> torch.Tensor:
    """`model.generate(**inputs, generation_config=...)` on the loop where it takes the call (a `Loop` per kind of
    call kept in `loops`, `loop_for`), on `generate` itself where it does not."""
    input_ids = inputs["input_ids"]
    config, processors = processors_and_config(model, generation_config, input_ids)
    reason = reason_not_to_loop(config, processors, inputs)
    if reason is not None:
        message = f"compile_generation='loop': a generation runs transformers' generate itself: {reason}"
        say_once(model, message, LoopNotice)  # once per model
        return type(model).generate(model, **inputs, generation_config=generation_config)
    loop = loop_for(loops, model, input_ids, cache_length, processors, not config.do_sample)
    ends = config.eos_token_id if isinstance(config.eos_token_id, list) else [config.eos_token_id]
    ends = torch.tensor([e for e in ends if e is not None], dtype=torch.long, device=input_ids.device)
    pad = torch.tensor(config.pad_token_id, device=input_ids.device)
    mask = inputs.get("attention_mask", torch.ones_like(input_ids))
    with torch.no_grad():
        return decode(loop, input_ids, mask, config.max_new_tokens, ends, pad)


def loop_for(loops: dict, model, input_ids, cache_length: int, processors: list, greedy: bool) -> Loop:
    """The loop of this kind of call (batch, greedy or not, the processors' settings) with a cache of at least
    `cache_length`: one per kind, replaced by a larger one where a longer prompt needs it (the smaller cache freed
    first) and kept for shorter ones after, as transformers grows its own static cache and never shrinks it."""
    kind = (input_ids.shape[0], greedy, tuple(repr(vars(p)) for p in processors))
    if kind not in loops or loops[kind].length < cache_length:
        loops.pop(kind, None)
        loops[kind] = Loop(model, input_ids.shape[0], cache_length, processors, greedy, input_ids.device)
    return loops[kind]


@contextlib.contextmanager
def replacing_generate(model, loops: dict, cache_length: int):
    """Inside the block, `model.generate` decodes on the loop (`generate`)."""
    model.generate = lambda generation_config=None, **inputs: generate(model, loops, cache_length, generation_config,
                                                                        **inputs)  # fmt: skip
    try:
        yield
    finally:
        del model.generate
