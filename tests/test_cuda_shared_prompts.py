"""On a GPU (skipped elsewhere): rows that share their prompt in a packed forward give the hidden states and the
gradients of the same rows packed apart, to bf16 rounding, under torch's varlen FlashAttention (each completion's keys
gathered, causal aligned at the end), SDPA and FlexAttention masks, on eager and on compiled layers; the shared
step equals GRPOTrainer's padded one (checkpointed); and `train()` with every default shares prompts."""

from __future__ import annotations

import pytest
import torch
from test_cuda_padding_free import fresh_compiler, gpu_trainer, model_on_gpu  # noqa: F401
from test_integration_trl import loss_and_grads
from test_shared_prompts import B, C, grouped_batch, lengths_of
from trl import GRPOTrainer

from compiled_grpo.integrations.trl import packed_attention, packing, padding_free, regional_compile

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def on_gpu(inputs: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))


@pytest.mark.usefixtures("fresh_compiler")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-layers", "compiled-layers"])
@pytest.mark.parametrize("attention", ["varlen", "sdpa", "flex_attention"])
@pytest.mark.parametrize("G", [2, 8])
def test_shared_rows_equal_rows_packed_apart_on_the_gpu(attention, compiled, G):
    model = model_on_gpu("sdpa")
    if attention != "sdpa":
        packed_attention.install(model)
    if compiled:
        regional_compile.compile_layers(model)
    inputs = on_gpu(grouped_batch(G))
    lengths = lengths_of(inputs)
    lengths = lengths._replace(prompt=lengths.prompt.cpu(), completion=lengths.completion.cpu(),
                               groups=lengths.groups.cpu())  # fmt: skip
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    forward = padding_free.packed_ids_forward(model, model.get_output_embeddings(),
                                              None if attention == "sdpa" else attention)  # fmt: skip
    rows = torch.arange(B)
    weights = torch.randn(int(lengths.completion.sum()), model.config.hidden_size, device="cuda")
    found = []
    for groups in (lengths.groups, None):
        model.zero_grad()
        packed = packing.pack(ids, lengths, rows, 128, groups)
        hidden = forward(packed)[0]
        read = hidden[packing.targets(lengths, rows, packed.starts, C, hidden.device).row_index]
        (read.float() * weights).sum().backward()  # the head takes no part: its weight has no grad
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        found.append((read.detach(), grads, packed.keys))
    (shared, shared_grads, keys), (apart, apart_grads, _) = found
    assert keys is not None and apart_grads and shared_grads.keys() == apart_grads.keys()
    assert relative(shared, apart) <= 1e-2
    for name, grad in apart_grads.items():
        assert relative(shared_grads[name], grad) <= 3e-2, name


@pytest.mark.usefixtures("fresh_compiler")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager-layers", "compiled-layers"])
def test_shared_step_equals_trl_on_the_gpu(tmp_path, compiled):
    trainer = gpu_trainer(tmp_path, "varlen")
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compiled:
        regional_compile.compile_layers(trainer.model)
    inputs = on_gpu(grouped_batch(4))
    with trainer.accelerator.autocast():
        theirs = loss_and_grads(lambda m, i: GRPOTrainer._compute_loss(trainer, m, i), trainer, inputs)
        trainer._metrics["train"].clear()
        ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert trainer.sharing_refused == "" and trainer._metrics["train"]["shared_prompts/saved_tokens"][-1] > 0
    torch.testing.assert_close(ours[0].float(), theirs[0].float(), rtol=2e-2, atol=1e-3)
    for name, g in theirs[1].items():
        assert relative(ours[1][name], g) <= 5e-2, name
    assert ours[2]["entropy"] == pytest.approx(theirs[2]["entropy"], rel=2e-2)
