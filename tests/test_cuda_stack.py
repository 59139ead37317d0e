"""On a GPU (skipped elsewhere): `compile_backbone="stack"` (a packed forward's decoder layers as a few compiled calls
on fixed capacities) on torch's varlen FlashAttention, bf16 autocast, checkpointed both ways: three steps each equal
GRPOTrainer's padded step on eager layers to bf16 rounding (loss, every gradient), the stack having run, its calls
compiled plainly or replayed as CUDA graphs (`"stack-graphs"`: graphs recorded, none skipped)."""

from __future__ import annotations

import pytest
import torch
from test_compiled_stack import stacked
from test_cuda_padding_free import assert_loss_and_gradients_close, fixed_shapes_against_trl, fresh_compiler  # noqa: F401
from test_integration_trl import loss_and_grads

from compiled_grpo.integrations.trl import compiled_stack, stack_graphs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.mark.usefixtures("fresh_compiler")
@pytest.mark.parametrize("graphs", [False, True], ids=["compiled", "cuda-graphs"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_packed_step_on_the_stack_equals_trl_on_the_gpu(tmp_path, reentrant, graphs):
    trainer, inputs, theirs = fixed_shapes_against_trl(tmp_path, reentrant)
    skipped = stack_graphs.cuda_graphs_recorded()[1]
    with stacked(trainer, mode="stack-graphs" if graphs else "stack"):
        for _ in range(3):
            with trainer.accelerator.autocast():
                ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
            assert_loss_and_gradients_close(ours, theirs)
    assert trainer.packing_refused == "" and trainer.packed_attention == "varlen"
    recorded, skips = stack_graphs.cuda_graphs_recorded(torch.cuda.current_device())
    assert (recorded > 0, skips - skipped) == (graphs, 0), "the stack's calls were not replayed as CUDA graphs"
    pool, free = stack_graphs.cuda_graph_pool(torch.cuda.current_device())
    assert not graphs or (pool > 0 and 0 <= free <= pool), (pool, free)


@pytest.mark.usefixtures("fresh_compiler")
def test_a_graphed_stack_of_several_calls_runs_without_grad_and_accumulates_on_the_gpu(tmp_path, monkeypatch):
    """The stack as CUDA graphs where a forward makes several calls (a layer a call) and an optimizer step adds up
    micro-batches, where Inductor's CUDA-graph trees free a generation's outputs at the next call (`stack_graphs`):
    a forward without grad (each call's output handed to the next), then two steps of two micro-batches each, their
    gradients added into `.grad`: half the sum equals GRPOTrainer's one micro-batch to bf16 rounding."""
    monkeypatch.setattr(compiled_stack, "GRADIENTS_PER_CALL", 1)  # one layer a call: two calls per forward
    trainer, inputs, theirs = fixed_shapes_against_trl(tmp_path, reentrant=False)
    skipped = stack_graphs.cuda_graphs_recorded()[1]
    with stacked(trainer, mode="stack-graphs"):
        assert all(stack.per_call == 1 for stack in trainer.backbone_stacks.values())
        with torch.no_grad(), trainer.accelerator.autocast():
            trainer._compute_loss(trainer.model, inputs)
        for _ in range(2):
            trainer.model.zero_grad(set_to_none=True)
            for _ in range(2):
                with trainer.accelerator.autocast():
                    loss = trainer._compute_loss(trainer.model, inputs)
                loss.backward()
            grads = {n: p.grad / 2 for n, p in trainer.model.named_parameters() if p.grad is not None}
            assert_loss_and_gradients_close((loss.detach(), grads), theirs)
    recorded, skips = stack_graphs.cuda_graphs_recorded(torch.cuda.current_device())
    assert (recorded > 0, skips - skipped) == (True, 0), "the stack's calls were not replayed as CUDA graphs"
