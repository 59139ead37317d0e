"""The step users wait for: `trainer.train()` itself, generation included, one trainer per process.

Each row is a real `train()` run in a process of its own (the trainers compile the shared model's layers and decode
step in place, and an empty Inductor cache per process unless the row says it is warm): TRL's `GRPOConfig` defaults
(gradient checkpointing on, transformers' `generate`, no vLLM), 4 prompts x 8 completions per optimizer step
(`per_device_train_batch_size=8`, `gradient_accumulation_steps=4`), prompts of 20-200 tokens (512 in rows marked
`512-token prompts`), completions of at most 256 tokens that end at EOS. The models are Qwen2.5's shapes with random
bf16 weights (nothing downloaded); a random model's next-token distribution is nearly uniform, so the model declares
one token in 95 an end of sequence (`generation_config.eos_token_id`, as chat models declare their end-of-turn
tokens) and completions end after about 95 tokens, a few at the limit. The reward is the share of a completion's
tokens with an even id (noise, so every group has a spread and trains). Per optimizer step: the wall clock (between
the ends of consecutive steps), generation (TRL's `_generate_single_turn`, synchronized), the rest of the step
(rewards, old log-probs, the loss's forwards and backwards, the optimizer), graphs dynamo compiled during generation
and outside it, CUDA graphs recorded (Inductor's CUDA-graph trees: the decode step's and a graphed stack's), the
mean completion length; per run: the peak memory (allocated, and reserved: CUDA graphs' pools whole), and the GPU's
busy time of one more step under the profiler (its kernels' time, each counted once). The first two steps
(compiling) are reported apart from the median of the rest. Each row's process logs dynamo's recompilations with the
guard that failed (its stderr), so that a graph compiled in a later step can be traced to its call.

    python -m benchmarks.train --model 1.5B [--rows grpo,grpo-compiled-decoding,default,eager-generation]
        [--steps 10] [--warm] [--workload mixed|long] [--out benchmark-results]
    python -m benchmarks.train --report benchmark-results/train-*.json [--out docs/benchmarks/train]

The first writes `train-<model>.json` row by row (a row's timed steps before its profiled step: a run stopped there,
by a time limit say, keeps them, marked); `--warm` adds the default row again on the Inductor cache the
first default row filled; `--workload long` gives every prompt 512 tokens (rows `default` and `default-noshare`
show what sharing a group's prompt saves) and writes `train-<model>-long.json`. `--report` joins such files into
`train.md` and `train.png`. `--model tiny` runs a small model on the CPU (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS = {
    "grpo": "GRPOTrainer",
    "grpo-compiled-decoding": "GRPOTrainer, compiled decoding by hand",
    "default": "CompiledGRPOTrainer (defaults)",
    "default-warm": "CompiledGRPOTrainer (defaults), warm Inductor cache",
    "eager-generation": "CompiledGRPOTrainer, compile_generation=False",
    "default-noshare": "CompiledGRPOTrainer, share_prompts=False",
    "default-stack": 'CompiledGRPOTrainer, compile_backbone="stack"',
    "default-graphs": 'CompiledGRPOTrainer, compile_backbone="stack-graphs"',
    "default-step": "CompiledGRPOTrainer, compile_generation=True (transformers' compiled decode step)",
    "default-deferred": "CompiledGRPOTrainer, compile_generation=True, the stop decided one step late "
    "(rollouts.DEFERRED_STOP_CHECK)",
    "default-loop": 'CompiledGRPOTrainer, compile_generation="loop"',
}
PROMPTS, GENERATIONS, MICRO_BATCH, ACCUMULATION = 4, 8, 8, 4
LONG_PROMPT = 512  # `--workload long`: every prompt this long (a long system prompt, tool outputs)
MAX_COMPLETION, EOS_SHARE = 256, 95  # one token in EOS_SHARE ends a completion
GENERATION_RANGE = "train-benchmark.generation"


def dataset(vocab: int, steps: int, seed: int = 0, workload: str = "mixed"):
    """`PROMPTS` prompts a step, of 20-200 random tokens each (`LONG_PROMPT` under the long workload), as text the
    word-level tokenizer maps back to them."""
    from datasets import Dataset

    rng = random.Random(seed)
    size = (lambda: LONG_PROMPT) if workload == "long" else (lambda: rng.randint(20, 200))
    texts = [" ".join(f"t{rng.randrange(3, vocab)}" for _ in range(size()))
             for _ in range(PROMPTS * (steps + 2))]  # fmt: skip
    return Dataset.from_dict({"prompt": texts})


def tokenizer(vocab: int):
    """A word-level tokenizer with a word per id of the model's vocabulary (`t<id>`): any sampled id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def even_share(completion_ids, **kwargs) -> list[float]:
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def model_for(name: str, device):
    """Qwen2.5-shaped model with random weights whose generation config ends a completion at one token in 95."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from benchmarks.trl_step import QWEN

    vocab = 1000 if name == "tiny" else 151936
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN[name], vocab_size=vocab, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    ends = random.Random(1).sample(range(3, vocab), vocab // EOS_SHARE)
    model.generation_config.eos_token_id = [1, *ends]
    return model


class StepClock:
    """Each optimizer step's wall clock (end to end), its generation time, the graphs compiled while generating and
    outside it, and the CUDA graphs recorded (a graph recorded in a later step is a new shape met)."""

    def __init__(self, trainer, on_gpu: bool):
        import torch
        from transformers import TrainerCallback

        from compiled_grpo.integrations.trl.regional_compile import compiled_graphs

        self.steps, self.generation, self.compiled, self.sync = [], 0.0, 0, torch.cuda.synchronize if on_gpu else None
        self.on_gpu = on_gpu
        self.counts = self.graph_counts()
        original = trainer._generate_single_turn

        def timed_generation(*args, **kwargs):
            self.settle()
            start, graphs = time.perf_counter(), compiled_graphs()
            with torch.profiler.record_function(GENERATION_RANGE):  # where `BusyStep` finds the generation's kernels
                result = original(*args, **kwargs)
                self.settle()
            self.generation += time.perf_counter() - start
            self.compiled += compiled_graphs() - graphs
            return result

        trainer._generate_single_turn = timed_generation
        clock = self

        class Ends(TrainerCallback):
            def on_train_begin(self, *args, **kwargs):
                clock.settle()
                clock.last = time.perf_counter()

            def on_step_end(self, *args, **kwargs):
                clock.settle()
                now = time.perf_counter()
                counts = clock.graph_counts()
                compiled, recorded = (after - before for after, before in zip(counts, clock.counts, strict=True))
                clock.steps.append({"wall_s": now - clock.last, "generation_s": clock.generation,
                                    "generation_graphs": clock.compiled, "training_graphs": compiled - clock.compiled,
                                    "cuda_graphs": recorded})  # fmt: skip
                clock.last, clock.generation, clock.compiled, clock.counts = now, 0.0, 0, counts

        trainer.add_callback(Ends())

    def settle(self) -> None:
        if self.sync is not None:
            self.sync()

    def graph_counts(self) -> tuple[int, int]:
        """(graphs dynamo compiled so far, CUDA graphs Inductor's trees hold on this GPU; 0 on the CPU)."""
        from compiled_grpo.integrations.trl.regional_compile import compiled_graphs
        from compiled_grpo.integrations.trl.stack_graphs import cuda_graphs_recorded

        return compiled_graphs(), cuda_graphs_recorded()[0] if self.on_gpu else 0


class BusyStep:
    """The GPU's busy time of one optimizer step (`step`), from the profiler's device-side events (each kernel, copy
    and set counted once, CUDA graphs' kernels included), all of it and its generation's (the kernels that start
    inside the generation's range, which ends with a synchronize). The host's activity is profiled too (for the
    range), so that step's wall clock is a little longer than the others'."""

    def __init__(self, trainer, step: int):
        from transformers import TrainerCallback

        busy = self
        self.ms, self.generation_ms, self.profiler = None, None, None

        class Profile(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == step - 1:
                    busy.start()
                elif state.global_step == step and busy.profiler is not None:
                    busy.stop()

        trainer.add_callback(Profile())

    def start(self) -> None:
        import torch

        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()

    def stop(self) -> None:
        import torch

        from benchmarks.timing import device_busy_ms

        torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        ranges = [e.time_range for e in self.profiler.events() if e.name == GENERATION_RANGE]
        kernel = lambda e: e.name != GENERATION_RANGE  # noqa: E731  (the range's own device-side annotation is not)
        self.ms = device_busy_ms(self.profiler, kernel)
        inside = lambda e: kernel(e) and any(r.start <= e.time_range.start <= r.end for r in ranges)  # noqa: E731
        self.generation_ms = device_busy_ms(self.profiler, inside) if ranges else None


def run_row(row: str, model_name: str, steps: int, workload: str = "mixed", keep=None) -> dict:
    """One `train()` run of `row` (in this process), its per-step times, peak memory and GPU busy time; `keep` (where
    given) is handed the row as it stands after the timed steps, before the profiled one."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from compiled_grpo.integrations.trl import CompiledGRPOTrainer

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    torch._logging.set_logs(recompiles=True)  # a graph compiled after the first steps says which guard failed
    model = model_for(model_name, device)
    vocab = model.config.vocab_size
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="train-bench-"), per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=ACCUMULATION, num_generations=GENERATIONS,
        max_completion_length=MAX_COMPLETION if model_name != "tiny" else 16, max_steps=steps + on_gpu,
        learning_rate=1e-6, logging_steps=1, report_to=[], save_strategy="no", seed=0, bf16=on_gpu,
        use_cpu=not on_gpu, cache_implementation="static" if row == "grpo-compiled-decoding" else None,
    )  # fmt: skip
    cls = GRPOTrainer if row.startswith("grpo") else CompiledGRPOTrainer
    options = {"eager-generation": {"compile_generation": False}, "default-noshare": {"share_prompts": False},
               "default-loop": {"compile_generation": "loop"}, "default-step": {"compile_generation": True},
               "default-deferred": {"compile_generation": True},
               "default-stack": {"compile_backbone": "stack"},
               "default-graphs": {"compile_backbone": "stack-graphs"}}  # fmt: skip
    trainer = cls(model=model, reward_funcs=even_share, args=args, train_dataset=dataset(vocab, steps + 1, 0, workload),
                  processing_class=tokenizer(vocab), **options.get(row, {}))  # fmt: skip
    if row == "grpo-compiled-decoding":  # what a user can do by hand: TRL's own config, compiling allowed
        trainer.generation_config.disable_compile = False
    if row == "default-deferred":  # this row's process only
        from compiled_grpo.integrations.trl import rollouts

        rollouts.DEFERRED_STOP_CHECK = True
    clock = StepClock(trainer, on_gpu)
    busy = BusyStep(trainer, steps + 1) if on_gpu else None
    measured = lambda: results(row, label(model_name, workload), trainer, clock, busy, steps)  # noqa: E731
    if keep is not None:  # on a GPU a profiled step follows the timed ones
        keep_before(trainer, steps, lambda: keep({**measured(), "partial": PARTIAL}))
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    return measured()


PARTIAL = "stopped during its profiled step, after the timed ones: no GPU busy time"


def keep_before(trainer, step: int, save) -> None:
    """`save()` called as the trainer begins the optimizer step after `step` (its logs in)."""
    from transformers import TrainerCallback

    class Before(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step:
                save()

    trainer.add_callback(Before())


def keep_partial(path: Path, row: dict) -> None:
    """A row as it stands before its profiled step, added to the sweep's file: a run stopped there (a time limit)
    keeps its timed steps; the sweep writes the whole row over it when the row ends."""
    data = json.loads(path.read_text())
    data["rows"].append(row)
    path.write_text(json.dumps(data, indent=1))


def results(row: str, model: str, trainer, clock, busy, steps: int) -> dict:
    """A run's row: its timed steps, generation's compiles, peak memory and (after the profiled step) busy time."""
    import torch

    on_gpu = torch.cuda.is_available()
    lengths = [e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e]
    for step, length in zip(clock.steps, lengths, strict=False):
        step["mean_completion"] = length
    compiles = getattr(trainer, "generation_compiles", None)
    shared = [e["shared_prompts/saved_tokens"] for e in trainer.state.log_history if "shared_prompts/saved_tokens" in e]
    return {
        "row": row, "model": model, "steps": clock.steps[:steps],
        "busy_ms": busy.ms if busy else None, "generation_busy_ms": busy.generation_ms if busy else None,
        "shared_prompt_tokens": statistics.mean(shared) if shared else 0.0,
        "busy_step_s": clock.steps[steps]["wall_s"] if on_gpu and len(clock.steps) > steps else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        # what the allocator held at most: CUDA graphs' pools (compiled decoding's, the stack's) free parts included
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if on_gpu else None,
        "compile_generation": getattr(trainer, "compile_generation", None),
        "generation_fallback": compiles.fallback if compiles else None,
        "generation_cache_lengths": [length for length, _, _ in compiles.compiles] if compiles else None,
    }  # fmt: skip


def label(model: str, workload: str) -> str:
    """A run's model as reports name it: the model, and the long workload's prompts."""
    return model if workload == "mixed" else f"{model}, {LONG_PROMPT}-token prompts"


def versions() -> dict:
    import importlib.metadata as md

    import torch

    from benchmarks.timing import run_date

    found = {"torch": torch.__version__, "date": run_date(), "host": os.uname().nodename}
    for package in ("transformers", "trl", "accelerate"):
        found[package] = md.version(package)
    found["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    found["cpu"] = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name")), "?")  # fmt: skip
    return found


def sweep(args) -> None:
    """Each row in a child process, in order; the JSON rewritten after each."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"train-{args.model}{'-long' if args.workload == 'long' else ''}.json"
    rows = args.rows.split(",") + (["default-warm"] if args.warm else [])
    data = {"versions": versions(), "rows": []}
    path.write_text(json.dumps(data, indent=1))  # each row adds its timed steps to it before its profiled step
    shared_cache = tempfile.mkdtemp(prefix="inductor-default-")
    for row in rows:
        cache = shared_cache if row in ("default", "default-warm") else tempfile.mkdtemp(prefix=f"inductor-{row}-")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONUNBUFFERED": "1"}
        result = Path(tempfile.mkdtemp()) / "row.json"
        command = [sys.executable, "-m", "benchmarks.train", "--model", args.model, "--steps", str(args.steps),
                   "--workload", args.workload, "--child", row, "--child-out", str(result),
                   "--sweep-out", str(path)]  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(command, env=env, check=False)
        if done.returncode or not result.exists():
            failed = {"row": row, "model": label(args.model, args.workload), "error": f"exit {done.returncode}"}
            kept = json.loads(path.read_text())["rows"][len(data["rows"]) :]  # its timed steps, where it got that far
            data["rows"].append({**kept[-1], **failed} if kept else failed)
        else:
            data["rows"].append(json.loads(result.read_text()))
        print(f"[train] {args.model} {row}: {time.perf_counter() - started:.0f} s", flush=True)
        path.write_text(json.dumps(data, indent=1))
    print(summary_lines(data["rows"]))


def summary(row: dict) -> dict | None:
    """A run's figures: the median step after the first two (s), its generation and the rest, the first two steps."""
    steps = row.get("steps") or []
    if len(steps) < 3:
        return None
    later = steps[2:]
    median = statistics.median(s["wall_s"] for s in later)
    generation = statistics.median(s["generation_s"] for s in later)
    return {
        "median_s": median, "generation_s": generation, "rest_s": statistics.median(
            s["wall_s"] - s["generation_s"] for s in later),
        "first_two_s": steps[0]["wall_s"] + steps[1]["wall_s"], "longest_later_s": max(s["wall_s"] for s in later),
        "later_graphs": sum(s["generation_graphs"] for s in later),
        "first_graphs": sum(s["generation_graphs"] for s in steps[:2]),
        "later_training_graphs": later_sum(later, "training_graphs"),
        "later_cuda_graphs": later_sum(later, "cuda_graphs"),
        "mean_completion": statistics.mean(s.get("mean_completion", 0) for s in steps),
    }  # fmt: skip


def later_sum(later: list[dict], key: str) -> int | None:
    """The later steps' sum of `key`, None where the run was stored before it was counted."""
    return sum(s[key] for s in later) if all(key in s for s in later) else None


def run_of(row: dict) -> tuple[str, str]:
    """(model, machine) of a row: the rows whose speed-ups share one GRPOTrainer run (machine "" outside a report)."""
    return row["model"], row.get("machine", "")


def summary_lines(rows: list[dict]) -> str:
    lines = [
        "| model | machine | run | median step (s) | speed-up | generation (s) | rest of the step (s) | GPU busy, one "
        "step (s) | first two steps (s) | longest later step / median | generation graphs (first two steps + later) "
        "| graphs after the first two steps, outside generation (compiled, CUDA graphs recorded) "
        "| peak GiB (allocated, reserved) | mean completion | prompt tokens shared, per micro-batch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model, machine in dict.fromkeys(map(run_of, rows)):
        mine = {r["row"]: r for r in rows if run_of(r) == (model, machine)}
        base = summary(mine.get("grpo", {}))  # the speed-ups within one machine's run
        for name, row in mine.items():
            s = summary(row)
            stopped = f" ({row['partial']})" if row.get("partial") else ""
            model_cell = f"| {model} | {machine} | {ROWS[name]}{stopped} |"
            if s is None:
                lines.append(f"{model_cell} {row.get('error', 'too few steps')} |" + " |" * 11)
                continue
            speed = f"{base['median_s'] / s['median_s']:.2f}x" if base else "-"
            busy = f"{row['busy_ms'] / 1e3:.2f} of {row['busy_step_s']:.2f}" if row.get("busy_ms") else "-"
            if row.get("generation_busy_ms") is not None:
                busy += f" (generation {row['generation_busy_ms'] / 1e3:.2f})"
            peak = f"{row['peak_gib']:.2f}" if row.get("peak_gib") is not None else "-"
            if row.get("peak_reserved_gib") is not None:
                peak += f" ({row['peak_reserved_gib']:.2f} reserved)"
            lines.append(
                f"{model_cell} {s['median_s']:.2f} | {speed} | {s['generation_s']:.2f} | "
                f"{s['rest_s']:.2f} | {busy} | {s['first_two_s']:.1f} | {s['longest_later_s'] / s['median_s']:.2f} | "
                f"{s['first_graphs']} + {s['later_graphs']} | {training_graphs(s)} | {peak} | "
                f"{s['mean_completion']:.0f} | "
                f"{row.get('shared_prompt_tokens', 0.0):.0f} |"
            )
    return "\n".join(lines)


def training_graphs(s: dict) -> str:
    """The later steps' graphs outside generation, "-" for runs stored before they were counted."""
    if s["later_training_graphs"] is None:
        return "-"
    return f"{s['later_training_graphs']}, {s['later_cuda_graphs']}"


def clip_at(ax, rows: list[dict], width: float) -> None:
    """A linear axis sized to the later steps (a log axis hides stacked parts): the compiling steps above it are cut
    and their totals written on them."""
    top = 1.3 * max(s["wall_s"] for r in rows for s in r["steps"][2:] or r["steps"])
    ax.set_ylim(0, top)
    for i, row in enumerate(rows):
        for k, step in enumerate(row["steps"]):
            if step["wall_s"] > top:
                ax.text(k + i * width, 0.97 * top, f"{step['wall_s']:.0f} s", ha="center", va="top", fontsize=7)


def draw(rows: list[dict], path: Path, title: str) -> None:
    """Each run's steps as stacked bars (generation below, the rest of the step above), a panel per model and
    machine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys(run_of(r) for r in rows if r.get("steps")))
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 3.6 * len(panels)), squeeze=False)
    for ax, (model, machine) in zip(axes[:, 0], panels, strict=True):
        mine = [r for r in rows if run_of(r) == (model, machine) and r.get("steps")]
        width = 0.8 / len(mine)
        for i, row in enumerate(mine):
            x = [k + i * width for k in range(len(row["steps"]))]
            generation = [s["generation_s"] for s in row["steps"]]
            rest = [s["wall_s"] - s["generation_s"] for s in row["steps"]]
            color = plt.cm.tab10(list(ROWS).index(row["row"]))
            ax.bar(x, generation, width, color=color, label=f"{ROWS[row['row']]}: generation")
            ax.bar(x, rest, width, bottom=generation, color=color, alpha=0.45, hatch="//", label="  rest of the step")
        clip_at(ax, mine, width)
        ax.set_xticks([k + 0.4 - width / 2 for k in range(max(len(r["steps"]) for r in mine))])
        ax.set_xticklabels([str(k + 1) for k in range(max(len(r["steps"]) for r in mine))])
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("seconds")
        ax.set_title(f"{model} ({machine or 'one machine'}): each step's generation (solid) and the rest (hatched)")
        ax.legend(fontsize=7, ncol=2, loc="upper right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(args) -> None:
    rows, machines = [], {}
    for name in args.report:
        data = json.loads(Path(name).read_text())
        found = data["versions"]
        machine = f"{found['gpu'].removeprefix('NVIDIA ')}, {found['date']}"
        machines[machine] = found
        rows += [{**row, "machine": machine} for row in data["rows"]]
    versions = "; ".join(
        f"{machine}: torch {found['torch']}, transformers {found['transformers']}, TRL {found['trl']}, "
        f"accelerate {found['accelerate']}" for machine, found in machines.items())  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# `trainer.train()`: the whole optimizer step, generation included",
        "",
        f"Machines (GPU, date of the run): {versions}. " + __doc__.split("\n\n")[1].replace("\n", " "),
        "",
        "`speed-up`: GRPOTrainer's median step over the row's. `GPU busy`: the device time of the step after the "
        "timed ones, of that step's wall clock under the profiler (the generation's part in brackets, where measured). "
        "`generation graphs`: graphs dynamo compiled "
        "while generating, in the first two steps and in the later ones (a later one is a recompile).",
        "",
        summary_lines(rows),
        "",
        "![each step's generation and the rest](train.png)",
        "",
    ]
    (out / "train.md").write_text("\n".join(lines))
    draw(rows, out / "train.png", f"train(); {', '.join(machines)}")
    print("\n".join(lines))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1.5B", choices=["tiny", "0.5B", "1.5B", "7B"])
    parser.add_argument("--rows", default="grpo,grpo-compiled-decoding,default,eager-generation")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--workload", default="mixed", choices=["mixed", "long"],
                        help=f"prompts of 20-200 tokens (mixed) or of {LONG_PROMPT} (long)")  # fmt: skip
    parser.add_argument("--warm", action="store_true", help="the default row again, on its own Inductor cache")
    parser.add_argument("--out", default="benchmark-results")
    parser.add_argument("--report", nargs="+")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    parser.add_argument("--sweep-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.report:
        report(args)
    elif args.child:
        if args.child not in ROWS:
            parser.error(f"--child: unknown row {args.child!r}")
        row = "default" if args.child == "default-warm" else args.child
        keep = None
        if args.sweep_out:
            keep = lambda partial: keep_partial(Path(args.sweep_out), {**partial, "row": args.child})  # noqa: E731
        result = run_row(row, args.model, args.steps, args.workload, keep)
        Path(args.child_out).write_text(json.dumps({**result, "row": args.child}))
    else:
        for row in args.rows.split(","):
            if row not in ROWS:
                parser.error(f"--rows: unknown row {row!r} (one of {', '.join(ROWS)})")
        sweep(args)


if __name__ == "__main__":
    main()
