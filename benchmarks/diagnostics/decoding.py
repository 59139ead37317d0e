"""Where a decoding step's time goes: transformers' `generate` called as GRPOTrainer calls it (sampling, TRL's
default temperature, top-p and top-k), on a batch of prompts of 20-200 tokens left-padded to the longest, a
Qwen2.5-shaped model with random bf16 weights. Rows, one process (the compiled rows share one compiled forward):

  eager: TRL's own call (a dynamic cache, `disable_compile=True`);
  compiled: `compile_generation`'s (a static cache pinned to the prompt bucket + the new tokens, the decode step
    compiled with CUDA graphs);
  compiled-deferred: the same with "all finished?" read one step late (`rollouts.deferred_stop_check`);
  loop: `compile_generation="loop"`'s decoding (`decoding_loop`): each token's whole step (the forward on the
    static cache, the logits processors, the choice, the finished flags) one compiled function replayed as a CUDA
    graph, "all finished?" read one step late, the layers' attention over unrepeated key and value heads;
  loop-repeated: the loop with SDPA's own attention, which repeats the key and value heads for every query head;
  loop-autotune: the loop's step compiled with `mode="max-autotune"` (Inductor tunes its GEMMs for the decode
    step's shapes, CUDA graphs as well), `decoding_loop.GPU_MODE`.

No token ends a sequence here (the end token is never sampled from a near-uniform distribution over 151936), so
every call decodes `--new-tokens` steps. Per row: the wall clock per step (median of `--repeats` calls after two
warm-up calls), the GPU's busy time per step (one more call under the profiler, its device-side events once), and the
host ops and device kernels with the most time of their own in that call (per step), which say what a host-bound
step and a GPU-bound one spend on.

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

ROWS = ("eager", "compiled", "compiled-deferred", "loop", "loop-repeated", "loop-autotune")
TOP_HOST_OPS = 12
LOOPS: dict = {"loop": {}, "loop-repeated": {}, "loop-autotune": {}}  # the loop rows' compiled steps, kept


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
    from compiled_grpo.integrations.trl import decoding_loop
    from compiled_grpo.integrations.trl.rollouts import deferred_stop_check

    with torch.no_grad(), deferred_stop_check(row == "compiled-deferred"):
        if row in LOOPS:
            decoding_loop.GROUPED_ATTENTION = row != "loop-repeated"
            decoding_loop.GPU_MODE = "max-autotune" if row == "loop-autotune" else "reduce-overhead"
            out = decoding_loop.generate(model, LOOPS[row], config.max_cache_len, config, **inputs)
        else:
            out = model.generate(**inputs, generation_config=config)
    if out.is_cuda:
        torch.cuda.synchronize()
    return out.shape[1] - inputs["input_ids"].shape[1]


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
    averages = profiler.key_averages()
    host = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:TOP_HOST_OPS]
    device = sorted(averages, key=lambda e: e.self_device_time_total, reverse=True)[:TOP_HOST_OPS]
    return {
        "row": row, "steps": steps, "warm_up_s": warm_up, "wall_ms_per_step": statistics.median(walls),
        "busy_ms_per_step": device_busy_ms(profiler) / steps,
        "host_ops_ms_per_step": {e.key: e.self_cpu_time_total / 1e3 / steps for e in host},
        "device_ops_ms_per_step": {e.key: e.self_device_time_total / 1e3 / steps for e in device},
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
        for side in ("host", "device"):
            for name, ms in result[f"{side}_ops_ms_per_step"].items():
                print(f"    {side} {ms:7.3f} ms  {name[:100]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"decoding-{args.model}.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
