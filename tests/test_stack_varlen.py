"""`compile_backbone="stack"` on torch's varlen FlashAttention, here a masked SDPA standing in for it on the CPU
(`varlen_masked`, checked against the per-sequence stand-in): prompts shared and not, every kind of call captured
whole, the step equal to TRL's; and the kinds of call dynamo cannot capture (a graph break inside a layer's call)
running layer by layer, checkpointed too, equal to TRL's."""

from __future__ import annotations

import pytest
import test_shared_prompts as shared
import torch
import varlen_masked
from test_compiled_stack import fixed_trainer, stack_matches_trl
from test_train_checkpointed import varlen_on_the_cpu

from compiled_grpo.integrations.trl import compiled_stack, regional_compile

pytestmark = pytest.mark.compiled


@pytest.fixture
def varlen_masked_sdpa(monkeypatch):
    varlen_masked.install(monkeypatch)


def test_the_masked_stand_in_equals_the_per_sequence_one():
    """Sequences of 0-7 queries, some with more keys than queries (a shared prompt's), grouped heads."""
    g = torch.Generator().manual_seed(0)
    queries = torch.tensor([3, 0, 5, 1, 7, 0, 2])
    keys = queries + torch.tensor([0, 0, 4, 2, 0, 0, 6])
    cu_q, cu_k = (torch.cat([torch.zeros(1), n.cumsum(0)]).to(torch.int32) for n in (queries, keys))
    q = torch.randn(int(cu_q[-1]), 4, 8, generator=g)
    k, v = (torch.randn(int(cu_k[-1]), 2, 8, generator=g) for _ in range(2))
    bounds = (q, k, v, cu_q, cu_k, int(queries.max()), int(keys.max()))
    settings = {"scale": 0.3, "window_size": (-1, 0), "enable_gqa": True}
    expected = varlen_on_the_cpu(*bounds, **settings)
    torch.testing.assert_close(varlen_masked.varlen_attn(*bounds, **settings), expected, rtol=1e-5, atol=1e-6)


def checkpointed_trainer(tmp_path, checkpointing: str):
    trainer = fixed_trainer(tmp_path, "varlen", loss_type="dapo")
    if checkpointing != "off":
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        trainer.model.enable_input_require_grads()
    return trainer


@pytest.mark.parametrize("checkpointing", ["non-reentrant", "off"])
def test_varlen_forwards_sharing_prompts_on_the_stack_equal_trl(tmp_path, varlen_masked_sdpa, checkpointing):
    """Prompts shared (each segment's keys gathered, its key boundaries beside the queries') and not (the packing
    and sharing checks): every kind of call captured whole, and the step equals TRL's."""
    trainer = checkpointed_trainer(tmp_path, checkpointing)
    stack_matches_trl(trainer, shared.with_logps(trainer, shared.grouped_batch(4), 0.0))
    (stack,) = trainer.backbone_stacks.values()
    assert trainer.packed_attention == "varlen" and stack.one_by_one == {}
    assert trainer.sharing_refused == "" and trainer._metrics["train"]["shared_prompts/saved_tokens"][0] > 0


def breaking_layer_call(with_grad_too: bool):
    """A layer's call inside the stack's nested regions that breaks dynamo's graph without grad (and with it)."""
    call_layer = compiled_stack.call_layer

    def breaks(layer, hidden, kwargs):
        if with_grad_too or not torch.is_grad_enabled():
            torch._dynamo.graph_break()
        return call_layer(layer, hidden, kwargs)

    return breaks


def test_calls_dynamo_cannot_capture_run_layer_by_layer_and_the_rest_stay_stacked(tmp_path, monkeypatch):
    """Without grad only (a group at advantage 0, forwarded without grad under `skip_zero_advantage="backward"`):
    that kind of call runs its layers one by one, said once with dynamo's reason; sharing still passes its check,
    the rows with grad run on the stack, and the step equals TRL's."""
    monkeypatch.setattr(compiled_stack, "call_layer", breaking_layer_call(with_grad_too=False))
    trainer = fixed_trainer(tmp_path, skip="backward", loss_type="dapo")
    inputs = shared.with_logps(trainer, shared.grouped_batch(4), 0.0)
    inputs["advantages"][(inputs["prompt_ids"] == inputs["prompt_ids"][0]).all(1)] = 0.0  # row 0's group
    with pytest.warns(regional_compile.BackboneNotice, match="without grad.*run one by one.*graph_break"):
        stack_matches_trl(trainer, inputs)
    (stack,) = trainer.backbone_stacks.values()
    assert stack.one_by_one and all(not with_grad for with_grad, _, _ in stack.one_by_one)
    assert trainer.sharing_refused == "" and trainer._metrics["train"]["shared_prompts/saved_tokens"][0] > 0


@pytest.mark.parametrize("checkpointing", ["non-reentrant", "reentrant"])
def test_checkpointed_calls_dynamo_cannot_capture_equal_trl_layer_by_layer(
    tmp_path, monkeypatch, varlen_masked_sdpa, checkpointing
):
    """Every kind of call uncapturable, checkpointed: the layers run as the model runs them, their recomputation
    (after the stack's block) on the graphs their forward ran, and the step equals TRL's."""
    monkeypatch.setattr(compiled_stack, "call_layer", breaking_layer_call(with_grad_too=True))
    trainer = checkpointed_trainer(tmp_path, checkpointing)
    with pytest.warns(regional_compile.BackboneNotice, match="with grad.*run one by one"):
        stack_matches_trl(trainer, shared.with_logps(trainer, shared.grouped_batch(4), 0.0))
    (stack,) = trainer.backbone_stacks.values()
    assert any(with_grad and checkpointed for with_grad, checkpointed, _ in stack.one_by_one)
