"""GRPOTrainer and CompiledGRPOTrainer trained side by side from the same seed: reward and loss per step overlaid,
the per-step loss difference, the first step whose sampled completions differ, step time (and peak memory on a
GPU).

The task is `examples/train_trl_grpo.py`'s: a tiny random Llama, a word-level tokenizer built here, one point of
reward per digit in a completion, top_entropy_quantile = 0.2, dapo. Both runs start from the same weights and
seed, so they sample the same completions until the two losses' rounding (float32 sums in different orders) has
moved the weights enough to flip a sampled token; from then on their batches differ and the curves are two runs
of the same training, not the same run.

    python -m benchmarks.side_by_side [--steps 60] [--lr 5e-3] [--out benchmark-results/side-by-side]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import set_seed
from trl import GRPOConfig, GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer
from examples.train_trl_grpo import digit_reward, local_tokenizer, tiny_llama


def train(cls, steps: int, out: Path, on_gpu: bool, learning_rate: float) -> dict:
    """One run: per step the logged loss and reward, and every completion the reward function saw."""
    set_seed(0)
    tokenizer = local_tokenizer()
    model = tiny_llama(len(tokenizer))
    seen: list[list[str]] = []

    def reward(completions, **kwargs):
        seen.append(list(completions))
        return digit_reward(completions)

    reward.__name__ = "digit_reward"
    config = GRPOConfig(
        output_dir=str(out / cls.__name__), max_steps=steps, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, learning_rate=learning_rate, loss_type="dapo", top_entropy_quantile=0.2,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=not on_gpu, bf16=on_gpu, seed=0,
    )  # fmt: skip
    prompts = Dataset.from_dict({"prompt": ["a b c", "d e f", "1 2 a", "g h i", "j a b", "c 3 d"] * 20})
    extra = {"compiled": True} if cls is CompiledGRPOTrainer else {}
    trainer = cls(model=model, reward_funcs=reward, args=config, train_dataset=prompts, processing_class=tokenizer,
                  **extra)  # fmt: skip
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    started = time.time()
    trainer.train()
    seconds = time.time() - started
    logs = [e for e in trainer.state.log_history if "loss" in e and "reward" in e]
    return {
        "trainer": cls.__name__,
        "loss": [e["loss"] for e in logs],
        "reward": [e["reward"] for e in logs],
        "entropy": [e["entropy"] for e in logs],
        "completions": seen,
        "seconds": seconds,
        "median_step_s": statistics.median(e["step_time"] for e in logs),  # TRL's own per-step timer
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
        "parameters": {n: p.detach().float().cpu() for n, p in trainer.model.named_parameters()},
    }


def first_divergence(a: list, b: list) -> int | None:
    """The first step (1-based) whose sampled completions differ, None if none does."""
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def draw(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for run, style in zip(runs, ("-", "--"), strict=True):
        steps = range(1, len(run["loss"]) + 1)
        axes[0].plot(steps, run["reward"], style, label=run["trainer"])
        axes[1].plot(steps, run["loss"], style, label=run["trainer"])
    for key, style in (("loss", "k.-"), ("entropy", "b.-")):
        gap = [abs(x - y) for x, y in zip(runs[0][key], runs[1][key], strict=False)]
        axes[2].semilogy(range(1, len(gap) + 1), [max(g, 1e-12) for g in gap], style, label=f"|{key} difference|")
    axes[2].legend(fontsize=8)
    for ax, name in zip(axes, ("mean reward", "loss", "differences between the runs (floor 1e-12)"), strict=True):
        ax.set_xlabel("step")
        ax.set_title(name, fontsize=9)
    axes[0].legend(fontsize=8)
    split = first_divergence(runs[0]["completions"], runs[1]["completions"])
    if split is not None:
        for ax in axes:
            ax.axvline(split, color="grey", ls=":", lw=1)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--out", default="benchmark-results/side-by-side")
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [train(cls, args.steps, out, on_gpu, args.lr) for cls in (GRPOTrainer, CompiledGRPOTrainer)]
    split = first_divergence(runs[0]["completions"], runs[1]["completions"])
    before = (split or args.steps + 1) - 1  # steps whose completions were the same in both runs
    pairs = lambda key: zip(runs[0][key][:before], runs[1][key][:before], strict=True)
    gap = lambda key: max((abs(x - y) for x, y in pairs(key)), default=None)
    weights = runs[0].pop("parameters"), runs[1].pop("parameters")
    drift = max(float((weights[1][n] - w).abs().max() / w.abs().max().clamp(min=1e-30)) for n, w in weights[0].items())
    where = torch.cuda.get_device_name() if on_gpu else "CPU"
    summary = {
        "device": where,
        "torch": torch.__version__,
        "steps": args.steps,
        "first_step_with_different_completions": split,
        "largest_loss_difference_while_the_same": gap("loss"),
        "largest_entropy_difference_while_the_same": gap("entropy"),
        "final_parameters_largest_relative_difference": drift,
        "runs": [{k: v for k, v in r.items() if k != "completions"} for r in runs],
    }
    (out / "side-by-side.json").write_text(json.dumps(summary, indent=1))
    title = (f"GRPOTrainer (solid) and CompiledGRPOTrainer (dashed), same seed, top_entropy_quantile=0.2, {where}; "
             f"dotted line: first step whose sampled completions differ ({split or 'none in this run'})")  # fmt: skip
    draw(runs, out / "side-by-side.png", title)
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}))
    for r in runs:
        print(f"{r['trainer']}: median step {r['median_step_s'] * 1e3:.0f} ms ({r['seconds']:.0f} s in all, compiles "
              f"included), final reward {r['reward'][-1]:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
