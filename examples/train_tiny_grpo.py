"""A self-contained GRPO loop in plain torch: a tiny causal transformer learns a toy task from a programmatic
reward, trained with compiled_grpo's fused loss and top_entropy_quantile (only the 20% highest-entropy tokens
get a policy gradient, as in "Beyond the 80/20 Rule").

Task: the prompt is one token; a completion of 8 tokens earns the fraction of its tokens equal to the prompt
token plus one (mod the vocabulary). A random policy scores about 1/16.

    python examples/train_tiny_grpo.py [--steps 120] [--eager] [--out reward_curve.png]

Needs torch, and matplotlib for the curve (`pip install -e ".[audit]"`). How long it takes on a 2-core CPU is in
README's quick-start table (measured by CI; the first run compiles the tiles, later ones find them in Inductor's
cache).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from compiled_grpo import FusedLinearGRPOLoss

VOCAB, LENGTH, WIDTH = 16, 8, 64


class TinyCausalLM(nn.Module):
    """Two pre-norm transformer layers; `hidden` gives the final states that the lm_head projects."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Embedding(LENGTH + 1, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, nhead=4, dim_feedforward=4 * WIDTH, batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(n)
        x = self.embed(tokens) + self.position(torch.arange(n))
        return self.norm(self.layers(x, mask=causal, is_causal=True))

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor) -> torch.Tensor:
        tokens = prompts
        for _ in range(LENGTH):
            logits = self.lm_head(self.hidden(tokens)[:, -1])
            tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1)], dim=1)
        return tokens[:, prompts.shape[1] :]


def reward(prompts: torch.Tensor, completions: torch.Tensor) -> torch.Tensor:
    return (completions == (prompts + 1) % VOCAB).float().mean(-1)


def group_advantages(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """GRPO's advantage: each completion's reward against its group's mean, scaled by the group's spread."""
    r = rewards.view(-1, group)
    return ((r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-4)).view(-1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--eager", action="store_true", help="run the loss's tiles eagerly instead of compiled")
    ap.add_argument("--out", default="reward_curve.png")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    model = TinyCausalLM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss_fn = FusedLinearGRPOLoss(loss_type="dapo", top_entropy_quantile=0.2, compiled=not args.eager)
    curve, started = [], time.time()
    for step in range(1, args.steps + 1):
        prompts = torch.randint(0, VOCAB, (args.prompts, 1)).repeat_interleave(args.group, dim=0)
        completions = model.sample(prompts)
        rewards = reward(prompts, completions)
        sequence = torch.cat([prompts, completions], dim=1)
        hidden = model.hidden(sequence)[:, :-1]  # the state before each completion token predicts it
        out = loss_fn(hidden, model.lm_head.weight, completions, torch.ones_like(completions),
                      group_advantages(rewards, args.group))  # fmt: skip
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        curve.append(rewards.mean().item())
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(
                f"step {step:4d}/{args.steps}  reward {curve[-1]:.3f}  entropy {out.metrics['entropy'].item():.3f}"
                f"  tokens trained {int(out.entropy_mask.sum())}/{out.entropy_mask.numel()}"
                f"  {time.time() - started:5.1f}s",
                flush=True,
            )
    save_curve(curve, args.out)
    first, last = sum(curve[:10]) / 10, sum(curve[-10:]) / 10
    print(f"mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}; curve saved to {args.out}")


def save_curve(curve: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(curve) + 1), curve, lw=1, alpha=0.5, label="reward per step")
    window = 10
    smooth = [sum(curve[max(0, i - window + 1) : i + 1]) / min(i + 1, window) for i in range(len(curve))]
    ax.plot(range(1, len(curve) + 1), smooth, lw=2, label=f"mean of the last {window}")
    ax.axhline(1 / VOCAB, color="gray", ls="--", label="random policy")
    ax.set(xlabel="step", ylabel="reward", title="Tiny GRPO with compiled_grpo (top_entropy_quantile=0.2)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
