"""The step users feel: TRL 1.16's GRPOTrainer against CompiledGRPOTrainer on one micro-batch, the model's forward
included (`_compute_loss` + backward), time and peak memory, every trainer of a model in one process; and the
bound any head and loss can reach: the same backbone's forward and backward with a trivial loss on its final
hidden states and no lm_head.

Models: Qwen2.5-0.5B, 1.5B and 7B shapes (V 151936) with random bf16 weights (nothing downloaded). Micro-batches
of 8 or 16 completions of 1024 tokens after 64-token prompts, dapo, in these kinds: `dense` (random advantages),
`q0.2` (top_entropy_quantile 0.2), `half0` (every other group of completions at advantage 0, as groups whose
rewards are all equal), `zero75` (three of every four groups at 0), `both` (q0.2 and half0), and `varied` (dense,
but four micro-batches taking turns whose completions end at random lengths, the longest 1024, 819, 614 and 921
tokens: the layouts a training run meets, each padded to its longest completion as TRL pads them). A group is 4
completions (B/4 for zero75 on one micro-batch: 2 of 8).

`--generation N` times a whole optimizer step instead: one generation batch of N micro-batches (N x size
completions, groups of 4) goes through the trainer's own `_prepare_inputs` (TRL's shuffle and split, and
CompiledGRPOTrainer's regrouping), each micro-batch's `_compute_loss` + backward (gradient accumulation N), then
AdamW's step (one fused AdamW shared by every trainer); the bound is the backbone's forward and backward on every
micro-batch plus the same optimizer step.

    python -m benchmarks.trl_step --model 0.5B [--batches dense,q0.2,half0,zero75,both] [--sizes 8,16]
        [--trainers grpo,auto,skip-all] [--generation 2] [--repeats 5] [--out benchmark-results]
    python -m benchmarks.trl_step --model 0.5B --headline   # README's step run, per model: 4-micro-batch steps
    python -m benchmarks.trl_step --report benchmark-results/trl-step-*.json [--out docs/benchmarks/trl-step]

On a GPU each batch kind and trainer runs in a process of its own (`--processes each`; `one` runs every row in
this process, as on the CPU): `compile_backbone` compiles the shared model's layers in place, so that a row run after
another trainer's meets that trainer's compiled code (`trl_step_processes`).

The first writes `trl-step-<model>.json` (`trl-step-<model>-step<N>.json` with `--generation`; row by row, so an
interrupted run keeps what it measured); `--report` joins such files into `trl-step.md` and `trl-step.png` (the
bound drawn as the floor line). `--model tiny` runs a small model on the CPU (a smoke test of this script).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata as md
import itertools
import json
import os
import statistics
import time
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig

from benchmarks.timing import busy_ms, run_date
from benchmarks.trl_step_batches import (
    BATCHES,
    VARIED_LONGEST,
    long_prompt_batch,
    micro_batch,
    micro_batches,
    real_tokens,
    with_tail,
)
from benchmarks.trl_step_processes import sweep_in_processes
from benchmarks.trl_step_report import report
from benchmarks.trl_step_rows import BOUND, DEFAULT_TRAINERS, TRAINERS
from compiled_grpo.integrations.trl import (
    CompiledGRPOTrainer,
    plan,
    regional_compile,
    settle,
    stack_graphs,
)

QWEN = {
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}  # fmt: skip

DEFAULTS = {"batches": ",".join(BATCHES), "sizes": "8,16", "trainers": DEFAULT_TRAINERS, "generation": 0}
# the headline run (docs/benchmarks/trl-step, README's step table): the defaults users get, against GRPOTrainer
# (whole optimizer steps, checkpointed as train() runs them, the padding-free batches and the peers a user would pick)
HEADLINE = {"batches": "dense,both,tail,tail-half0", "sizes": "8", "generation": 4,
            "trainers": "grpo,auto,skip-all,grpo-compiled-layers,grpo-liger"}  # fmt: skip


def tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "a": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_trainer(name: str, model, size: int, q: float, on_gpu: bool, completion: int, accumulation: int = 1,
                 checkpointing: bool = True):  # fmt: skip
    cls, options = TRAINERS[name]
    options = dict(options or {})
    config = options.pop("config", {})
    options.pop("compiled_layers", None)  # applied around the row's steps (`with_own_layer_calls`)
    options.pop("inductor", None)  # likewise (`with_inductor_config`)
    args = GRPOConfig(
        output_dir=f"/tmp/trl-step-{name}", per_device_train_batch_size=size, num_generations=4, report_to=[],
        save_strategy="no", max_completion_length=completion, bf16=on_gpu, use_cpu=not on_gpu,
        top_entropy_quantile=q, gradient_accumulation_steps=accumulation, gradient_checkpointing=checkpointing,
        **config,
    )  # fmt: skip
    data = Dataset.from_dict({"prompt": ["a"] * size * accumulation})
    extra = {"compiled": True, **options} if issubclass(cls, CompiledGRPOTrainer) else {}
    t = cls(model=model, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
            train_dataset=data, processing_class=tokenizer(), **extra)  # fmt: skip
    t.current_gradient_accumulation_steps = accumulation  # set by train(); this step runs outside it
    checkpoint_as_train_does(t)
    return t


def checkpoint_as_train_does(t) -> None:
    """The model's gradient checkpointing as `t.train()` sets it from `t.args` (TRL's GRPOConfig turns it on by
    default): on with the arguments' kwargs, or off. The steps here run outside `train()`; the bound runs on the
    same model, so it is checkpointed alike."""
    args, model = t.args, t.accelerator.unwrap_model(t.model)
    on = getattr(args, "activation_checkpointing", args.gradient_checkpointing)
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {})
    if not on:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()
        return
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers >= 5.20 (its every_n_layers and offload are train()'s to pop)
        kwargs.pop("every_n_layers", None), kwargs.pop("offload", None)
        enable(activation_checkpointing_kwargs=kwargs or None)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
    model.train()


def timed(steps: dict, rounds: int, on_gpu: bool, reset, warmups: int = 2) -> dict:
    """{name: (median ms, peak GiB above the memory in use before, GiB held between steps, every round's ms), or
    why not} of each `steps[name]()`, after `warmups` warm-ups.
    The steps take turns, one each per round in a rotating order, so that drift of the host's speed (the small
    models' steps are bound by it) reaches every method alike. A method whose warm-up fails is reported with its
    error, and the others are timed."""
    names, failed, held = [], {}, {}
    for name, step in steps.items():
        try:
            before = torch.cuda.memory_allocated() if on_gpu else 0
            for _ in range(warmups):
                step()
                reset()
            names.append(name)
            # what a method keeps between steps (a captured call's graphs and their memory pool), which the peak
            # above the memory in use before a step does not show
            held[name] = (torch.cuda.memory_allocated() - before) / 2**30 if on_gpu else None
        except Exception as error:  # noqa: BLE001 - reported in the method's row, never dropped
            failed[name] = "out of memory" if isinstance(error, torch.OutOfMemoryError) else failure(error)
            reset()
            if on_gpu:
                torch.cuda.empty_cache()
    times = {name: [] for name in names}
    gc.collect()
    gc.freeze()  # what is alive now is never scanned again: fewer, shorter collections inside the timed steps
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync(on_gpu)
            start = time.perf_counter()
            steps[name]()
            sync(on_gpu)
            times[name].append((time.perf_counter() - start) * 1e3)
            reset()
    gc.unfreeze()
    measured = {name: (statistics.median(times[name]), peak_of(steps[name], on_gpu, reset), held[name], times[name],
                       busy_of(steps[name], on_gpu, reset)) for name in names}  # fmt: skip
    return {**measured, **failed}


def failure(error: Exception) -> str:
    """A failed method's status: its error's type and first line."""
    first = (str(error).strip().splitlines() or [""])[0]
    print(f"a method failed: {type(error).__name__}: {first}", flush=True)
    return f"failed: {type(error).__name__}: {first[:200]}"


def with_measurement(row: dict, measured) -> dict:
    """`row` with what `timed` measured for its method: ms (the median), peak_gib, held_gib, ms_rounds (each
    round's time: the spread) and busy_ms (the GPU's busy time of one more step), or the status it failed with."""
    if isinstance(measured, str):
        row["status"] = measured
    else:
        row["ms"], row["peak_gib"], row["held_gib"], row["ms_rounds"], row["busy_ms"] = measured
    return row


def busy_of(step, on_gpu: bool, reset) -> float | None:
    """The GPU's busy time (ms) of one more `step()` (`timing.busy_ms`: each device event once); None on the CPU. A
    step whose wall clock is far above it waits on the host."""
    if not on_gpu:
        return None
    busy = busy_ms(step)
    reset()
    return busy


def pool_free_gib(captures) -> float:
    """GiB the graphs' pool reserves without a live tensor in it (the graphs' workspace between replays): memory the
    step cannot use, which an allocated peak does not show."""
    return captures.pool_free() / 2**30


def with_footprint(row: dict) -> dict:
    """`row` with footprint_gib where it can be told: the step's peak above the memory in use before it, plus
    what the method holds between steps (`held_gib`: a captured call's static buffers and the pool's live
    tensors) and the pool's free part. The comparable number to GRPOTrainer's peak."""
    if row.get("peak_gib") is not None and row.get("held_gib") is not None:
        pools_free = (row.get("pool_free_gib") or 0.0) + (row.get("inductor_pool_free_gib") or 0.0)
        row["footprint_gib"] = row["peak_gib"] + row["held_gib"] + pools_free
    return row


def sync(on_gpu: bool) -> None:
    if on_gpu:
        torch.cuda.synchronize()


def peak_of(step, on_gpu: bool, reset) -> float | None:
    """Peak GiB of one step above the memory in use before it."""
    if not on_gpu:
        return None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    reset()
    return peak


def with_own_layer_calls(model, step, by_hand: bool = False):
    """`step` with the decoder layers' calls as this row left them (compiled by the trainer's `compile_backbone`, or
    `by_hand`: each layer's call under `torch.compile`, dynamic lengths, as a user can do), eager again after it: the
    model is shared by every row of the run, so one row's compiled layers must not run in another's."""
    layers = model.model.layers
    impls = [None] * len(layers)

    def run():
        if by_hand and impls[0] is None:
            for i, layer in enumerate(layers):
                layer.compile(dynamic=True)
                impls[i] = layer._compiled_call_impl
        for layer, impl in zip(layers, impls, strict=True):
            layer._compiled_call_impl = impl
        try:
            step()
        finally:
            for i, layer in enumerate(layers):
                impls[i], layer._compiled_call_impl = layer._compiled_call_impl, None

    return run


def inductor_options(name: str) -> dict:
    """The Inductor config a row's steps compile under (e.g. `cpp_wrapper`), none for most rows."""
    return (TRAINERS.get(name, (None, None))[1] or {}).get("inductor", {})


def with_inductor_config(step, options: dict):
    """`step` with Inductor's config patched to `options` while it runs, so that what compiles in it (the row's
    own compiled layers: `with_own_layer_calls`) compiles so; the config as it was after it."""

    def run():
        with torch._inductor.config.patch(options):
            step()

    return run


def with_liger_kernels(model, config: dict, step):
    """`step` on the model with Liger's kernels patched in as `trainer.train()` patches them (its RMSNorm, SwiGLU and
    RoPE, into the model's modules and its modeling file; `_apply_liger_kernel_to_instance`), and the model as it
    was after it: the model is shared by every row of the run. What the patch changed is found by comparing each
    namespace before and after it."""
    import sys

    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    spaces = [vars(sys.modules[type(model).__module__]), *(vars(m) for m in model.modules())]
    before = [dict(space) for space in spaces]
    _apply_liger_kernel_to_instance(model=model, **(config or {}))
    patched = [{k: v for k, v in space.items() if k not in old or old[k] is not v} for space, old in
               zip(spaces, before, strict=True)]  # fmt: skip
    originals = [{k: old.get(k, MISSING) for k in new} for new, old in zip(patched, before, strict=True)]

    def put(states):
        for space, state in zip(spaces, states, strict=True):
            for key, value in state.items():
                space.pop(key) if value is MISSING else space.__setitem__(key, value)

    put(originals)

    def run():
        put(patched)
        try:
            step()
        finally:
            put(originals)

    return run


MISSING = object()


def make_plans(trainers, batches: list) -> None:
    """The micro-batches' plans (rows at advantage 0, real spans) made before timing, as in training when the
    generation batch is made (`_prepare_inputs`, which a step of one micro-batch does not call), for every
    CompiledGRPOTrainer among `trainers`."""
    compiled = [t for t in trainers if isinstance(t, CompiledGRPOTrainer)]
    if compiled:
        plan.annotate(compiled[0], batches, with_zeros=any(t.skip_reason is None for t in compiled))


def trainer_step(t, batches: list):
    """`_compute_loss` + backward on the next of `batches`; then CompiledGRPOTrainer's metrics are read back as a
    log after every step would (GRPOTrainer reads its own back inside `_compute_loss`). CompiledGRPOTrainer's
    layers are compiled (`compile_backbone`) at the first step, as `train()`'s first `_prepare_inputs` does."""
    turns = itertools.cycle(batches)

    def step():
        if isinstance(t, CompiledGRPOTrainer):
            regional_compile.compile_trainer_backbone(t)  # once; not called here, the layers would stay eager
        inputs = next(turns)
        with t.accelerator.autocast():
            loss = t._compute_loss(t.model, inputs)
        loss.backward()
        settle(t._metrics["train"])

    return step


def bound_step(model, batches: list):
    """The backbone's forward and backward with a trivial loss on the completion positions' final hidden states,
    on the next of `batches`."""
    joined = lambda b, name: torch.cat([b[f"prompt_{name}"], b[f"completion_{name}"]], 1)
    turns = itertools.cycle([(joined(b, "ids"), joined(b, "mask"), b["completion_ids"].shape[1]) for b in batches])

    def step():
        ids, mask, completion = next(turns)
        on_gpu = ids.is_cuda
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=on_gpu):
            hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            hidden[:, -completion - 1 : -1].float().square().mean().backward()

    return step


def make_model(name: str, device) -> tuple:
    """(model with random weights, bf16 on a GPU, its vocabulary size, the completion length)."""
    completion = 16 if name == "tiny" else 1024
    vocab = 1000 if name == "tiny" else 151936
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN[name], vocab_size=vocab, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    with torch.device(device):  # initialized where it runs: a 7B model's random init on the CPU takes minutes
        model = Qwen2ForCausalLM(config).to(torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)
    return model, vocab, completion


def optimizer_step(t, generation: dict, optimizer):
    """A whole optimizer step of trainer `t` over one generation batch: TRL's `_prepare_inputs` (its shuffle and
    split, and CompiledGRPOTrainer's regrouping) hands out each micro-batch, `_compute_loss` + backward on each,
    then the optimizer's step."""
    t._generate_and_score_completions = lambda batch: generation  # the generation batch, as if just sampled
    count = t.args.steps_per_generation

    def step():
        torch.manual_seed(0)  # TRL shuffles a generation batch's rows: the same order for every trainer
        for i in range(count):
            t._step = i
            inputs = t._prepare_inputs(None)
            with t.accelerator.autocast():
                loss = t._compute_loss(t.model, inputs)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        settle(t._metrics["train"])

    return step


def bound_optimizer_step(model, generation: dict, count: int, optimizer):
    """The bound of `optimizer_step`: the backbone's forward and backward with a trivial loss on each of the
    generation batch's `count` micro-batches, then the same optimizer step."""
    size = len(generation["advantages"]) // count
    part = lambda i: {k: v[i * size : (i + 1) * size] if v.dim() else v for k, v in generation.items()}
    inner = bound_step(model, [part(i) for i in range(count)])

    def step():
        for _ in range(count):
            inner()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def steps_to_time(args, model, size: int, kind: str, setup: dict) -> tuple[str, dict, dict]:
    """(the row's shape, {method: step}, {name: trainer}) for one batch kind: one micro-batch's `_compute_loss` +
    backward, or with `--generation N` a whole optimizer step over N micro-batches."""
    q, zeros = BATCHES[kind]
    names = args.trainers.split(",")
    vocab, device, on_gpu, completion = setup["vocab"], setup["device"], setup["on_gpu"], setup["completion"]
    checkpointing = args.gradient_checkpointing
    if not args.generation:
        batches = micro_batches(vocab, device, size, kind, C=completion)
        trainers = {name: make_trainer(name, model, size, q, on_gpu, completion, checkpointing=checkpointing)
                    for name in names}  # fmt: skip
        make_plans(trainers.values(), batches)
        steps = {BOUND: bound_step(model, batches)} if args.bound else {}
        steps.update({n: trainer_step(t, batches) for n, t in trainers.items()})
        steps = row_steps(model, steps, trainers)
        setup["real_tokens"] = sum(map(real_tokens, batches)) / len(batches)
        return shape_label(args, kind, size), steps, trainers
    count, optimizer = args.generation, setup["optimizer"]
    generation = micro_batch(vocab, device, size * count, zeros, C=completion, group=4)
    if kind.startswith("tail"):
        generation = with_tail(generation)
    if kind == "longprompt":
        generation = long_prompt_batch(vocab, device, size * count)
    setup["real_tokens"] = real_tokens(generation)
    trainers = {name: make_trainer(name, model, size, q, on_gpu, completion, count, checkpointing)
                for name in names}  # fmt: skip
    steps = {BOUND: bound_optimizer_step(model, generation, count, optimizer)} if args.bound else {}
    steps.update({name: optimizer_step(t, generation, optimizer) for name, t in trainers.items()})
    steps = row_steps(model, steps, trainers)
    return shape_label(args, kind, size), steps, trainers


def row_steps(model, steps: dict, trainers: dict) -> dict:
    """Each row's step with what is the row's own around it: Liger's kernels patched in, Inductor's config, and the
    decoder layers' calls as the row compiled them (the model is shared by every row)."""
    steps = dict(steps)
    steps.update({name: with_liger_kernels(model, t.args.liger_kernel_config, steps[name])
                  for name, t in trainers.items() if t.args.use_liger_kernel})  # fmt: skip
    steps.update({name: with_inductor_config(steps[name], inductor_options(name))
                  for name in trainers if inductor_options(name)})  # fmt: skip
    return {n: with_own_layer_calls(model, f, compiles_layers(n)) for n, f in steps.items()}


def compiles_layers(name: str) -> bool:
    return bool((TRAINERS.get(name, (None, None))[1] or {}).get("compiled_layers"))


def checkpointing_label(on: bool) -> str:
    """What a row's shape says of gradient checkpointing: nothing where it is on (as `train()` runs), else so."""
    return "" if on else ", no checkpointing"


def result_path(args) -> Path:
    """Where a sweep writes its rows: `trl-step-<model>[-step<N>][-nockpt].json` under `--out`."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out / (f"trl-step-{args.model}" + (f"-step{args.generation}" if args.generation else "")
                  + ("" if args.gradient_checkpointing else "-nockpt") + ".json")  # fmt: skip


def shape_label(args, kind: str, size: int) -> str:
    """A row's shape: model, batch kind, completions per micro-batch, `step/N` for whole optimizer steps, and
    checkpointing where it is off."""
    step = f" step/{args.generation}" if args.generation else ""
    return f"{args.model} {kind} x{size}{step}{checkpointing_label(args.gradient_checkpointing)}"


def runs_on_gpu(args) -> bool:
    """Whether the sweep's models run on the GPU (every model but `tiny`, where there is one)."""
    return torch.cuda.is_available() and args.model != "tiny"


def in_processes(args) -> bool:
    """Whether each batch kind and trainer runs in a process of its own (`trl_step_processes`): asked, or on a GPU
    ("auto"), where compiled layers are shared by every row of one process."""
    return args.processes == "each" or (args.processes == "auto" and runs_on_gpu(args))


def sweep(args) -> None:
    if in_processes(args):
        return sweep_in_processes(args, result_path(args), lambda kind, size: shape_label(args, kind, size))
    on_gpu = runs_on_gpu(args)
    device = "cuda" if on_gpu else "cpu"
    model, vocab, completion = make_model(args.model, device)
    # the rows share one process and one model: the decoder layer's compiled code meets every row's kind of call
    # (padded, packed on each attention, with and without grad), more than dynamo's default of 8 per code
    torch._dynamo.config.recompile_limit = 64
    reset = lambda: model.zero_grad(set_to_none=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7, fused=on_gpu) if args.generation else None
    setup = {"vocab": vocab, "device": device, "on_gpu": on_gpu, "completion": completion, "optimizer": optimizer}
    path = result_path(args)
    versions = {"gpu": torch.cuda.get_device_name() if on_gpu else "CPU", "torch": torch.__version__,
                "trl": md.version("trl"), "transformers": md.version("transformers"),
                "liger_kernel": installed("liger-kernel"), "repeats": args.repeats}  # fmt: skip
    rows, date = [], run_date()
    for size in map(int, args.sizes.split(",")):
        for kind in args.batches.split(","):
            shape, steps, trainers = steps_to_time(args, model, size, kind, setup)
            # every micro-batch twice before timing (a captured call's first two calls of a layout warm and capture)
            warmups = 2 if args.generation else 2 * (len(VARIED_LONGEST) if kind == "varied" else 1)
            for method, measured in timed(steps, args.repeats, on_gpu, reset, warmups).items():
                row = {
                    "shape": shape,
                    "model": args.model,
                    "batch": kind,
                    "size": size,
                    "method": method,
                    "real_tokens": setup["real_tokens"],
                    "gradient_checkpointing": args.gradient_checkpointing,
                    "process": os.getpid(),  # which rows ran together (`--processes`)
                }
                if args.generation:
                    row["micro_batches"] = args.generation
                captures = getattr(getattr(trainers.get(method), "fused_loss", None), "captures", None)
                if captures is not None:  # replays, the pool's reserve, and whether (and why) capture ended
                    row["replays"], row["pool_gib"] = captures.replays, captures.pool_bytes / 2**30
                    row["capture_stopped"], row["capture_failures"] = captures.stopped, captures.failures[:4]
                    row["pool_free_gib"] = pool_free_gib(captures) if on_gpu else None
                if on_gpu:  # Inductor's CUDA graphs so far in this process (a row that should replay them reads it)
                    row["inductor_graphs"], row["inductor_graph_skips"] = stack_graphs.cuda_graphs_recorded()
                stacks = (getattr(trainers.get(method), "backbone_stacks", None) or {}).values()
                if on_gpu and any(stack.graphs for stack in stacks):  # the process's graph pool: this row's graphs
                    pool, free = stack_graphs.cuda_graph_pool(torch.cuda.current_device())
                    row["inductor_pool_gib"], row["inductor_pool_free_gib"] = pool / 2**30, free / 2**30
                rows.append(with_footprint(with_measurement(row, measured)))
                print(json.dumps(row), flush=True)
            path.write_text(json.dumps({"versions": versions, "date": date, "rows": rows}, indent=1))
            del steps, trainers
            if on_gpu:
                torch.cuda.empty_cache()


def installed(package: str) -> str | None:
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=list(QWEN), default="0.5B")
    ap.add_argument("--batches", default=None, help=f"of {list(BATCHES)}; default: every kind")
    ap.add_argument("--sizes", default=None, help="completions per micro-batch; default 8,16")
    ap.add_argument("--trainers", default=None, help=f"of {list(TRAINERS)}; default {DEFAULT_TRAINERS}")
    ap.add_argument("--headline", action="store_true", help=f"the headline run's batches, sizes, trainers: {HEADLINE}")
    ap.add_argument("--repeats", type=int, default=9, help="rounds; each runs every method once")
    ap.add_argument("--generation", type=int, default=None,
                    help="time whole optimizer steps over this many micro-batches (default 0: one micro-batch; the "
                    "headline 4)")  # fmt: skip
    ap.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                    help="time the steps without gradient checkpointing (GRPOConfig's default, which train() turns "
                    "on, is on)")  # fmt: skip
    ap.add_argument("--processes", choices=("auto", "each", "one"), default="auto",
                    help="each batch kind and trainer in a process of its own (each; auto: on a GPU), or every row in "
                    "this one")  # fmt: skip
    ap.add_argument("--resume", action="store_true",
                    help="with --processes each: keep the rows the output file holds, time the others")  # fmt: skip
    ap.add_argument("--no-bound", dest="bound", action="store_false", help=argparse.SUPPRESS)  # a later child's
    ap.add_argument("--out", default="benchmark-results")
    ap.add_argument("--report", nargs="+", default=None, help="trl-step-*.json files to join into a table and picture")
    args = ap.parse_args(argv)
    for key, value in (HEADLINE if args.headline else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = [b for b in args.batches.split(",") if b not in BATCHES] + [
        t for t in args.trainers.split(",") if t not in TRAINERS
    ]
    if unknown:
        ap.error(f"unknown batch kind or trainer {unknown}; batches: {list(BATCHES)}, trainers: {list(TRAINERS)}")
    report(args) if args.report else sweep(args)


if __name__ == "__main__":
    main()
