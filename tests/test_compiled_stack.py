"""`compile_backbone="stack"`: a packed forward's decoder layers run as a few compiled calls (Inductor on the CPU
here), float32, the packed rows on fixed capacities. The step equals TRL's on eager layers (every loss
type, checkpointing reentrant, non-reentrant and off, skip modes, shared prompts) and `train()` equals
GRPOTrainer's (a LoRA adapter too); frozen embeddings train the first layer right; 50 micro-batches of random
lengths compile a few stacks per kind of call they make, groups of layers share them, a group holds its own
gradients only; models whose layers cannot run as one stack
(different masks, a layer frozen alone) are refused with the reason."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch._dynamo.utils
from test_fixed_shapes import fixed_trainer, matches_trl, random_lengths_batch
from test_integration_trl import loss_and_grads
from test_padding_free import LOSS_TYPES, varied_batch, with_logps
from test_skip_zero_advantage import assert_same, trl_loss
from test_train_checkpointed import assert_steps_equal, grpo_trainer_run, packed_share, tmp_root, train  # noqa: F401

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, compiled_stack, packing, regional_compile

pytestmark = pytest.mark.compiled


@contextlib.contextmanager
def stacked(trainer, must_run=True, mode="stack"):
    """The trainer's layers set up as `compile_backbone=mode` ("stack" or "stack-graphs") sets them up inside the
    block; with `must_run`, the stack must have run in it (counted), so a run on layers called one by one cannot pass
    for it."""
    trainer.compile_backbone, trainer.backbone_asked, trainer.backbone_layers = mode, mode, None
    regional_compile.compile_trainer_backbone(trainer)
    calls = []  # (tokens, with grad, keywords) of each call
    record = lambda hidden, kwargs: calls.append((hidden.shape[-2], torch.is_grad_enabled(), tuple(sorted(kwargs))))  # noqa: E731
    for stack in trainer.backbone_stacks.values():
        stack.run_group = lambda c, s, h, run=stack.run_group, **k: record(h, k) or run(c, s, h, **k)
    try:
        yield calls
    finally:
        regional_compile.uncompile(trainer.backbone_layers)
    assert calls or not must_run, "the stack never ran"


def assert_refused(trainer, said: str) -> None:
    """Setting the trainer's layers up as a stack says `said` (a regex) and builds none."""
    with pytest.warns(regional_compile.BackboneNotice, match=said), stacked(trainer, must_run=False):
        assert trainer.backbone_stacks == {}


def eager_linear_stack(count: int):
    """(layers, their stack) of `count` Linear(4, 4) layers, the stack's function run eagerly (checks of the host)."""
    layers = [torch.nn.Linear(4, 4) for _ in range(count)]
    stack = compiled_stack.Stack(layers)
    stack.compiled = compiled_stack.through_layers
    return layers, stack


def stack_matches_trl(trainer, inputs, metrics=True, mode="stack"):
    with stacked(trainer, mode=mode):
        assert all(stack.graphs == (mode == "stack-graphs") for stack in trainer.backbone_stacks.values())
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


def test_layers_in_groups_equal_trl_and_share_one_graph(tmp_path, monkeypatch):
    """Layers whose gradients do not fit one call run in groups, here of one layer each: the checkpointed step equals
    TRL's, and every group runs the graph compiled for its kind of call (no graph per group)."""
    monkeypatch.setattr(compiled_stack, "GRADIENTS_PER_CALL", 1)
    trainer = fixed_trainer(tmp_path, loss_type="grpo", beta=0.04)
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.enable_input_require_grads()
    before = stack_graphs()
    with stacked(trainer) as calls:
        assert [stack.per_call for stack in trainer.backbone_stacks.values()] == [1, 1]  # the policy's, the reference's
        matches_trl(trainer, with_logps(trainer, varied_batch(), 0.04))
    kinds = {(grad, keywords) for _, grad, keywords in calls}
    assert len(calls) >= 2 and len(calls) % 2 == 0, calls  # two groups per forward
    assert stack_graphs() - before <= len(kinds), (stack_graphs() - before, kinds)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_on_the_stack_equals_trl(tmp_path, loss_type):
    trainer = fixed_trainer(tmp_path, loss_type=loss_type, top_entropy_quantile=0.5)
    stack_matches_trl(trainer, with_logps(trainer, varied_batch(), 0.0))


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures Linux's resident high-water mark")
def test_a_checkpointed_stack_holds_one_layers_activations_not_all():
    """The stack's backward recomputes each layer just before that layer's backward, as checkpointing layer by layer
    does: its peak memory stays near the checkpointed one's, far below the one not checkpointed (a checkpoint
    around each nested region held every recomputed layer at once: 645 MiB here, against 164 and 845)."""
    peaks = stack_memory()
    assert peaks["not checkpointed"] > 3 * peaks["checkpointed"], peaks  # the measure tells them apart
    assert peaks["stack"] < peaks["checkpointed"] + (peaks["not checkpointed"] - peaks["checkpointed"]) / 4, peaks


def test_a_stack_in_groups_holds_a_groups_gradients_not_all():
    """With `.grad` held from the micro-batch before, a compiled backward through all 8 layers holds the gradients of
    all of them before they are added (as the stack's peak on a GPU showed), one through groups of two holds two
    layers' worth, as `layers_per_call` sizes the groups."""
    peaks = stack_memory("gradients")
    layer = peaks["layer"]  # 48 MiB
    assert peaks["stack"] > peaks["checkpointed"] + 5 * layer, peaks  # the measure tells them apart
    assert peaks["stack in groups of 2"] < peaks["checkpointed"] + 3 * layer, peaks


def stack_memory(*args: str) -> dict:
    """`tests/stack_memory.py`'s peaks, run in a process of its own."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    script = Path(__file__).with_name("stack_memory.py")
    done = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["backward", "all"])
def test_skip_modes_on_the_stack_equal_trl(tmp_path, mode):
    trainer = fixed_trainer(tmp_path, skip=mode, loss_type="grpo")
    stack_matches_trl(trainer, with_logps(trainer, varied_batch(zeros=(1, 2, 4)), 0.0), metrics=mode == "backward")


def test_shared_prompts_on_the_stack_equal_trl(tmp_path):
    import test_shared_prompts as shared

    trainer = fixed_trainer(tmp_path, loss_type="dapo")
    stack_matches_trl(trainer, shared.with_logps(trainer, shared.grouped_batch(4), 0.0))
    assert trainer._metrics["train"]["shared_prompts/saved_tokens"][0] > 0


def test_fifty_steps_of_random_lengths_compile_two_stacks_per_kind_of_call(tmp_path):
    """50 micro-batches of 2-6 rows of random prompt and completion lengths (some groups sharing a prompt) on
    capacities of a 4-token bucket: every call a capacity, and the stack's compiled function gets at most three
    graphs per kind of call it met (with grad or without, its keywords: a forward sharing prompts passes more), a
    static one and then the lengths dynamic (torch 2.13.0 compiled a second dynamic graph where the first one's
    guards failed to evaluate: "tuple index out of range"), fewer than the capacities it met. The first
    micro-batch's checks (packing, sharing) run on eager layers: no call without grad reaches the stack."""
    trainer = fixed_trainer(tmp_path, loss_type="dapo")
    trainer.packed_shapes = packing.Shapes(4, fixed=True)
    g = torch.Generator().manual_seed(0)
    before = stack_graphs()
    with stacked(trainer) as calls:
        for step in range(50):
            rows = int(torch.randint(2, 7, (), generator=g))
            trainer._compute_loss(trainer.model, first_rows(random_lengths_batch(step, g), rows)).backward()
    capacities = {packing.capacity(t, 4) for t in range(1, 97)}
    seen = {tokens for tokens, *_ in calls}
    kinds = {(grad, keywords) for _, grad, keywords in calls}
    assert len(calls) >= 40 and seen <= capacities and all(grad for grad, _ in kinds), (seen, kinds)  # most packed
    graphs = stack_graphs() - before
    assert graphs <= 3 * len(kinds) and graphs < len(seen), (graphs, kinds, sorted(seen))


def first_rows(inputs: dict, rows: int) -> dict:
    """The micro-batch's first `rows` rows."""
    B = inputs["completion_mask"].shape[0]
    out = {k: v[:rows] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == B else v for k, v in inputs.items()}
    out["num_items_in_batch"] = out["completion_mask"].sum().float()
    return out


def stack_graphs() -> int:
    """Graphs compiled from `compiled_stack.through_layers` so far in this process."""
    code = compiled_stack.through_layers.__code__
    return sum(1 for _ in torch._dynamo.eval_frame._debug_get_cache_entry_list(code))


def test_a_stack_that_dynamo_fails_on_dynamic_lengths_compiles_static_shapes(tmp_path):
    """Compiled with every size dynamic (`dynamic=True`), the stack fails to compile in torch 2.13.0 (dynamo's reuse
    of the nested region raises an internal KeyError on a size that the layer specializes): it says so once,
    compiles static shapes from then on, and the step equals TRL's. A torch that compiles it keeps it, saying
    nothing: 2.14.1 does since the stack specializes float arguments (on symbolic floats Inductor raised
    GuardOnDataDependentSymNode)."""
    trainer = fixed_trainer(tmp_path, loss_type="grpo")
    with stacked(trainer), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        (stack,) = trainer.backbone_stacks.values()
        stack.compiled = torch.compile(compiled_stack.through_layers, dynamic=True, fullgraph=True)
        matches_trl(trainer, with_logps(trainer, varied_batch(), 0.0))
    fell_back = [w for w in said if "dynamo failed on dynamic lengths" in str(w.message)]
    assert len(fell_back) == (stack.compiled is stack.static), [str(w.message) for w in said]
    assert stack.compiled is stack.static or not torch.__version__.startswith("2.13.0")


def test_a_model_whose_layers_attend_differently_is_refused(tmp_path):
    trainer = fixed_trainer(tmp_path, loss_type="grpo")
    trainer.model.config.layer_types = ["full_attention", "sliding_attention"]
    assert_refused(trainer, "its layers attend differently.*compiled by region alone")


def test_trimmed_micro_batches_are_refused(tmp_path):
    trainer = fixed_trainer(tmp_path, loss_type="grpo")
    trainer.padding_free_mode = "trim"
    assert_refused(trainer, "not packed here \\(they run 'trim'\\); the layers are compiled by region alone")


def test_a_stack_that_fails_to_compile_runs_eagerly_and_says_why(tmp_path, monkeypatch):
    """The stack's compiled function failing at its first call, on dynamic shapes and static ones alike (a backend
    that raises): said once with the reason, the layers eager again, and the step TRL's."""

    def failing_backend(graph, example_inputs):
        raise RuntimeError("this backend cannot compile the stack")

    trainer = fixed_trainer(tmp_path, loss_type="dapo")
    inputs = with_logps(trainer, varied_batch(), 0.0)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    with stacked(trainer, must_run=False) as calls:
        for stack in trainer.backbone_stacks.values():
            stack.compiled = stack.static = torch.compile(compiled_stack.through_layers, backend=failing_backend)
        with pytest.warns(regional_compile.BackboneNotice, match="cannot compile the stack.*run eagerly from here"):
            ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert calls and trainer.backbone_stacks == {} and not regional_compile.compiled(trainer.backbone_layers)
    assert_same((*ours[:2], {k: v for k, v in ours[2].items() if not k.startswith("shared_prompts/")}), theirs)


def test_a_loop_that_changes_the_hidden_states_between_layers_is_refused():
    layers, stack = eager_linear_stack(2)
    x = torch.randn(1, 4)
    with stack.running(), pytest.raises(RuntimeError, match="changed the hidden states between two decoder layers"):
        layers[1](layers[0](x) + 1)
    with stack.running():
        assert torch.equal(layers[1](layers[0](x)), layers[1].forward(layers[0].forward(x)))


def test_auto_falls_back_to_regional_layers_where_the_stack_refuses_the_model(tmp_path, monkeypatch):
    """Under "auto", a model that the stack finds it cannot run as it runs (here the check between two layers
    refusing it) trains on its layers compiled by region from then on, said once, the step TRL's."""

    def refuse(self, hidden, kwargs):
        raise compiled_stack.Refused("a loop the stack cannot follow")

    trainer = fixed_trainer(tmp_path, loss_type="grpo")
    inputs = with_logps(trainer, varied_batch(), 0.0)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    monkeypatch.setattr(compiled_stack.Stack, "check_handed_on", refuse)
    with stacked(trainer) as calls:
        trainer.backbone_asked = "auto"
        said = "compile_backbone='auto': a loop the stack cannot follow; the layers are compiled by region alone"
        with pytest.warns(regional_compile.BackboneNotice, match=said):
            ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
        assert trainer.backbone_stacks == {} and regional_compile.compiled(trainer.backbone_layers)
    assert len(calls) == 1  # the refused forward's only
    assert_same((*ours[:2], {k: v for k, v in ours[2].items() if not k.startswith("shared_prompts/")}), theirs)


@pytest.mark.parametrize("attention, mode", [("sdpa", "stack"), ("varlen", "stack"), ("sdpa", "stack-graphs")])
def test_train_on_the_stack_equals_grpo_trainer(tmp_path, tmp_root, monkeypatch, attention, mode):  # noqa: F811
    """`train()` (gradient checkpointing on, which TRL switches off and on around each generation) on the stack; on
    varlen attention (a masked SDPA standing in for it on the CPU) its groups share their prompts, every kind of
    call captured whole. As "stack-graphs" sets it up (Inductor records no CUDA graph on the CPU): `.grad` buffers
    made before each step's first forward take two accumulated micro-batches' gradients, and calls without grad
    hand on copies."""
    import varlen_masked

    varlen_masked.install(monkeypatch)
    calls, run_group = [], compiled_stack.Stack.run_group
    monkeypatch.setattr(compiled_stack.Stack, "run_group", lambda *a, **k: calls.append(1) or run_group(*a, **k))
    with pytest.warns(regional_compile.BackboneNotice):
        losses, grads, trainer = train(tmp_path, CompiledGRPOTrainer, "eager", False, padding_free="pack",
                                       packed_attention=attention, skip_zero_advantage=False,
                                       compile_backbone=mode)  # fmt: skip
    assert trainer.packed_shapes.fixed and set(trainer.backbone_stacks) and packed_share(trainer) > 0.5 and calls
    assert all(stack.graphs == (mode == "stack-graphs") for stack in trainer.backbone_stacks.values())
    assert all(stack.one_by_one == {} for stack in trainer.backbone_stacks.values())
    saved = trainer.state.log_history[0].get("shared_prompts/saved_tokens", 0.0)
    assert attention != "varlen" or (trainer.sharing_refused == "" and saved > 0), (trainer.sharing_refused, saved)
    assert_steps_equal((losses, grads), grpo_trainer_run("eager", False, tmp_root))


def test_frozen_embeddings_on_the_stack_equal_trl(tmp_path):
    """The hidden states entering the first layer without grad (frozen embeddings, as under a LoRA adapter), every
    layer trained: the first layer's gradients too are TRL's (a nested region's backward compiled for inputs with
    grad, reused for one without, gives wrong gradients in torch 2.13: the stack hands the first layer an input with
    grad)."""
    trainer = fixed_trainer(tmp_path, loss_type="grpo")
    trainer.model.get_input_embeddings().weight.requires_grad_(False)
    stack_matches_trl(trainer, with_logps(trainer, varied_batch(), 0.0))


def test_a_model_that_runs_fewer_layers_than_it_holds_is_refused(tmp_path):
    trainer = fixed_trainer(tmp_path, loss_type="grpo")
    trainer.model.config.num_hidden_layers = 1
    assert_refused(trainer, "runs 1 of its 2 layers")


def test_the_stack_built_to_replay_cuda_graphs_equals_trl(tmp_path):
    """`compile_backbone="stack-graphs"` (Inductor's CUDA-graph trees around the stack's calls; on the CPU Inductor
    records none): the stack compiles with it, checkpointed, and the step equals TRL's."""
    trainer = fixed_trainer(tmp_path, loss_type="grpo")
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.enable_input_require_grads()
    stack_matches_trl(trainer, with_logps(trainer, varied_batch(), 0.0), mode="stack-graphs")


def test_a_layer_frozen_alone_is_refused(tmp_path):
    """Layers whose parameters require grad differently (one frozen) would share a nested region's backward that
    fits only some of them (wrong gradients in torch 2.13): refused at the first step, compiled by region alone."""
    trainer = fixed_trainer(tmp_path, loss_type="grpo")
    trainer.model.model.layers[1].requires_grad_(False)
    assert_refused(trainer, "layers' parameters do not all require grad alike")


def test_the_first_layer_gets_an_input_with_grad_and_layers_trained_differently_are_refused():
    layers, stack = eager_linear_stack(3)
    seen = []
    layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0].requires_grad))
    with stack.running():
        layers[2](layers[1](layers[0](torch.randn(1, 4))))
    assert seen == [True]
    layers[1].weight.requires_grad_(False)
    with stack.running(), pytest.raises(RuntimeError, match="do not all require grad alike"):
        layers[0](torch.randn(1, 4))
    with torch.no_grad(), stack.running():  # without grad, nothing to refuse
        layers[0](torch.randn(1, 4))


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
def test_a_graphed_stack_without_grad_hands_on_copies_and_makes_no_grad_buffers(no_grad):
    """As "stack-graphs" runs a forward without grad (no_grad, inference_mode), a layer a call: each call's output is
    a copy (the next call may free the graphs' own), the layers' output is theirs, and no `.grad` is made."""
    layers, stack = eager_linear_stack(3)
    stack.graphs, stack.per_call = True, 1
    x = torch.randn(2, 4)
    outputs = []
    stack.compiled = lambda *args, **kwargs: (
        outputs.append(compiled_stack.through_layers(*args, **kwargs)) or outputs[-1]
    )
    with no_grad(), stack.running():
        ours = layers[2](layers[1](layers[0](x)))
    with no_grad():
        theirs = layers[2](layers[1](layers[0](x)))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert len(outputs) == 3 and all(ours.data_ptr() != out.data_ptr() for out in outputs)
    assert all(p.grad is None for layer in layers for p in layer.parameters())


def test_train_a_lora_adapter_on_the_stack_equals_grpo_trainer(tmp_path, tmp_root):  # noqa: F811
    """A PEFT model (LoRA on q and v inside each layer, everything else frozen alike in every layer)."""
    pytest.importorskip("peft", reason="peft is in the test extras")
    losses, grads, trainer = train(tmp_path, CompiledGRPOTrainer, "eager", False, True, padding_free="pack",
                                   packed_attention="sdpa", skip_zero_advantage=False,
                                   compile_backbone="stack")  # fmt: skip
    assert set(trainer.backbone_stacks) and packed_share(trainer) > 0.5
    assert_steps_equal((losses, grads), grpo_trainer_run("eager", False, tmp_root, True))
