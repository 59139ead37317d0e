"""The decoder layers of a packed forward run as a few compiled calls (`compile_backbone="stack"`, the default on a
GPU; "stack-graphs" replays the calls as CUDA graphs: `stack_graphs`).

Compiled by region, a checkpointed step calls 28 compiled layers three times each per micro-batch (forward,
recomputation, backward), each call paying the host's cost of a compiled call (guards, AOTAutograd's wrappers,
Inductor's launcher, checkpointing's hooks). Here the layers run in a few equal groups, each group one call of a
compiled function: each layer's call a `torch.compiler.nested_compile_region` (compiled once, called per layer with
its own parameters), checkpointed inside that region where the model checkpoints, so that the recomputations and
backwards of a group's layers run inside one compiled backward, each layer recomputed just before its own backward.
(A checkpoint around each region instead let AOTAutograd save only the first layer's input and recompute every layer
at the start of the backward, holding all their activations at once: 13.4 GiB against GRPOTrainer's 5.2 at 1.5B,
torch 2.11 on an H100.) Measured on a CPU (`benchmarks.diagnostics.layer_calls`): a third of regional compile's host
time per checkpointed layer call.

A compiled backward returns its parameters' gradients together, all alive until they are added to `.grad`, so a
group holds as many layers as keep them within `GRADIENTS_PER_CALL` (one call for all the layers took 0.63 GiB more
at its peak than regional compile at Qwen2.5-0.5B, 2.26 GiB at 1.5B: torch 2.11, an H100). Packed rows are padded to
a few capacities (`packing.Shapes(fixed=True)`); a kind of call's first graph is static and, where a later call's
shapes or lengths differ, one more graph takes them as dynamic (dynamo's automatic dynamic shapes): a few graphs per
kind of call whatever the lengths (two, or three where torch 2.13.0 failed to evaluate the first dynamic graph's
guards). Static graphs, one per capacity, recompiled the whole stack at every new capacity of a `train()` run (30-40
s each on an H100's host). Where compiling fails on the dynamic lengths (`COMPILE_FAILURES`; torch 2.13.0 once did,
on a CPU stand-in of varlen attention with shared prompts), the stack compiles static shapes from then on, said once.

How it runs inside transformers' own model forward, whatever its version: while a packed forward runs (`running`),
a group's first layer's call runs the group (the rest of the loop handing its hidden states through untouched), and
the layers' own checkpointing is switched off for that forward (the compiled function checkpoints each layer with the
same settings instead). Every layer must be called with the first one's arguments (one mask for all: models whose
layers attend differently, e.g. sliding-window layers, are refused at `check`), and nothing may run between two
layers; both are checked at every call (`Refused`: where "auto" chose the stack, the trainer compiles the layers by
region alone from then on). Only the layers' loop is compiled: an op after the last nested region in the same
compiled graph gave wrong parameter gradients (torch 2.13.0, CPU), so the final norm stays outside.

A nested region must be captured whole, and its inputs may not alias one another (the packed attention's
boundaries are tensors of their own for that). Where dynamo cannot capture a call (a graph break inside a layer's
call, e.g. in an attention function that this torch cannot trace), that kind of call (with or without grad,
checkpointed or not, its keyword arguments' names: a forward sharing prompts passes more) runs its layers one by one
as the model runs them outside the stack from then on (`layer_by_layer`), said once with dynamo's reason, and the
other kinds stay on the stack.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch

from compiled_grpo.integrations.trl.stack_graphs import grads_outside_graphs, own_outputs

# What dynamo raises where it cannot capture a call as one graph: a graph break inside a nested region, or one
# that dynamo does not support.
CAPTURE_FAILURES = (torch._dynamo.exc.UncapturedHigherOrderOpError, torch._dynamo.exc.Unsupported)
# What compiling on dynamic lengths raised: torch 2.13.0 an internal KeyError where dynamo reuses a nested region on a
# size the layer specializes (with every size dynamic); 2.14.1 Inductor's GuardOnDataDependentSymNode before float
# arguments were specialized (`dynamo_settings`).
COMPILE_FAILURES = (torch._dynamo.exc.InternalTorchDynamoError, torch._dynamo.exc.BackendCompilerFailed,
                    torch._dynamo.exc.TorchRuntimeError)  # fmt: skip
# The gradients one compiled call may hold at once (`layers_per_call`): 4 of Qwen2.5-1.5B's layers in bf16 (372 MB),
# 12 of 0.5B's, one of 7B's.
GRADIENTS_PER_CALL = 512 * 2**20


def call_layer(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict):
    """One layer's call with its hooks, bypassing its compiled call (which `running` points at the stack)."""
    return layer._call_impl(hidden, **kwargs)


def checkpointed_layer(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict, checkpoint: dict):
    """One layer's call checkpointed with `checkpoint`, `torch.utils.checkpoint.checkpoint`'s keyword arguments."""
    return torch.utils.checkpoint.checkpoint(functools.partial(call_layer, layer, kwargs=kwargs), hidden, **checkpoint)


def plain_layer(layer: torch.nn.Module, hidden: torch.Tensor, kwargs: dict):
    """One layer's call, not checkpointed (both regions call `call_layer` by name, so one replacement reaches both)."""
    return call_layer(layer, hidden, kwargs)


NESTED = hasattr(torch.compiler, "nested_compile_region")  # torch >= 2.8
_nested_call = torch.compiler.nested_compile_region(plain_layer) if NESTED else None
_nested_checkpointed = torch.compiler.nested_compile_region(checkpointed_layer) if NESTED else None


def through_layers(layers, hidden: torch.Tensor, kwargs: dict, checkpoint: dict | None):
    """`hidden` through every layer, each layer's call one nested region, checkpointed inside it with `checkpoint`
    (None: not checkpointed); what the last layer returns."""
    out = hidden
    for layer in layers:
        if checkpoint is None:
            out = _nested_call(layer, hidden, kwargs)
        else:
            out = _nested_checkpointed(layer, hidden, kwargs, checkpoint)
        hidden = out[0] if isinstance(out, tuple) else out
    return out


class Refused(RuntimeError):
    """The stack cannot run this model's layers, found as they run (`reason`): where "auto" chose the stack the
    trainer compiles the layers by region alone from then on, else this is raised."""

    def __init__(self, reason: str):
        super().__init__(f"compile_backbone's stack: {reason}; choose compile_backbone=True for this model")
        self.reason = reason


def capture_failure(error: Exception) -> str:
    """Dynamo's reason, on one line (its message spans several, the first naming only the kind of failure)."""
    return " ".join(str(error).split())[:400] or type(error).__name__


class Stack:
    """A model's decoder layers, run as a few compiled calls (groups of `per_call` layers) inside `running()`."""

    RECOMPILE_LIMIT = 64  # a few graphs per kind of call, per model: may pass dynamo's default 8

    def __init__(self, layers: list[torch.nn.Module], say=warnings.warn, graphs: bool = False):
        """`graphs`: the compiled calls replayed as CUDA graphs (Inductor's CUDA-graph trees, a recording per shape;
        the checkpointing is inside the compiled graph, so its recomputation replays with the backward;
        `stack_graphs` says what else they need)."""
        self.layers, self.say = layers, say
        # each layer's parameters listed once: walking the modules at every call cost the host 17 ms per micro-batch
        # at 1.5B (7 groups x 28 layers); their requires_grad is still read at every call
        self.parameters = [list(layer.parameters()) for layer in layers]
        self.per_call = layers_per_call(layers)
        self.settings = dynamo_settings(self.RECOMPILE_LIMIT)  # the dynamo config every call of the stack runs under
        # fullgraph: a graph break must fail the capture (`CAPTURE_FAILURES`), not split the stack silently (inside a
        # layer's checkpoint, dynamo would run that checkpoint eagerly instead). dynamic=None: automatic dynamic
        # shapes, only what changes between calls made dynamic (dynamic=True makes every size symbolic, and a size
        # that the layer then specializes, e.g. the hidden size, broke dynamo's reuse of the nested region:
        # InternalTorchDynamoError KeyError, torch 2.13.0)
        self.graphs = graphs
        options = {"options": {"triton.cudagraphs": True}} if graphs else {}
        self.compiled = torch.compile(through_layers, dynamic=None, fullgraph=True, **options)
        self.static = torch.compile(through_layers, dynamic=False, fullgraph=True, **options)  # where dynamic fails
        self.kwargs, self.out, self.final, self.own = None, None, None, None
        self.one_by_one: dict[tuple, str] = {}  # the kinds of call dynamo could not capture: {kind: its reason}

    @contextlib.contextmanager
    def running(self):
        """Inside the block a call of a group's first layer runs the group (compiled), its others hand on its output."""
        first, checkpointing = self.layers[0], getattr(self.layers[0], "gradient_checkpointing", False)
        in_training = first.training and torch.is_grad_enabled()
        checkpoint = checkpoint_settings(first) if checkpointing and in_training else None
        if self.graphs and torch.is_grad_enabled():
            grads_outside_graphs(self.parameters)
        self.own = [layer._compiled_call_impl for layer in self.layers], checkpointing
        stacked = [self.hand_on] * len(self.layers)
        for start in range(0, len(self.layers), self.per_call):
            stacked[start] = functools.partial(self.run_group, checkpoint, start)
        self.put(stacked, False if checkpointing else None)  # checkpointed inside the stack instead
        try:
            yield
        finally:
            self.put(self.own[0], True if checkpointing else None)
            self.kwargs, self.out, self.final, self.own = None, None, None, None

    def put(self, calls: list, checkpointing: bool | None) -> None:
        """The layers' compiled calls set to `calls`, their checkpointing to `checkpointing` (None: as it is)."""
        for layer, call in zip(self.layers, calls, strict=True):
            layer._compiled_call_impl = call
            if checkpointing is not None:
                layer.gradient_checkpointing = checkpointing

    def run_group(self, checkpoint, start: int, hidden, **kwargs):
        """The call of layer `start` (a group's first): the group's layers through, on what the group before handed
        on, with its arguments."""
        if start:
            self.check_handed_on(hidden, kwargs)
        group = self.layers[start : start + self.per_call]
        kind = (torch.is_grad_enabled(), checkpoint is not None, tuple(sorted(kwargs)))
        out = None if kind in self.one_by_one else self.captured(kind, group, hidden, kwargs, checkpoint)
        if out is None:  # a kind dynamo cannot capture
            out = self.layer_by_layer(group, hidden, kwargs)
        self.kwargs, self.out = kwargs, out
        self.final = out[0] if isinstance(out, tuple) else out
        return out

    def captured(self, kind: tuple, group: list, hidden: torch.Tensor, kwargs: dict, checkpoint: dict | None):
        """The group's layers as one compiled call; None where dynamo cannot capture this kind of call (said once)."""
        if torch.is_grad_enabled():  # every layer's call alike, as their shared nested region needs
            why_not = differently_trained(self.parameters)
            if why_not:
                raise Refused(why_not)
            if not hidden.requires_grad:  # (frozen embeddings) the first call like the others: see `check`
                hidden = hidden.detach().requires_grad_()
        try:
            with torch._dynamo.config.patch(**self.settings):
                out = self.compiled(group, hidden, kwargs, checkpoint)
            return own_outputs(out) if self.graphs and not torch.is_grad_enabled() else out
        except COMPILE_FAILURES as error:
            if self.compiled is self.static:
                raise
            self.compiled = self.static
            self.say(f"compile_backbone's stack: dynamo failed on dynamic lengths ({capture_failure(error)[:200]}), so "
                     "the stack compiles static shapes from here, a graph per packed capacity")  # fmt: skip
            return self.captured(kind, group, hidden, kwargs, checkpoint)
        except CAPTURE_FAILURES as error:
            self.one_by_one[kind] = f"{type(error).__name__}: {capture_failure(error)}"
        grad = "with grad" if kind[0] else "without grad"
        self.say(f"compile_backbone's stack: dynamo cannot run these forwards ({grad}, taking "
                 f"{', '.join(kind[2]) or 'no keywords'}) as one compiled call, so their layers run one by one on "
                 f"their compiled calls ({self.one_by_one[kind]})")  # fmt: skip
        return None

    def layer_by_layer(self, group: list, hidden: torch.Tensor, kwargs: dict):
        """The group's layers called one by one as the model calls them outside the stack (their own compiled calls
        and checkpointing), their state put back as it is outside `running` while they run, so that a checkpointed
        layer's recomputation (after the block) finds the state, and the compiled graph, that its forward found."""
        stacked, (own, checkpointing) = [layer._compiled_call_impl for layer in self.layers], self.own
        self.put(own, True if checkpointing else None)
        try:
            out = hidden
            for layer in group:
                out = layer(hidden, **kwargs)
                hidden = out[0] if isinstance(out, tuple) else out
            return out
        finally:
            self.put(stacked, False if checkpointing else None)

    def hand_on(self, hidden, **kwargs):
        """A call of a layer inside a group: the group's output, checked to be what the loop hands on with the group's
        arguments."""
        self.check_handed_on(hidden, kwargs)
        return self.out

    def check_handed_on(self, hidden, kwargs: dict) -> None:
        """That the loop hands a layer the last group's output, with the arguments the group was called with."""
        if hidden is not self.final:
            raise Refused("the model changed the hidden states between two decoder layers")
        same = kwargs.keys() == self.kwargs.keys() and all(kwargs[k] is self.kwargs[k] for k in kwargs)
        if not same:
            raise Refused("the model calls its decoder layers with different arguments (per-layer masks?)")


def layers_per_call(layers: list[torch.nn.Module]) -> int:
    """How many layers one compiled call runs: the most that divide the layers into equal groups (one graph serves
    them all) whose trained parameters' gradients fit `GRADIENTS_PER_CALL` (a compiled backward returns its
    gradients together, so a group's are all alive before they are added to `.grad`); at least one."""
    per_layer = max(sum(p.numel() * p.element_size() for p in layers[0].parameters() if p.requires_grad), 1)
    fits = max(GRADIENTS_PER_CALL // per_layer, 1)
    return max(n for n in range(1, len(layers) + 1) if len(layers) % n == 0 and n <= fits)


def checkpoint_settings(layer: torch.nn.Module) -> dict:
    """The keyword arguments the layer's checkpointing passes to `torch.utils.checkpoint.checkpoint` (transformers
    sets `_gradient_checkpointing_func` to a partial of it); non-reentrant where it says nothing."""
    func = getattr(layer, "_gradient_checkpointing_func", None)
    settings = dict(getattr(func, "keywords", {}) or {})
    settings.setdefault("use_reentrant", False)
    return settings


def recompile_limit(limit: int) -> dict:
    """Dynamo's recompile limit at `limit` (its name in this torch)."""
    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    return {name: limit}


def dynamo_settings(limit: int) -> dict:
    """Dynamo's settings while the stack compiles: its recompile limit at `limit`, and float arguments specialized
    (constants of a model, e.g. attention's scale: traced as symbolic floats, the varlen attention op failed to
    compile on dynamic lengths at Qwen2.5-7B's shapes, torch 2.11 on an H100, and the stack fell back to static
    shapes)."""
    floats = {"specialize_float": True} if hasattr(torch._dynamo.config, "specialize_float") else {}
    return recompile_limit(limit) | floats


def differently_trained(parameters: list[list[torch.nn.Parameter]]) -> str | None:
    """Why the layers' calls would not be alike under grad (None: they are): their parameters (`parameters`, each
    layer's) must require grad in one pattern, layer for layer."""
    patterns = {tuple(p.requires_grad for p in mine) for mine in parameters}
    if len(patterns) > 1:
        return "the layers' parameters do not all require grad alike (a layer frozen alone?)"
    return None


def check(model, layers: list[torch.nn.Module]) -> str | None:
    """Why `model`'s `layers` cannot run as one stack (None: they can). Its calls of one nested region must be alike:
    one mask for every layer, and inputs and parameters that require grad alike (in torch 2.13.0, a nested region's
    compiled backward made for calls whose inputs require grad served a call whose input did not, and a frozen
    layer among trained ones, both giving wrong gradients on the CPU: the stack hands the first layer an input that
    requires grad, and refuses layers trained differently)."""
    if _nested_call is None:
        return f"torch {torch.__version__} has no torch.compiler.nested_compile_region (torch >= 2.8 has)"
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = set(getattr(text, "layer_types", None) or [])
    if len(kinds) > 1:
        return f"its layers attend differently ({sorted(kinds)}), and the stack calls them all with one mask"
    if getattr(text, "num_hidden_layers", len(layers)) != len(layers):
        return f"its forward runs {text.num_hidden_layers} of its {len(layers)} layers, and the stack runs them all"
    return differently_trained([list(layer.parameters()) for layer in layers])
