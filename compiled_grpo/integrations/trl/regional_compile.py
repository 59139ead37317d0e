"""The backbone compiled by region: each repeated decoder layer's call under `torch.compile(dynamic=True)`, in place.

A model's decoder layers are one class repeated: compiled by region, they share one compiled code object (dynamo
inlines the module, its parameters are the graph's inputs), and a dynamic sequence length lets a new packed or
trimmed length reuse it. `nn.Module.compile` compiles a module's own call in place, so parameter names, hooks
(FSDP2's, PEFT's adapters inside the layer) and gradient checkpointing (transformers checkpoints inside the layer's
forward) stay as they are; accelerate's `compile_regions` returns a copy of the model instead, which a trainer that
keeps its model cannot use.

CompiledGRPOTrainer compiles at its first step (`_prepare_inputs`), after accelerate has wrapped the model (FSDP2
units, DDP), the policy's layers and the reference model's; the first compiled forward's time is said once; where
compiling fails at a layer's first call, the layers run eagerly again and the reason is said once
(`BackboneNotice`). `compile_backbone="graphs"` also replays each compiled layer as CUDA graphs (Inductor's
`reduce-overhead`), a graph per shape, the packed rows padded to a few fixed capacities (`packing.Shapes`) so that
the shapes are few: the host then launches one graph per layer call instead of its kernels. Not under gradient
checkpointing, which it refuses (`graphs_refused`): on an H100 (torch 2.11) the recomputation in the backward read a
layer's output that a later replay of Inductor's CUDA-graph trees had overwritten.
`compile_backbone="stack"` compiles the layers so too, and runs a packed forward's layers as a few compiled calls
(groups of layers) on those fixed capacities (`compiled_stack`), where a model's layers can run so (else it says why
and compiles them by region alone).
`compile_backbone="stack-graphs"` replays the stack's calls as CUDA graphs (`stack_graphs`): a graph per shape, so it
pays where the shapes repeat; in `train()`, where each step packs new lengths, recording the new shapes' graphs
costs more than the replays save over the first steps (docs/performance.md).
`compile_backbone="auto"` (the default) runs the stack on a GPU where no engine shards the parameters (by region
under DeepSpeed ZeRO-2, and where the step is not packed; measured on an H100, Qwen2.5 shapes, `train()` with its
generation: 3.09x GRPOTrainer's optimizer step at 1.5B, 2.26x at 7B, docs/performance.md); ZeRO-3 and FSDP run
eagerly unless `compile_backbone=True`, and so does the CPU (a real model's layers take minutes to compile there).
"""

from __future__ import annotations

import contextlib
import time
import warnings

import torch
import torch._dynamo.utils

from ... import kernels
from . import compiled_stack, stack_graphs

MODES = ("auto", "graphs", "stack", "stack-graphs", True, False)
STACKS = ("stack", "stack-graphs")  # the modes that run a packed forward's layers as a few compiled calls


class BackboneNotice(UserWarning):
    """What `compile_backbone` compiled, or why the layers run eagerly."""


def repeated_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: the members of its longest `nn.ModuleList` of one class (a decoder's layers)."""
    best: list[torch.nn.Module] = []
    for module in model.modules():
        longer = isinstance(module, torch.nn.ModuleList) and len(module) > len(best)
        if longer and len({type(child) for child in module}) == 1:
            best = list(module)
    return best if len(best) > 1 else []


def compile_layers(model: torch.nn.Module, graphs: bool = False) -> list[torch.nn.Module]:
    """The model's repeated layers, each one's call compiled in place (dynamic shapes), with `graphs` replayed as
    CUDA graphs (Inductor's `reduce-overhead`: a graph recorded per shape, on a GPU); the layers."""
    layers = repeated_layers(model)
    for layer in layers:
        layer.compile(dynamic=True, **({"mode": "reduce-overhead"} if graphs else {}))
    if layers:
        pick_graphs_in_compile_order()
    return layers


def pick_graphs_in_compile_order() -> None:
    """Dynamo runs the first of a code's valid graphs in the order they were compiled, not the most recently used
    first (this process's setting): a checkpointed layer's recomputation then runs the graph its forward ran. Where
    two graphs of the layer's code accept the same call (a static one and the dynamic one compiled after it), the
    most-recent-first order can switch between a forward and its recomputation, whose saved tensors then differ
    (pytorch issue 166926)."""
    set_lru = getattr(torch._C._dynamo.eval_frame, "_set_lru_cache", None)
    if set_lru is not None:
        set_lru(False)


def stack_layers(trainer, models: list) -> None:
    """Each model's layers set up to run a packed forward as a few compiled calls (`compiled_stack.Stack`), where
    they can (said where not); `trainer.backbone_stacks`, by the model's id."""
    mode = getattr(trainer, "padding_free_mode", None)
    why_not = "an engine shards the parameters" if trainer.shards_parameters else None
    if mode != "pack":
        why_not = f"it runs packed forwards as one call, and micro-batches are not packed here (they run {mode!r})"
    graphs = trainer.compile_backbone == "stack-graphs"
    for model in models:
        layers = repeated_layers(model)
        why_not = why_not or compiled_stack.check(model, layers)
        if why_not:
            say(f"compile_backbone={trainer.backbone_asked!r}: {why_not}; the layers are compiled by region alone")
            trainer.backbone_stacks = {}
            return
        trainer.backbone_stacks[id(model)] = compiled_stack.Stack(layers, say, graphs=graphs)


def stack_of(trainer, model):
    """The stack of `model`'s layers (`stack_layers`), or None."""
    stacks = getattr(trainer, "backbone_stacks", None)
    return stacks.get(id(trainer.accelerator.unwrap_model(model))) if stacks else None


def uncompile(layers: list[torch.nn.Module]) -> None:
    """The layers' calls eager again."""
    for layer in layers:
        layer._compiled_call_impl = None


def compiled(layers: list[torch.nn.Module]) -> bool:
    return bool(layers) and all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers)


def say(message: str) -> None:
    warnings.warn(f"compiled_grpo: {message}", BackboneNotice, stacklevel=kernels.frames_to_caller())


def check_mode(compile_backbone) -> None:
    named = isinstance(compile_backbone, str) and compile_backbone in MODES
    if not (compile_backbone is True or compile_backbone is False or named):  # not 1, not None
        raise TypeError(
            f"compile_backbone: expected 'auto', 'graphs', 'stack', 'stack-graphs', True or False, got "
            f"{compile_backbone!r}"
        )


def configure(trainer, compile_backbone) -> None:
    """The trainer's choice (`effective_mode`; `check_mode` checked it before), nothing compiled yet
    (`compile_trainer_backbone` does it)."""
    deepspeed = getattr(trainer, "is_deepspeed_enabled", False)
    if compile_backbone == "graphs" and checkpointing_asked(trainer.args):
        raise ValueError(graphs_refused())
    if compile_backbone == "stack-graphs" and deepspeed:
        raise ValueError("compile_backbone='stack-graphs' is not run under DeepSpeed (its gradient hooks would add "
                         "into buffers of the graphs' pool); choose compile_backbone='stack' or 'auto'")  # fmt: skip
    trainer.backbone_asked = compile_backbone
    trainer.compile_backbone = effective_mode(
        compile_backbone, trainer.accelerator.device, trainer.shards_parameters, deepspeed
    )
    trainer.backbone_layers, trainer.backbone_timed, trainer.backbone_stacks = None, False, {}
    trainer.graph_recording = {"batches": 0, "recorded": 0, "said": False}  # `watch_graph_recording`


def graphs_refused() -> str:
    return ("compile_backbone='graphs' cannot run gradient-checkpointed layers: the recomputation in the backward "
            "reads layer outputs that later CUDA-graph replays overwrite; choose compile_backbone='auto' (the stack) "
            "or turn gradient_checkpointing off")  # fmt: skip


def checkpointing_asked(args) -> bool:
    """Whether the trainer's arguments turn gradient checkpointing on (its name in transformers >= 5.20 first)."""
    asked = getattr(args, "activation_checkpointing", None)
    return bool(getattr(args, "gradient_checkpointing", False) if asked is None else asked)


def effective_mode(mode, device: torch.device, shards_parameters: bool, deepspeed: bool = False):
    """What "auto" means here: on a GPU where no engine (ZeRO-3, FSDP) shards the parameters, the stack (`"stack"`:
    the fewest compiled calls; where the step is not packed it compiles by region alone; not replayed as CUDA graphs,
    whose recording of each new shape cost `train()` more than it saved, docs/performance.md), by region under
    DeepSpeed (ZeRO-2: the stack is not measured under its gradient hooks); nothing elsewhere."""
    if mode != "auto":
        return mode
    if device.type != "cuda" or shards_parameters:
        return False
    return True if deepspeed else "stack"


def compile_trainer_backbone(trainer) -> None:
    """Where the trainer compiles its backbone, and in training: the policy's (and the reference model's) decoder
    layers compiled, once per trainer; said once."""
    if not trainer.compile_backbone or not trainer.model.training or trainer.backbone_layers is not None:
        return
    models = [trainer.accelerator.unwrap_model(trainer.model)]
    if getattr(trainer, "ref_model", None) is not None:
        models.append(trainer.accelerator.unwrap_model(trainer.ref_model))
    graphs = trainer.compile_backbone == "graphs"
    if graphs and any(getattr(model, "is_gradient_checkpointing", False) for model in models):
        raise ValueError(graphs_refused())
    trainer.backbone_layers = [layer for model in models for layer in compile_layers(model, graphs)]
    if not trainer.backbone_layers:
        say("compile_backbone: no repeated layers found in the model; its forwards run eagerly")
        return
    if trainer.compile_backbone in STACKS:
        stack_layers(trainer, models)
    kind = type(trainer.backbone_layers[0]).__name__
    how = ", replayed as CUDA graphs (one per packed capacity)" if graphs else ""
    say(f"compile_backbone: {len(trainer.backbone_layers)} {kind} layers compiled by region (torch.compile, dynamic "
        f"lengths{how}); the first step compiles them (tens of seconds), later lengths reuse the code")  # fmt: skip


@contextlib.contextmanager
def eager_layers(trainer):
    """Inside the block the trainer's compiled layers run eagerly (generation: one token at a time against a cache,
    which a compiled layer would trace anew), compiled again after it."""
    layers = getattr(trainer, "backbone_layers", None) or []
    impls = [getattr(layer, "_compiled_call_impl", None) for layer in layers]
    uncompile(layers)
    try:
        yield
    finally:
        for layer, impl in zip(layers, impls, strict=True):
            layer._compiled_call_impl = impl


def forward_or_fall_back(trainer, forward):
    """`forward()`, and where a compiled layer fails to compile in it (its backward included:
    `backward_compiled_with_forward`), the layers eager again (said once, with the reason) and `forward()` once more;
    where the stack finds as it runs that it cannot run the model's layers (`compiled_stack.Refused`) and "auto" chose
    it, the layers on their regional calls from then on (said once), else the refusal raised.
    The first compiled forward's time (mostly compiling) is said once."""
    layers = getattr(trainer, "backbone_layers", None) or []
    if not compiled(layers):
        return forward()
    start, graphs = time.perf_counter(), compiled_graphs()
    try:
        with backward_compiled_with_forward():
            result = forward()
    except compiled_stack.Refused as refused:
        if trainer.backbone_asked in STACKS:
            raise
        trainer.backbone_stacks = {}
        say(f"compile_backbone={trainer.backbone_asked!r}: {refused.reason}; the layers are compiled by region alone "
            "from here")  # fmt: skip
        return forward()
    except (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.Unsupported,
            torch._dynamo.exc.TorchRuntimeError, torch._dynamo.exc.InternalTorchDynamoError) as error:  # fmt: skip
        uncompile(layers)
        trainer.backbone_stacks = {}
        cause = getattr(error, "inner_exception", None) or error.__cause__ or error  # the backend's own error
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        say(f"compile_backbone: compiling the decoder layers failed ({type(error).__name__}: "
            f"{type(cause).__name__}: {first[:300]}); they run eagerly from here")  # fmt: skip
        return forward()
    new_graphs = compiled_graphs() - graphs
    if not trainer.backbone_timed and new_graphs:  # said where it compiled (this process may hold the code already)
        trainer.backbone_timed = True
        say(
            f"compile_backbone: the first forward on compiled layers took {time.perf_counter() - start:.1f} s, "
            f"compiling {new_graphs} graph(s), the backward with them; a new kind of call, e.g. without grad, "
            "compiles once more"
        )
    return result


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def backward_compiled_with_forward():
    """Inside the block a compiled layer's backward is compiled when its forward is (AOTAutograd otherwise compiles
    it at the first backward, or, with dynamic shapes, with the forward but keeps a failure for the backward), so
    that a backward that cannot compile fails in the forward, where the trainer falls back to eager layers, instead
    of in the optimizer step's backward, where nothing can."""
    if not hasattr(torch._functorch.config, "force_non_lazy_backward_lowering"):  # torch before it had the option
        return contextlib.nullcontext()
    return torch._functorch.config.patch(force_non_lazy_backward_lowering=True)


# generation batches: a run whose micro-batches take few shapes has recorded its graphs by then
GRAPHS_SETTLED_AFTER = 2


def watch_graph_recording(trainer) -> None:
    """Called once per generation batch: where the stack replays CUDA graphs on a GPU and graphs are still being
    recorded after the first `GRAPHS_SETTLED_AFTER` batches (each step's micro-batches bring new shapes, and recording
    costs more than the replays save), said once, with the count and the mode to choose instead."""
    if trainer.compile_backbone != "stack-graphs" or trainer.accelerator.device.type != "cuda":
        return
    watch = trainer.graph_recording
    recorded, _ = stack_graphs.cuda_graphs_recorded(trainer.accelerator.device.index or 0)
    new, watch["recorded"], watch["batches"] = recorded - watch["recorded"], recorded, watch["batches"] + 1
    if new and watch["batches"] > GRAPHS_SETTLED_AFTER + 1 and not watch["said"]:
        watch["said"] = True
        say(f"compile_backbone='stack-graphs': {new} new CUDA graphs recorded in the steps before generation batch "
            f"{watch['batches']}: the micro-batches keep bringing new shapes, whose recording costs more than their "
            "replays save; compile_backbone='stack' (the default) runs the same stack without graphs")  # fmt: skip
