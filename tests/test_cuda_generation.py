"""On a GPU (skipped elsewhere): `compile_generation="auto"` decodes on the trainer's own loop (`decoding_loop`: each
token's whole step one CUDA graph). `train()` with every default (compiled layers, gradient checkpointing) over 10
steps of prompts of 5-250 tokens compiles the loop's step once (one prompt bucket) and never again; in float32 (TF32
off) its greedy tokens equal TRL's eager generation over prompts of varied lengths. On transformers' compiled decode
step (`compile_generation=True`) greedy tokens and seeded sampled tokens equal TRL's eager ones, with the stop
decided per step as transformers does on a GPU or one step late (`rollouts.DEFERRED_STOP_CHECK`)."""

from __future__ import annotations

import random

import pytest
import torch
from datasets import Dataset
from test_cuda_padding_free import QWEN_SHAPES, QWEN_VOCAB, word_tokenizer
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, regional_compile, rollouts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
STEPS = 10


def prompts_text(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(3, 1000)}" for _ in range(rng.randint(5, 250))) for _ in range(count)]


def trained_0_5b(tmp_path, steps: int, **options) -> CompiledGRPOTrainer:
    """A CompiledGRPOTrainer after `steps` of `train()` on Qwen2.5-0.5B's shapes (random bf16 weights), every
    default but `options`, prompts of 5-250 tokens."""
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN_SHAPES["0.5B"], vocab_size=QWEN_VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=32, gradient_accumulation_steps=2, max_steps=steps, bf16=True,
                      logging_steps=1, report_to=[], save_strategy="no")  # fmt: skip
    trainer = CompiledGRPOTrainer(model=model, reward_funcs=lambda completions, **k: [float(len(c)) for c in
                                  completions], args=args, train_dataset=Dataset.from_dict({"prompt": prompts_text(
                                  16 * steps, seed=0)}), processing_class=word_tokenizer(QWEN_VOCAB),
                                  **options)  # fmt: skip
    trainer.train()
    return trainer


def test_train_with_every_default_compiles_generation_once_over_varied_prompts(tmp_path):
    trainer = trained_0_5b(tmp_path, STEPS)
    assert trainer.model.is_gradient_checkpointing and regional_compile.compiled(trainer.backbone_layers)
    state = trainer.generation_compiles
    assert trainer.compile_generation and state.fallback is None and state.calls == STEPS
    assert [length for length, _, _ in state.compiles] == [256 + 32], state.compiles  # one bucket, compiled once
    assert [loop.length for loop in trainer.generation_loops.values()] == [256 + 32]  # on the loop, one cache
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logged) == STEPS and all(e["grad_norm"] > 0 for e in logged)


def float32_generator(tmp_path, cls, greedy: bool, **options):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                         bos_token_id=1, initializer_range=0.1)  # fmt: skip
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config)
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=24, bf16=False, report_to=[], save_strategy="no",
                      generation_kwargs={"do_sample": False} if greedy else None)  # fmt: skip
    return cls(
        model=model,
        reward_funcs=lambda completions, **k: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["w5"] * 8}),
        processing_class=word_tokenizer(1000),
        **options,
    )


@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("greedy", [True, False])
def test_float32_tokens_equal_eager_generation(tmp_path, greedy, deferred, monkeypatch):
    """Also with the stop decided one step late (`rollouts.DEFERRED_STOP_CHECK`): the extra step is undone."""
    monkeypatch.setattr(rollouts, "DEFERRED_STOP_CHECK", deferred)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, False
    ours = float32_generator(tmp_path / "ours", CompiledGRPOTrainer, greedy, compile_generation=True)
    theirs = float32_generator(tmp_path / "theirs", GRPOTrainer, greedy)
    assert ours.compile_generation
    rng = random.Random(1)
    for seed in range(4):
        prompt_ids = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 200))] for _ in range(8)]
        torch.manual_seed(seed)
        mine, _ = ours._generate_single_turn(prompt_ids, None, {}, 4)
        torch.manual_seed(seed)
        trl, _ = theirs._generate_single_turn(prompt_ids, None, {}, 4)
        assert mine == trl, seed
    assert len(ours.generation_compiles.compiles) <= 1 and ours.generation_compiles.calls == 4
    assert hasattr(ours.model, "_compiled_call") and not hasattr(theirs.model, "_compiled_call")


def test_float32_greedy_tokens_on_the_loop_equal_eager_generation(tmp_path):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, False
    ours = float32_generator(tmp_path / "ours", CompiledGRPOTrainer, True)  # "auto": the loop
    theirs = float32_generator(tmp_path / "theirs", GRPOTrainer, True)
    rng = random.Random(2)
    for seed in range(4):
        prompt_ids = [[rng.randrange(3, 1000) for _ in range(rng.randint(1, 200))] for _ in range(8)]
        mine, _ = ours._generate_single_turn(prompt_ids, None, {}, 4)
        trl, _ = theirs._generate_single_turn(prompt_ids, None, {}, 4)
        assert mine == trl, seed
    assert [loop.length for loop in ours.generation_loops.values()] == [256 + 24]  # one bucket, one compiled step
