"""`compile_backbone="stack"`: a packed forward's decoder layers run as one compiled call on static shapes (Inductor
on the CPU here), float32, the packed rows on fixed capacities. The step equals TRL's on eager layers (every loss
type, checkpointing reentrant, non-reentrant and off, skip modes, shared prompts) and `train()` equals
GRPOTrainer's; 50 micro-batches of random lengths compile no more stacks than there are capacities (with and
without grad); models whose layers cannot run as one stack are refused with the reason."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._dynamo.utils
from test_fixed_shapes import fixed_trainer, matches_trl
from test_padding_free import LOSS_TYPES, C, P, varied_batch, with_logps
from test_train_checkpointed import assert_steps_equal, grpo_trainer_run, packed_share, tmp_root, train  # noqa: F401

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, compiled_stack, packing, regional_compile

pytestmark = pytest.mark.compiled


@contextlib.contextmanager
def stacked(trainer, must_run=True):
    """The trainer's layers set up as `compile_backbone="stack"` sets them up inside the block; with `must_run`, the
    stack must have run in it (counted), so a run on layers called one by one cannot pass for it."""
    trainer.compile_backbone, trainer.backbone_layers = "stack", None
    regional_compile.compile_trainer_backbone(trainer)
    calls = []
    for stack in trainer.backbone_stacks.values():
        stack.run_all = lambda *a, run_all=stack.run_all, **k: calls.append(1) or run_all(*a, **k)
    try:
        yield trainer.backbone_stacks
    finally:
        regional_compile.uncompile(trainer.backbone_layers)
    assert calls or not must_run, "the stack never ran"


def stack_matches_trl(trainer, inputs, metrics=True):
    with stacked(trainer):
        matches_trl(trainer, inputs, metrics)


@pytest.mark.parametrize("checkpointing", ["reentrant", "non-reentrant", "off"])
def test_checkpointed_stack_equals_trl(tmp_path, checkpointing):
    trainer = fixed_trainer(tmp_path, loss_type="grpo", beta=0.04)
    if checkpointing != "off":
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        trainer.model.enable_input_require_grads()
    stack_matches_trl(trainer, with_logps(trainer, varied_batch(), 0.04))
    assert all(layer.gradient_checkpointing == (checkpointing != "off") for layer in trainer.model.model.layers)
