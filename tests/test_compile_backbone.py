"""`compile_backbone=True`: the decoder layers compiled by region (Inductor on the CPU here), float32. `train()` with
gradient checkpointing, packed and trimmed, equals GRPOTrainer's eager steps; every loss type, packed and padded,
equals TRL's `_compute_loss` on eager layers; 50 micro-batches of random lengths add a bounded number of graphs;
a layer that fails to compile runs eagerly, said once."""

from __future__ import annotations

import contextlib
import itertools
import re
import types
import warnings

import pytest
import torch
import torch._dynamo.utils
from test_integration_trl import loss_and_grads
from test_padding_free import LOSS_TYPES, packed_calls, trainer_for, varied_batch, with_logps  # noqa: F401
from test_skip_zero_advantage import assert_same, tiny_qwen2, trl_loss
from test_train_checkpointed import assert_steps_equal, grpo_trainer_run, packed_share, saved_tokens, tmp_root, train  # noqa: F401

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, packing, regional_compile

pytestmark = pytest.mark.compiled


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("padding", ["pack", "trim"])
def test_train_on_compiled_layers_equals_grpo_trainer(tmp_path, tmp_root, padding):  # noqa: F811
    if padding == "pack":  # the first case compiles afresh, whatever earlier tests compiled of this layer's code
        torch._dynamo.reset()
    before = graphs()
    with pytest.warns(regional_compile.BackboneNotice) as notices:
        losses, grads, trainer = train(tmp_path, CompiledGRPOTrainer, "eager", False, padding_free=padding,
                                       packed_attention="sdpa", skip_zero_advantage=False,
                                       compile_backbone=True)  # fmt: skip
    said = [str(n.message) for n in notices if isinstance(n.message, regional_compile.BackboneNotice)]
    compiled_here = graphs() > before  # "trim" after "pack" in one process reuses its graphs (dynamic lengths)
    assert compiled_here or padding == "trim"
    assert len(said) == 1 + compiled_here and "2 Qwen2DecoderLayer layers compiled" in said[0], said  # said once
    if compiled_here:
        assert re.search(r"the first forward on compiled layers took \d+\.\d s, compiling \d+ graph", said[1]), said
    assert regional_compile.compiled(trainer.backbone_layers) and len(trainer.backbone_layers) == 2
    assert_steps_equal((losses, grads), grpo_trainer_run("eager", False, tmp_root))
    share = packed_share(trainer)  # regrouped by prompt, a micro-batch of whole groups may have too little padding
    assert (share > 0.5 and saved_tokens(trainer) > 0) if padding == "pack" else share == 0.0


def test_train_on_graphed_layers_equals_grpo_trainer(tmp_path, tmp_root):  # noqa: F811
    """`compile_backbone="graphs"`: the layers compiled with Inductor's CUDA graphs (on the CPU Inductor runs them
    without), the packed rows on fixed shapes; `train()`'s steps are GRPOTrainer's. Without gradient checkpointing,
    which it refuses."""
    with pytest.warns(regional_compile.BackboneNotice) as notices:
        losses, grads, trainer = train(tmp_path, CompiledGRPOTrainer, "eager", False, checkpointing=False,
                                       padding_free="pack", packed_attention="sdpa", skip_zero_advantage=False,
                                       compile_backbone="graphs")  # fmt: skip
    assert any("replayed as CUDA graphs" in str(n.message) for n in notices)
    assert trainer.packed_shapes.fixed and regional_compile.compiled(trainer.backbone_layers)
    assert_steps_equal((losses, grads), grpo_trainer_run("eager", False, tmp_root))
    assert packed_share(trainer) > 0.5 and saved_tokens(trainer) > 0


def test_graphed_layers_refuse_gradient_checkpointing(tmp_path):
    """Asked in GRPOConfig, at construction; switched on by hand later, at the first step's compile."""
    with pytest.raises(ValueError, match="'graphs' cannot run gradient-checkpointed layers"):
        train(tmp_path, CompiledGRPOTrainer, "eager", False, padding_free="pack", compile_backbone="graphs")
    unwrapped = types.SimpleNamespace(unwrap_model=lambda model: model)
    trainer = types.SimpleNamespace(compile_backbone="graphs", backbone_layers=None, model=tiny_qwen2().train(),
                                    ref_model=None, accelerator=unwrapped)  # fmt: skip
    trainer.model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="'graphs' cannot run gradient-checkpointed layers"):
        regional_compile.compile_trainer_backbone(trainer)
    assert trainer.backbone_layers is None


def test_train_a_lora_adapter_on_compiled_layers_equals_grpo_trainer(tmp_path, tmp_root):  # noqa: F811
    """A PEFT model (LoRA on q and v inside each layer): its layers compiled by region with the adapters in them,
    packed; the adapter's gradients are GRPOTrainer's at every step."""
    pytest.importorskip("peft", reason="peft is in the test extras")
    losses, grads, trainer = train(tmp_path, CompiledGRPOTrainer, "eager", False, True, padding_free="pack",
                                   packed_attention="sdpa", skip_zero_advantage=False,
                                   compile_backbone=True)  # fmt: skip
    assert regional_compile.compiled(trainer.backbone_layers) and len(trainer.backbone_layers) == 2
    assert_steps_equal((losses, grads), grpo_trainer_run("eager", False, tmp_root, True))
    assert packed_share(trainer) > 0.5 and any("lora_" in name for name in grads[0]) and saved_tokens(trainer) > 0


@contextlib.contextmanager
def layers_compiled(trainer, must_run=True):
    """The trainer's decoder layers compiled inside the block; with `must_run`, their compiled calls must have run
    in it (counted), so an uncompiled run cannot pass for a compiled one."""
    trainer.backbone_layers = regional_compile.compile_layers(trainer.model)
    calls = []
    for layer in trainer.backbone_layers:
        impl = layer._compiled_call_impl
        layer._compiled_call_impl = lambda *a, impl=impl, **k: calls.append(1) or impl(*a, **k)
    try:
        yield
    finally:
        regional_compile.uncompile(trainer.backbone_layers)
    assert calls or not must_run, "no compiled layer ran"


@pytest.mark.parametrize("padding", ["pack", False])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_on_compiled_layers_equals_trl(tmp_path, loss_type, padding):
    trainer = trainer_for(tmp_path, loss_type=loss_type)
    trainer.padding_free_mode = padding
    inputs = with_logps(trainer, varied_batch(), 0.0)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)  # eager layers
    with layers_compiled(trainer):
        ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert_same(ours, theirs)


def test_fifty_micro_batches_of_random_lengths_add_a_bounded_number_of_graphs(tmp_path):
    """Packed rows of 50 different lengths (bucket 1) and trimmed widths: after the first micro-batches (one graph
    per kind of call: with grad, without, and their backward), no length recompiles."""
    trainer = trainer_for(tmp_path, loss_type="dapo")
    trainer.packed_shapes = packing.Shapes(1)
    g = torch.Generator().manual_seed(0)
    with layers_compiled(trainer):
        counts = []
        for step in range(50):
            inputs = varied_batch(seed=step)
            shorter = torch.randint(1, 10, (6,), generator=g)  # completions cut to random lengths
            inputs["completion_mask"] = inputs["completion_mask"] * (torch.arange(9) < shorter[:, None])
            inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()
            trainer.padding_free_mode = "pack" if step % 2 else "trim"
            loss_and_grads(trainer._compute_loss, trainer, inputs)
            counts.append(graphs())
    assert counts[-1] - counts[3] <= 2, counts  # at most a graph for a shape kind first met late (a length of 1)


def assert_falls_back_to_eager_layers(tmp_path, monkeypatch, backend, said: str) -> None:
    """With the layers compiled by `backend`, which fails: the first step says `said`, runs the layers eagerly again
    and gives TRL's loss and gradients."""

    def compile_failing(model, graphs=False):
        layers = regional_compile.repeated_layers(model)
        for layer in layers:
            layer.compile(backend=backend, dynamic=True)
        return layers

    monkeypatch.setattr(regional_compile, "compile_layers", compile_failing)
    torch._dynamo.reset()  # the layers' code was compiled by Inductor above: a new backend would only recompile
    trainer = trainer_for(tmp_path, loss_type="dapo")
    inputs = with_logps(trainer, varied_batch(), 0.0)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    trainer.compile_backbone = True
    regional_compile.compile_trainer_backbone(trainer)
    with pytest.warns(regional_compile.BackboneNotice, match=said):
        ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert not regional_compile.compiled(trainer.backbone_layers)
    assert_same(ours, theirs)
    torch._dynamo.reset()


def test_a_layer_that_fails_to_compile_runs_eagerly_and_says_why(tmp_path, monkeypatch):
    def failing_backend(graph, example_inputs):
        raise RuntimeError("this backend cannot compile")

    assert_falls_back_to_eager_layers(tmp_path, monkeypatch, failing_backend, "cannot compile.*run eagerly from here")


def test_a_layer_whose_backward_fails_to_compile_runs_eagerly_and_says_why(tmp_path, monkeypatch):
    """A forward that compiles and a backward that does not: found in the forward (before any gradient exists), the
    layers eager again, this micro-batch's loss and gradients TRL's."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def failing_backward(graph, example_inputs):
        raise RuntimeError("this backward cannot compile")

    backend = aot_autograd(fw_compiler=lambda graph, inputs: make_boxed_func(graph.forward),
                           bw_compiler=failing_backward)  # fmt: skip
    assert_falls_back_to_eager_layers(tmp_path, monkeypatch, backend, "backward cannot compile.*run eagerly from here")


def test_generation_runs_on_eager_layers(tmp_path):
    trainer = trainer_for(tmp_path, loss_type="dapo")
    with layers_compiled(trainer, must_run=False):
        assert regional_compile.compiled(trainer.backbone_layers)
        with regional_compile.eager_layers(trainer):
            assert not any(layer._compiled_call_impl for layer in trainer.backbone_layers)
        assert regional_compile.compiled(trainer.backbone_layers)


def test_a_first_forward_that_compiles_nothing_claims_no_compiling(tmp_path):
    trainer = trainer_for(tmp_path, loss_type="dapo")
    with layers_compiled(trainer, must_run=False):
        trainer.backbone_timed = False
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert regional_compile.forward_or_fall_back(trainer, lambda: "no layer ran") == "no layer ran"
    assert not [w for w in seen if isinstance(w.message, regional_compile.BackboneNotice)]
    assert trainer.backbone_timed is False  # the first forward that compiles is still said


def test_compile_backbone_takes_auto_graphs_or_a_bool(tmp_path):
    for bad in ("yes", 1, None):
        expected = "compile_backbone: expected 'auto', 'graphs', 'stack', 'stack-graphs', True or False"
        with pytest.raises(TypeError, match=expected):
            train(tmp_path, CompiledGRPOTrainer, "sdpa", False, compile_backbone=bad)


def test_auto_compiles_on_a_gpu_where_no_engine_shards_the_parameters():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert regional_compile.effective_mode("auto", cuda, shards_parameters=False) == "stack"
    assert regional_compile.effective_mode("auto", cuda, shards_parameters=False, deepspeed=True) is True
    assert regional_compile.effective_mode("auto", cuda, shards_parameters=True) is False
    assert regional_compile.effective_mode("auto", cpu, shards_parameters=False) is False
    assert regional_compile.effective_mode(True, cpu, shards_parameters=True) is True


FRESH_NAMES = itertools.count()


def last_graph_run_after_a_static_then_a_dynamic_compile() -> int:
    """Which of a function's two graphs runs a call both accept: the static one compiled first (0) or the dynamic
    one dynamo compiled at the second shape (1)."""
    ran: list[int] = []
    compiled_graphs = 0

    def backend(graph, example_inputs):
        nonlocal compiled_graphs
        index, compiled_graphs = compiled_graphs, compiled_graphs + 1
        return lambda *args: (ran.append(index), graph(*args))[1]

    # a code object and name of its own: dynamo keeps graphs per code object, and what it saw of shapes per name
    code = (lambda x: x * 2).__code__.replace(co_name=f"double_{next(FRESH_NAMES)}")
    double = torch.compile(types.FunctionType(code, globals()), backend=backend)
    for size in (3, 4, 3):
        double(torch.ones(size))
    assert compiled_graphs == 2
    return ran[-1]


def test_compiled_layers_make_a_recomputation_run_its_forwards_graph(monkeypatch):
    monkeypatch.setattr(torch._dynamo.config, "automatic_dynamic_local_pgo", False)  # a first graph static each time
    torch._C._dynamo.eval_frame._set_lru_cache(True)  # dynamo's default: the most recently used valid graph first
    assert last_graph_run_after_a_static_then_a_dynamic_compile() == 1
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    assert len(regional_compile.compile_layers(torch.nn.Sequential(layers))) == 2
    assert last_graph_run_after_a_static_then_a_dynamic_compile() == 0


def test_the_graphed_stack_is_refused_under_deepspeed():
    """DeepSpeed's gradient hooks would add into buffers of the graphs' pool: refused at construction."""
    trainer = types.SimpleNamespace(is_deepspeed_enabled=True, args=types.SimpleNamespace(gradient_checkpointing=True))
    with pytest.raises(ValueError, match="'stack-graphs' is not run under DeepSpeed.*choose compile_backbone='stack'"):
        regional_compile.configure(trainer, "stack-graphs")


def test_a_graphed_stack_that_keeps_recording_says_so_once(monkeypatch):
    """`regional_compile.watch_graph_recording`, once per generation batch: graphs recorded in the first batches are the
    shapes' first meetings and pass silently; new graphs after them are said once, naming "stack"; a stack without
    graphs, or off a GPU, reads no count."""
    from compiled_grpo.integrations.trl import stack_graphs

    counts = iter([10, 20, 25, 25, 30, 40])
    monkeypatch.setattr(stack_graphs, "cuda_graphs_recorded", lambda device_index=0: (next(counts), 0))
    gpu = types.SimpleNamespace(device=torch.device("cuda", 0))
    watch = {"batches": 0, "recorded": 0, "said": False}
    trainer = types.SimpleNamespace(compile_backbone="stack-graphs", graph_recording=watch, accelerator=gpu)
    said = []
    for _ in range(6):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            regional_compile.watch_graph_recording(trainer)
        said.append([str(w.message) for w in caught if issubclass(w.category, regional_compile.BackboneNotice)])
    assert [len(messages) for messages in said] == [0, 0, 0, 0, 1, 0], said
    assert "5 new CUDA graphs" in said[4][0] and "generation batch 5" in said[4][0] and "'stack'" in said[4][0]
    for mode, device in (("stack", torch.device("cuda", 0)), ("stack-graphs", torch.device("cpu"))):
        other = types.SimpleNamespace(compile_backbone=mode, graph_recording=None,
                                      accelerator=types.SimpleNamespace(device=device))  # fmt: skip
        regional_compile.watch_graph_recording(other)  # reads nothing: `counts` is spent, `graph_recording` None
