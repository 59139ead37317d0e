"""The step users feel: TRL 1.16's GRPOTrainer against CompiledGRPOTrainer on one micro-batch, the model's
forward included: `_compute_loss` + backward, time and peak memory, both in one process.

Model: Qwen2.5-1.5B's shape (H 1536, 28 layers, V 151936, tied embeddings) with random weights in bf16 (nothing
downloaded); micro-batch: 8 completions of 1024 tokens after 64-token prompts, random advantages, dapo.

    python -m benchmarks.trl_step [--repeats 5] [--out docs/benchmarks/trl-step.md] [--tiny]

`--tiny` runs a small model on the CPU (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer

QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=1000, tie_word_embeddings=True)  # fmt: skip


def tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def trainer(cls, model, out: Path, on_gpu: bool, completion: int, schedule: str = "auto"):
    args = GRPOConfig(
        output_dir=str(out), per_device_train_batch_size=8, num_generations=8, report_to=[], save_strategy="no",
        max_completion_length=completion, bf16=on_gpu, use_cpu=not on_gpu,
    )  # fmt: skip
    data = Dataset.from_dict({"prompt": ["a"] * 8})
    extra = {"compiled": on_gpu, "schedule": schedule} if cls is CompiledGRPOTrainer else {}
    t = cls(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
            train_dataset=data, processing_class=tokenizer(), **extra)  # fmt: skip
    t.current_gradient_accumulation_steps = 1  # set by train(); this step runs outside it
    return t


def micro_batch(vocab: int, device, B=8, P=64, C=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    inputs = {
        "prompt_ids": torch.randint(3, vocab, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, vocab, (B, C), generator=g),
        "completion_mask": torch.ones(B, C, dtype=torch.long),
        "advantages": torch.randn(B, generator=g),
    }
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()
    return {k: v.to(device) for k, v in inputs.items()}


def measure(t, inputs, repeats: int, on_gpu: bool):
    def step():
        t.model.zero_grad(set_to_none=True)
        with t.accelerator.autocast():
            loss = t._compute_loss(t.model, inputs)
        loss.backward()

    for _ in range(2):
        step()
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if on_gpu:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if on_gpu else float("nan")
    t.model.zero_grad(set_to_none=True)
    return statistics.median(times), peak


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="docs/benchmarks/trl-step.md")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--schedules", default="auto", help="CompiledGRPOTrainer's schedules to run, comma-separated")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.tiny
    device = "cuda" if on_gpu else "cpu"
    shape = TINY if args.tiny else QWEN_1_5B
    completion = 16 if args.tiny else 1024
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**shape, pad_token_id=0, eos_token_id=1, bos_token_id=1))
    model = model.to(device, torch.bfloat16 if on_gpu else torch.float32)
    inputs = micro_batch(shape["vocab_size"], device, C=completion)
    rows = []
    runs = [(GRPOTrainer, "")] + [(CompiledGRPOTrainer, s) for s in args.schedules.split(",")]
    for cls, schedule in runs:
        t = trainer(cls, model, Path("/tmp") / cls.__name__, on_gpu, completion, schedule or "auto")
        ms, peak = measure(t, inputs, args.repeats, on_gpu)
        name = cls.__name__ + (f' (schedule="{schedule}")' if schedule else "")
        rows.append({"trainer": name, "ms": ms, "peak_gib": peak})
        print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name() if on_gpu else "CPU"
    import transformers
    import trl

    lines = [
        "# TRL step: GRPOTrainer against CompiledGRPOTrainer",
        "",
        f"{name}; torch {torch.__version__}, TRL {trl.__version__}, transformers {transformers.__version__}. "
        f"{'Qwen2.5-1.5B shape, random bf16 weights' if not args.tiny else 'tiny model'}; one micro-batch of 8 x "
        f"{completion} completion tokens after 64-token prompts, dapo; `_compute_loss` (the model's forward "
        f"included) + backward, median of {args.repeats} after 2 warm-ups; peak memory above the model and inputs.",
        "",
        "| trainer | step (ms) | peak memory (GiB) |",
        "|---|---|---|",
        *[f"| {r['trainer']} | {r['ms']:.1f} | {r['peak_gib']:.2f} |" for r in rows],
        "",
        *[f"{r['trainer']}: {rows[0]['ms'] / r['ms']:.2f}x GRPOTrainer's speed." for r in rows[1:]],
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
