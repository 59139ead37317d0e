"""Rollouts on compiled decoding: TRL's `generate` path with transformers' own compiled decode step, its shapes fixed.

GRPOTrainer builds its `GenerationConfig(..., disable_compile=True)`, so transformers decodes one token at a time
eagerly on a dynamic cache, and the step's generation takes most of its wall clock. transformers compiles the decode
step (`torch.compile(mode="reduce-overhead")`: Inductor's kernels replayed as CUDA graphs) when the cache is static.
The decode step's shapes are then the generation batch, one token, and the cache's length; the attention mask is
built outside the compiled call at the cache's length, so the prompt's length does not reach the graph (the
prefill, at the prompt's own length, runs eagerly). What recompiles is a new cache length, and transformers sizes
the cache to each call's prompt + `max_new_tokens` unless `max_cache_len` pins it. Here the cache is pinned to the
longest prompt's bucket (a power of two, at least `PROMPT_BUCKET_FLOOR` tokens) + `max_new_tokens`; transformers
never shrinks a static cache it has sized before, so a run compiles once per bucket its prompts reach, in increasing
order (said each time in a `GenerationNotice`). A `max_cache_len` in `GRPOConfig.generation_kwargs` is the floor.

`compile_generation="auto"` (CompiledGRPOTrainer's default) compiles on a GPU where TRL generates with transformers'
`generate` (not vLLM, not transformers' continuous batching), no engine shards the parameters (ZeRO-3 and FSDP
gather them for each generation: their addresses change, which CUDA graphs cannot replay), the model is text-only
and the cache is left to the trainer (`cache_implementation` None or "static"), and decodes there on the trainer's
own loop (`decoding_loop`, as "loop" does). `True` compiles transformers' own decode step wherever that path runs
(the CPU too: Inductor's C++ kernels, no CUDA graphs), its logits processors and sampler running outside the compiled
call on its logits as they do eagerly (the same tokens as TRL's for the same seed); `False` keeps TRL's eager
generation. Where compiling fails, generation falls back to TRL's eager configuration for the rest of the run, with
the reason said once.

transformers reads whether every sequence has finished after each decode step, which makes the host wait for the
GPU once per token; its own `DeferredStopCheck` reads it one step late instead (one more decode step, which it
undoes: the tokens returned are the same), but only on Apple's GPUs. `DEFERRED_STOP_CHECK = True` turns it on for
compiled decoding on CUDA too (`deferred_stop_check`), where the cache is not returned (TRL's `generate` call).
`compile_generation="loop"` compiles as `True` does and decodes on the trainer's own loop (`decoding_loop`: each
token's whole step one compiled call, sampling from the same distribution by another random stream) where it takes
the call, the model's `generate` replaced during TRL's call; calls it does not take run transformers' compiled
decoding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings

import torch

from ... import kernels
from . import decoding_loop
from .regional_compile import compiled_graphs as graphs

DEFERRED_STOP_CHECK = False  # transformers' deferred stop check on CUDA (not yet measured there)
DEFERRED_DEVICES = ("cuda",)  # where `DEFERRED_STOP_CHECK` turns it on (transformers' own choice: Apple's GPUs)
PROMPT_BUCKET_FLOOR = 256  # the smallest prompt bucket: prompts of up to 256 tokens share one cache length
COMPILE_ERRORS = (
    torch._dynamo.exc.BackendCompilerFailed,
    torch._dynamo.exc.Unsupported,
    torch._dynamo.exc.TorchRuntimeError,
    torch._dynamo.exc.InternalTorchDynamoError,
)


class GenerationNotice(UserWarning):
    """What `compile_generation` compiled, or why generation runs eagerly."""


@dataclasses.dataclass
class GenerationCompiles:
    """What compiled decoding did in a run: each compile's cache length, graphs and seconds, and the reason it stopped
    compiling (None while it compiles)."""

    compiles: list[tuple[int, int, float]] = dataclasses.field(default_factory=list)
    calls: int = 0
    fallback: str | None = None


def say(message: str) -> None:
    warnings.warn(f"compiled_grpo: {message}", GenerationNotice, stacklevel=kernels.frames_to_caller())


def check_mode(compile_generation) -> None:
    if not (compile_generation is True or compile_generation is False or compile_generation in ("auto", "loop")):
        raise TypeError(f"compile_generation: expected 'auto', True, False or 'loop', got {compile_generation!r}")


def reason_not_to_compile(trainer, mode) -> str | None:
    """Why the trainer's generation stays as TRL runs it, or None where it compiles (`mode` as checked)."""
    if trainer.use_vllm:
        return "generation runs on vLLM, which is left as TRL runs it"
    if trainer.use_transformers_continuous_batching:
        return "generation runs on transformers' continuous batching, which is left as TRL runs it"
    if mode is False:
        return "compile_generation=False"
    cache = trainer.args.cache_implementation
    if cache not in (None, "static"):
        return f"cache_implementation={cache!r} was chosen; compiled decoding needs the static cache"
    if mode is True or mode == "loop":
        return None
    if trainer.accelerator.device.type != "cuda":
        return "'auto' compiles on a GPU only (compile_generation=True compiles on the CPU too)"
    if trainer.shards_parameters:
        return "an engine (ZeRO-3, FSDP) gathers the parameters for each generation, which CUDA graphs cannot replay"
    if getattr(trainer, "_is_vlm", False):
        return "the model is multimodal (its prefill and image inputs are not part of the compiled decode step)"
    return None


def configure(trainer, mode) -> None:
    """The trainer's generation set up for compiled decoding (a static cache, compiling on), or left as TRL's with
    the reason kept in `trainer.generation_compiles.fallback` (said where the user asked for True)."""
    check_mode(mode)
    trainer.generation_compiles = GenerationCompiles()
    reason = reason_not_to_compile(trainer, mode)
    trainer.compile_generation = reason is None
    on_loop = mode == "loop" or (mode == "auto" and trainer.accelerator.device.type == "cuda")
    trainer.generation_loops = {} if reason is None and on_loop else None  # `decoding_loop`'s, kept per shape
    if reason is not None:
        trainer.generation_compiles.fallback = reason
        if mode is True:
            say(f"compile_generation: generation runs as TRL runs it: {reason}")
        return
    from transformers import CompileConfig

    config = trainer.generation_config
    trainer.cache_floor = config.max_cache_len or 0  # a user's pinned cache length, the smallest one used
    config.cache_implementation = "static"
    config.disable_compile = False
    on_gpu = trainer.accelerator.device.type == "cuda"
    config.compile_config = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead" if on_gpu else None)
    if not on_gpu:  # transformers compiles only on accelerators unless told otherwise
        config.compile_config._compile_all_devices = True
    trainer.generation_kwargs["cache_implementation"] = "static"  # the model's own config, overridden as TRL does


def prompt_bucket(length: int) -> int:
    """The prompt bucket of a prompt of `length` tokens: the next power of two, at least `PROMPT_BUCKET_FLOOR`."""
    return max(PROMPT_BUCKET_FLOOR, 1 << max(length - 1, 0).bit_length())


def cache_length(trainer, prompt_ids: list) -> int:
    """The static cache's length for these prompts: the longest one's bucket + `max_new_tokens`."""
    longest = max((len(ids) for ids in prompt_ids), default=1)
    return max(trainer.cache_floor, prompt_bucket(longest) + trainer.generation_config.max_new_tokens)


def generate(trainer, run, prompt_ids: list):
    """`run()`: TRL's generation of `prompt_ids`, on compiled decoding where the trainer compiles it (its cache pinned
    to `cache_length`); a compile is timed and said; where compiling fails, eager from here on, said once."""
    if not trainer.compile_generation:
        return run()
    drop_repeated_input_grad_hooks(trainer.accelerator.unwrap_model(trainer.model))
    config = trainer.generation_config
    config.max_cache_len = cache_length(trainer, prompt_ids)
    before, start = graphs(), time.perf_counter()
    try:
        with deferred_stop_check(DEFERRED_STOP_CHECK), own_loop(trainer):
            result = run()
    except COMPILE_ERRORS as error:
        fall_back(trainer, error)
        return run()
    record(trainer, (len(prompt_ids), config.max_cache_len), graphs() - before, time.perf_counter() - start)
    return result


def own_loop(trainer):
    """Where the trainer decodes on `decoding_loop` ("loop"), its model's `generate` replaced inside the block."""
    if getattr(trainer, "generation_loops", None) is None:
        return contextlib.nullcontext()
    model = trainer.accelerator.unwrap_model(trainer.model)
    return decoding_loop.replacing_generate(model, trainer.generation_loops, trainer.generation_config.max_cache_len)


@contextlib.contextmanager
def deferred_stop_check(on: bool):
    """Inside the block (where `on`) transformers decides to stop decoding one step late on `DEFERRED_DEVICES` as
    on Apple's GPUs (`DeferredStopCheck`: no host wait per token), where the cache is not handed back to the caller
    (then it has nothing to roll back) and no assistant model decodes; elsewhere, and without the class
    (transformers before it), as transformers decides."""
    from transformers.generation import utils as generation

    check = getattr(generation, "DeferredStopCheck", None)
    if not on or check is None:
        yield
        return
    stored, own = check.__dict__["is_supported"], check.is_supported

    def is_supported(device, cache, cache_is_returned, is_assistant=False):
        if device.type in DEFERRED_DEVICES and not cache_is_returned and not is_assistant:
            return True
        return own(device, cache, cache_is_returned, is_assistant=is_assistant)

    check.is_supported = staticmethod(is_supported)
    try:
        yield
    finally:
        check.is_supported = stored


def drop_repeated_input_grad_hooks(model: torch.nn.Module) -> None:
    """One of the identical hooks that make the input embeddings' output require grad kept, the rest removed.
    transformers' `gradient_checkpointing_enable` adds one each time it is called and its disable removes it only on
    PEFT models; TRL disables and enables checkpointing around every generation, so each step adds one, and the
    compiled decode step, which guards on the embeddings' hooks, would compile again at every step."""
    for module in model.modules():
        hooks = module._forward_hooks
        repeated = [key for key, hook in hooks.items() if getattr(hook, "__name__", "") == "make_inputs_require_grads"]
        for key in repeated[:-1]:
            del hooks[key]
            module._forward_hooks_with_kwargs.pop(key, None)
            module._forward_hooks_always_called.pop(key, None)


def record(trainer, shape: tuple[int, int], new_graphs: int, seconds: float) -> None:
    """One generation's compiles (`shape`: its sequences and cache length) counted; a compile said."""
    state, (sequences, length) = trainer.generation_compiles, shape
    state.calls += 1
    if not new_graphs:
        return
    first = not state.compiles
    state.compiles.append((length, new_graphs, seconds))
    if first:
        say(f"compile_generation: the first generation compiled the decode step ({sequences} sequences, a cache of "
            f"{length} tokens) and took {seconds:.1f} s; later generations replay it")  # fmt: skip
    else:
        say(f"compile_generation: a longer prompt grew the cache to {length} tokens and the decode step compiled "
            f"again ({seconds:.1f} s); pin it with generation_kwargs={{'max_cache_len': N}}")  # fmt: skip


def fall_back(trainer, error: Exception) -> None:
    """TRL's own generation configuration back (eager decoding on its cache), the reason kept and said."""
    cause = getattr(error, "inner_exception", None) or error.__cause__ or error
    first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    reason = f"compiling the decode step failed ({type(error).__name__}: {type(cause).__name__}: {first[:300]})"
    config = trainer.generation_config
    config.cache_implementation = trainer.args.cache_implementation
    config.disable_compile, config.max_cache_len, config.compile_config = True, None, None
    trainer.generation_kwargs["cache_implementation"] = trainer.args.cache_implementation
    trainer.compile_generation, trainer.generation_loops = False, None
    trainer.generation_compiles.fallback = reason
    say(f"compile_generation: {reason}; generation runs eagerly from here")
