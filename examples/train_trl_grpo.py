"""TRL 1.16's GRPOTrainer with compiled_grpo's fused loss: `CompiledGRPOTrainer` is a drop-in for `GRPOTrainer`.

By default it runs offline on a CPU: a tiny random Llama, a word-level tokenizer built here,
and a toy reward (a completion earns one point per digit greater than the digit before it: digits in rising
order, at most 9 points), with top_entropy_quantile = 0.2 (only the 20% highest-entropy tokens get a policy
gradient). The reward climbs over the whole run without reaching its maximum, and each logging window shows the
share of groups whose completions all scored alike (`frac_reward_zero_std`): their sequences have advantage 0,
and the trainer skips their backward. With `--model NAME` it trains a real checkpoint instead (a GPU and the
model's files, from the Hub or a local folder, are needed then).

    python examples/train_trl_grpo.py [--steps 30] [--model Qwen/Qwen2.5-0.5B-Instruct] [--out trl-grpo-run]

Needs `pip install -e ".[test]"` (TRL 1.16.0, transformers, datasets).
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig

from compiled_grpo.integrations.trl import CompiledGRPOTrainer

WORDS = [str(i) for i in range(10)] + list("abcdefghij")


def local_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over digits and letters, built here: nothing to download."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def digit_reward(completions, **kwargs) -> list[float]:
    """One point per digit in the completion (a toy task a tiny model learns in a few dozen steps)."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def ascending_digits(completions, **kwargs) -> list[float]:
    """One point per digit greater than the digit before it (a task a tiny model keeps improving on for 30 steps)."""
    rewards = []
    for completion in completions:
        digits = [int(word) for word in completion.split() if word.isdigit()]
        pairs = zip(digits, digits[1:], strict=False)  # each digit with the one after it
        rewards.append(float(sum(later > earlier for earlier, later in pairs)))
    return rewards


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model", default=None, help="a checkpoint to train instead of the tiny random Llama")
    ap.add_argument("--out", default="trl-grpo-run", help="TRL's output_dir")
    ap.add_argument("--eager", action="store_true", help="run the loss's tiles eagerly (no torch.compile)")
    args = ap.parse_args(argv)
    # TRL 1.16 calls transformers' gradient-checkpointing methods by their old names, which transformers 5.24 renamed
    # (`activation_checkpointing_*`): a deprecation notice on every step that nothing here can act on.
    warnings.filterwarnings("ignore", r"`(is_)?gradient_checkpointing\w*` is deprecated", FutureWarning)
    on_gpu = torch.cuda.is_available()
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16 if on_gpu else torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    else:
        tokenizer = local_tokenizer()
        model = tiny_llama(len(tokenizer))
    config = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=12,
        learning_rate=1e-2 if args.model is None else 1e-6,
        loss_type="dapo",
        top_entropy_quantile=0.2,
        logging_steps=5,
        report_to=[],
        save_strategy="no",
        use_cpu=not on_gpu,
        bf16=on_gpu,  # on a CPU: float32 (TRL's CPU default); on a GPU: bf16 autocast, 16-bit lm_head GEMMs
    )
    prompts = Dataset.from_dict({"prompt": ["a b c", "d e f", "1 2 a", "g h i", "j a b", "c 3 d"] * 20})
    trainer = CompiledGRPOTrainer(
        model=model,
        reward_funcs=ascending_digits,
        args=config,
        train_dataset=prompts,
        processing_class=tokenizer,
        compiled=not args.eager,
    )
    started = time.time()
    trainer.train()
    windows = [entry for entry in trainer.state.log_history if "reward" in entry]
    rewards = ", ".join(f"{window['reward']:.2f}" for window in windows)
    zeros = ", ".join(f"{window['frac_reward_zero_std']:.0%}" for window in windows)
    print(f"{args.steps} steps in {time.time() - started:.0f} s; mean reward per logging window: {rewards}; "
          f"groups at advantage 0 (no backward): {zeros}")  # fmt: skip


if __name__ == "__main__":
    main()
