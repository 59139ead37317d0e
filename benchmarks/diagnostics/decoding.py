"""Where a decoding step's time goes: transformers' `generate` called as GRPOTrainer calls it (sampling, TRL's
default temperature, top-p and top-k), on a batch of prompts of 20-200 tokens left-padded to the longest, a
Qwen2.5-shaped model with random bf16 weights. Rows, one process (the compiled rows share one compiled forward):

  eager: TRL's own call (a dynamic cache, `disable_compile=True`);
  compiled: `compile_generation`'s (a static cache pinned to the prompt bucket + the new tokens, the decode step
    compiled with CUDA graphs);
  compiled-deferred: the same with "all finished?" read one step late (`rollouts.deferred_stop_check`);
  whole-step: not transformers' loop but a bound on what a decoding loop could reach: each token's whole step (the
    forward on the static cache, sampling from the softmax by an exponential race, the finished flags) one
    compiled function replayed as a CUDA graph, the host reading nothing back (`whole_step_decode`).

No token ends a sequence here (the end token is never sampled from a near-uniform distribution over 151936), so
every call decodes `--new-tokens` steps. Per row: the wall clock per step (median of `--repeats` calls after two
warm-up calls), the GPU's busy time per step (one more call under the profiler, its device-side events once), and the
host ops with the most host time of their own in that call (per step), which say what a host-bound step spends on.

    python -m benchmarks.diagnostics.decoding [--model 1.5B] [--batch 32] [--new-tokens 256] [--repeats 3]
        [--rows eager,compiled,compiled-deferred] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from benchmarks.timing import device_busy_ms

ROWS = ("eager", "compiled", "compiled-deferred", "whole-step")
TOP_HOST_OPS = 12


def prompts(batch: int, vocab: int, device) -> dict:
    """`batch` prompts of 20-200 random tokens, left-padded (id 0) to the longest, with their attention mask."""
    rng = random.Random(0)
    lengths = [rng.randint(20, 200) for _ in range(batch)]
    width = max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n :] = torch.tensor([rng.randrange(3, vocab) for _ in range(n)])
        mask[i, width - n :] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def generation_config(row: str, new_tokens: int, width: int):
    """TRL's generation config (its defaults), compiled as `compile_generation` compiles it but in the eager row."""
    from transformers import CompileConfig, GenerationConfig

    from compiled_grpo.integrations.trl.rollouts import prompt_bucket

    trl = dict(max_new_tokens=new_tokens, do_sample=True, pad_token_id=0, bos_token_id=1, eos_token_id=[1],
               temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)  # fmt: skip
    if row == "eager":
        return GenerationConfig(**trl, disable_compile=True)
    compile_config = CompileConfig(fullgraph=False, dynamic=False, mode="reduce-overhead")
    return GenerationConfig(**trl, cache_implementation="static", max_cache_len=prompt_bucket(width) + new_tokens,
                            disable_compile=False, compile_config=compile_config)  # fmt: skip


def call(model, inputs: dict, config, row: str) -> int:
    """One synchronized decoding of `row`; the steps it decoded."""
    from compiled_grpo.integrations.trl.rollouts import deferred_stop_check

    with torch.no_grad(), deferred_stop_check(row == "compiled-deferred"):
        if row == "whole-step":
            out = whole_step_decode(model, inputs, config.max_new_tokens, config.max_cache_len, WHOLE_STEPS)
        else:
            out = model.generate(**inputs, generation_config=config)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out.shape[1] - inputs["input_ids"].shape[1]


def whole_step(model, cache, mask, greedy: bool):
    """A decoding step as one function: the next tokens of the `[B]` last ones at `position` (each row's own) and
    `cache_position` (the cache's slot), sampled from the softmax (an exponential race: the largest p / E with E
    exponential, distributed as the softmax) or its argmax; the rows that had finished take `pad`; and the finished
    flags (an end token) after it."""

    def step(token, position, cache_position, unfinished, ends, pad):
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=position[:, None],
                    past_key_values=cache, cache_position=cache_position, use_cache=True)  # fmt: skip
        probs = out.logits[:, -1].float().softmax(-1)
        chosen = probs.argmax(-1) if greedy else (probs / torch.empty_like(probs).exponential_()).argmax(-1)
        chosen = torch.where(unfinished, chosen, pad)
        return chosen, unfinished & ~torch.isin(chosen, ends)

    return step


WHOLE_STEPS: dict = {}  # (model, cache length, batch, greedy) -> its cache, mask and compiled step: compiled once


def whole_step_decode(model, inputs: dict, new_tokens: int, cache_length: int, steps: dict | None = None,
                      greedy: bool = False, ends=(1,), pad: int = 0) -> torch.Tensor:  # fmt: skip
    """`new_tokens` tokens after the left-padded prompts, each step `whole_step` (compiled with CUDA graphs on a GPU,
    kept in `steps` between calls), the prompt's forward (prefill) eager on the same static cache."""
    from transformers import StaticCache

    ids, prompt_mask = inputs["input_ids"], inputs["attention_mask"]
    batch, width = ids.shape
    key, steps = (id(model), cache_length, batch, greedy), {} if steps is None else steps
    if key not in steps:
        cache = StaticCache(config=model.config, max_cache_len=cache_length)
        mask = torch.ones(batch, cache_length, dtype=prompt_mask.dtype, device=ids.device)
        step = whole_step(model, cache, mask, greedy)
        steps[key] = (cache, mask, torch.compile(step, mode="reduce-overhead") if ids.is_cuda else step)
    cache, mask, compiled = steps[key]
    cache.reset()
    mask.fill_(1)
    mask[:, :width] = prompt_mask
    positions = (prompt_mask.cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                cache_position=torch.arange(width, device=ids.device), use_cache=True, logits_to_keep=1)  # fmt: skip
    ends_t, pad_t = torch.tensor(ends, device=ids.device), torch.tensor(pad, device=ids.device)
    probs = out.logits[:, -1].float().softmax(-1)
    token = probs.argmax(-1) if greedy else (probs / torch.empty_like(probs).exponential_()).argmax(-1)
    unfinished, tokens = ~torch.isin(token, ends_t), [token]
    position = positions[:, -1] + 1
    for i in range(1, new_tokens):
        if ids.is_cuda:
            torch.compiler.cudagraph_mark_step_begin()
        token, unfinished = compiled(token, position + (i - 1), torch.tensor([width + i - 1], device=ids.device),
                                     unfinished, ends_t, pad_t)  # fmt: skip
        token, unfinished = token.clone(), unfinished.clone()  # out of the graphs' pool, which the next step reuses
        tokens.append(token)
    return torch.cat([ids, torch.stack(tokens, 1)], 1)


def measure(model, inputs: dict, row: str, new_tokens: int, repeats: int) -> dict:
    """A row's wall clock and GPU busy time per step, and its busiest host ops."""
    config = generation_config(row, new_tokens, inputs["input_ids"].shape[1])
    started = time.perf_counter()
    for _ in range(2):
        call(model, inputs, config, row)
    warm_up = time.perf_counter() - started
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        steps = call(model, inputs, config, row)
        walls.append((time.perf_counter() - start) * 1e3 / steps)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        steps = call(model, inputs, config, row)
    host = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_HOST_OPS]
    return {
        "row": row, "steps": steps, "warm_up_s": warm_up, "wall_ms_per_step": statistics.median(walls),
        "busy_ms_per_step": device_busy_ms(profiler) / steps,
        "host_ops_ms_per_step": {e.key: e.self_cpu_time_total / 1e3 / steps for e in host},
    }  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="1.5B")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--out", default="benchmark-results")
    args = parser.parse_args(argv)
    rows = args.rows.split(",")
    if unknown := sorted(set(rows) - set(ROWS)):
        parser.error(f"unknown rows {unknown}: choose from {list(ROWS)}")
    if not torch.cuda.is_available():
        parser.error("this diagnostic times CUDA graphs: it needs a GPU")
    from transformers.generation import utils as generation

    from benchmarks.train import model_for

    model = model_for(args.model, torch.device("cuda")).eval()
    inputs = prompts(args.batch, model.config.vocab_size, "cuda")
    found = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
             "deferred_stop_check_in_transformers": hasattr(generation, "DeferredStopCheck"), "rows": []}  # fmt: skip
    for row in rows:
        result = measure(model, inputs, row, args.new_tokens, args.repeats)
        found["rows"].append(result)
        print(f"[decoding] {args.model} {row}: {result['wall_ms_per_step']:.2f} ms a step, GPU busy "
              f"{result['busy_ms_per_step']:.2f} ms (warm-up {result['warm_up_s']:.1f} s)", flush=True)  # fmt: skip
        for name, ms in result["host_ops_ms_per_step"].items():
            print(f"    {ms:7.3f} ms  {name}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decoding-{args.model}.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
