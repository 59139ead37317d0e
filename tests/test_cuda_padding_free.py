"""On a GPU (skipped elsewhere): CompiledGRPOTrainer's packed step under SDPA and FlexAttention, bf16 autocast, equals
GRPOTrainer's padded step to bf16 rounding (loss, gradient norm, entropy), and its packed rows equal each row
forwarded alone."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from test_integration_trl import VOCAB, digit_reward, loss_and_grads, tokenizer
from test_padding_free import COMPLETIONS, PROMPTS, B, C, varied_batch
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, packing, padding_free, plan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def model_on_gpu(attention: str):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(VOCAB), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                         bos_token_id=1, attn_implementation=attention)  # fmt: skip
    return Qwen2ForCausalLM(config).cuda().to(torch.bfloat16)


def gpu_trainer(tmp_path, attention: str) -> CompiledGRPOTrainer:
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=B, num_generations=B,
                      max_completion_length=C, bf16=True, report_to=[], save_strategy="no",
                      loss_type="dapo")  # fmt: skip
    data = Dataset.from_dict({"prompt": ["a b c"] * B})
    trainer = CompiledGRPOTrainer(model=model_on_gpu("sdpa"), reward_funcs=digit_reward, args=args,
                                  train_dataset=data, processing_class=tokenizer(), packed_attention=attention,
                                  skip_zero_advantage=False, padding_free="pack")  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
def test_packed_step_equals_trl_on_the_gpu(tmp_path, attention):
    trainer = gpu_trainer(tmp_path, attention)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in varied_batch().items()}
    with trainer.accelerator.autocast():
        theirs = loss_and_grads(lambda m, i: GRPOTrainer._compute_loss(trainer, m, i), trainer, inputs)
        ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert trainer.packing_refused == "" and trainer.packed_attention == attention
    torch.testing.assert_close(ours[0].float(), theirs[0].float(), rtol=2e-2, atol=1e-3)
    norm = lambda grads: torch.stack([g.float().norm() for g in grads.values()]).norm()  # noqa: E731
    assert float(norm(ours[1])) == pytest.approx(float(norm(theirs[1])), rel=3e-2)
    assert ours[2]["entropy"] == pytest.approx(theirs[2]["entropy"], rel=2e-2)


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
def test_packed_rows_equal_rows_alone_on_the_gpu(attention):
    model = model_on_gpu("sdpa").eval()
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in varied_batch().items()}
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    lengths = plan.read(None, [inputs], with_zeros=False)[0].lengths
    forward = padding_free.packed_ids_forward(model, model.get_output_embeddings(), {})
    with torch.no_grad(), padding_free.attention_as(model, attention):
        packed = packing.pack(ids, lengths, torch.arange(B), 128)
        both, _ = forward(packed)
        for row in range(B):
            alone, _ = forward(packing.pack(ids, lengths, torch.tensor([row]), 1))
            start, span = int(packed.starts[row]), PROMPTS[row] + COMPLETIONS[row]
            torch.testing.assert_close(both[start : start + span].float(), alone.float(), rtol=3e-2, atol=3e-2)
