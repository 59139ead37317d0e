"""On a GPU (skipped elsewhere): CompiledGRPOTrainer's packed step under SDPA, FlexAttention and torch's varlen
FlashAttention, bf16 autocast, equals GRPOTrainer's padded step to bf16 rounding (loss, every gradient, entropy),
with gradient checkpointing off and on (reentrant and not: the checkpointed layers recompute under the attention
their forward ran), on a model of the packed attention and of another one (dispatched per call); its packed rows
equal each row forwarded alone; the packed step on decoder layers compiled by region equals it too; and
`trainer.train()` runs 3 optimizer steps with every default (compiled layers, varlen packing) at the 0.5B and 7B
shapes, checkpointing on."""

from __future__ import annotations

import collections
import contextlib
import traceback
import warnings

import pytest
import torch
from datasets import Dataset
from test_compile_backbone import layers_compiled
from test_integration_trl import VOCAB, digit_reward, loss_and_grads, tokenizer
from test_padding_free import COMPLETIONS, PROMPTS, B, C, varied_batch
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from compiled_grpo.integrations.trl import (
    CompiledGRPOTrainer,
    compiled_stack,
    packed_attention,
    packing,
    padding_free,
    plan,
    regional_compile,
    settle,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.fixture
def fresh_compiler():
    """Dynamo's caches and Inductor's CUDA-graph trees as a new process has them: a test that compiles decoder layers
    meets neither the graphs nor the recompile limit that earlier tests' layers (the same code) left."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def model_on_gpu(attention: str):
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(VOCAB), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                         bos_token_id=1, attn_implementation=attention)  # fmt: skip
    return Qwen2ForCausalLM(config).cuda().to(torch.bfloat16)


def gpu_trainer(tmp_path, attention: str, model_attention: str = "sdpa", skip=False) -> CompiledGRPOTrainer:
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=B, num_generations=B,
                      max_completion_length=C, bf16=True, report_to=[], save_strategy="no",
                      loss_type="dapo")  # fmt: skip
    data = Dataset.from_dict({"prompt": ["a b c"] * B})
    trainer = CompiledGRPOTrainer(model=model_on_gpu(model_attention), reward_funcs=digit_reward, args=args,
                                  train_dataset=data, processing_class=tokenizer(), packed_attention=attention,
                                  skip_zero_advantage=skip, padding_free="pack")  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    return trainer


CHECKPOINTING = {"off": None, "non-reentrant": {"use_reentrant": False}, "reentrant": {"use_reentrant": True}}
PAIRS = [("sdpa", "sdpa"), ("flex_attention", "sdpa"), ("sdpa", "eager"), ("flex_attention", "eager"),
         ("varlen", "sdpa")]  # fmt: skip


@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING))
@pytest.mark.parametrize("attention, model_attention", PAIRS, ids=[f"{a}-on-{m}" for a, m in PAIRS])
def test_packed_step_equals_trl_on_the_gpu(tmp_path, attention, model_attention, checkpointing):
    packed_step_equals_trl(tmp_path, attention, model_attention, checkpointing)


@pytest.mark.usefixtures("fresh_compiler")
@pytest.mark.parametrize("attention", ["varlen", "sdpa"])
def test_packed_step_on_compiled_layers_equals_trl_on_the_gpu(tmp_path, attention):
    """The packed step on decoder layers compiled by region (checkpointed as train() does) equals GRPOTrainer's on
    eager layers; the compiled layers ran (their count of calls) in one graph each kind, no graph break."""
    import torch._dynamo.utils as dynamo_utils

    breaks = sum(dynamo_utils.counters["graph_break"].values())
    packed_step_equals_trl(tmp_path, attention, "sdpa", "non-reentrant", compiled=True)
    assert sum(dynamo_utils.counters["graph_break"].values()) == breaks


def packed_step_equals_trl(tmp_path, attention, model_attention, checkpointing, compiled=False):
    trainer = gpu_trainer(tmp_path, attention, model_attention)
    if CHECKPOINTING[checkpointing] is not None:  # as train() turns it on
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINTING[checkpointing])
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in varied_batch().items()}
    with trainer.accelerator.autocast():
        theirs = loss_and_grads(lambda m, i: GRPOTrainer._compute_loss(trainer, m, i), trainer, inputs)
        with layers_compiled(trainer) if compiled else contextlib.nullcontext():  # asserts the compiled calls ran
            ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert trainer.packing_refused == ""
    assert trainer.packed_attention == (None if attention == model_attention else attention)
    torch.testing.assert_close(ours[0].float(), theirs[0].float(), rtol=2e-2, atol=1e-3)
    norm = lambda grads: torch.stack([g.float().norm() for g in grads.values()]).norm()  # noqa: E731
    assert float(norm(ours[1])) == pytest.approx(float(norm(theirs[1])), rel=3e-2)
    assert_each_gradient_close(ours, theirs)  # each parameter's gradient, not only their norm
    assert ours[2]["entropy"] == pytest.approx(theirs[2]["entropy"], rel=2e-2)


def assert_each_gradient_close(ours, theirs) -> None:
    """Each parameter's gradient of `ours` within 5% (relative norm of the difference) of `theirs`'s: bf16 rounding."""
    for name, g in theirs[1].items():
        err = float((ours[1][name].float() - g.float()).norm() / g.float().norm().clamp(min=1e-12))
        assert err <= 5e-2, f"{name}: relative error {err:.2e}"


def assert_loss_and_gradients_close(ours, theirs) -> None:
    torch.testing.assert_close(ours[0].float(), theirs[0].float(), rtol=2e-2, atol=1e-3)
    assert_each_gradient_close(ours, theirs)


def fixed_shapes_against_trl(tmp_path, reentrant: bool | None):
    """(a varlen trainer checkpointed as `reentrant` says (None: not checkpointed), its packed rows on fixed shapes; a
    micro-batch on the GPU; GRPOTrainer's padded step on it on eager layers: loss, gradients, metrics)."""
    trainer = gpu_trainer(tmp_path, "varlen")
    if reentrant is not None:
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in varied_batch().items()}
    with trainer.accelerator.autocast():
        theirs = loss_and_grads(lambda m, i: GRPOTrainer._compute_loss(trainer, m, i), trainer, inputs)
    trainer.packed_shapes = packing.Shapes(trainer.packed_bucket, fixed=True)
    return trainer, inputs, theirs


@pytest.mark.usefixtures("fresh_compiler")
def test_packed_step_on_graphed_layers_equals_trl_on_the_gpu(tmp_path):
    """Layers replayed as CUDA graphs (`compile_backbone="graphs"`, compiled as the trainer compiles them, so that its
    first-use checks run on the eager layers) on fixed shapes, not checkpointed (refused there), varlen: three steps
    (record, replay, replay) each equal GRPOTrainer's padded step on eager layers to bf16 rounding."""
    from torch._dynamo.utils import counters

    trainer, inputs, theirs = fixed_shapes_against_trl(tmp_path, reentrant=None)
    trainer.compile_backbone, trainer.backbone_layers = "graphs", None
    regional_compile.compile_trainer_backbone(trainer)
    assert regional_compile.compiled(trainer.backbone_layers)
    skips = counters["inductor"]["cudagraph_skips"]
    for _ in range(3):
        with trainer.accelerator.autocast():
            ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
        assert_loss_and_gradients_close(ours, theirs)
    assert counters["inductor"]["cudagraph_skips"] == skips  # the layers ran as graphs


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention", "varlen"])
def test_packed_rows_equal_rows_alone_on_the_gpu(attention):
    model = model_on_gpu("sdpa").eval()
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in varied_batch().items()}
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    lengths = plan.read(None, [inputs], with_zeros=False)[0].lengths
    if attention != "sdpa":
        packed_attention.install(model)
    forward = padding_free.packed_ids_forward(model, model.get_output_embeddings(), None if attention == "sdpa" else
                                              attention)  # fmt: skip
    with torch.no_grad():
        packed = packing.pack(ids, lengths, torch.arange(B), 128)
        both, _ = forward(packed)
        for row in range(B):
            alone, _ = forward(packing.pack(ids, lengths, torch.tensor([row]), 1))
            start, span = int(packed.starts[row]), PROMPTS[row] + COMPLETIONS[row]
            torch.testing.assert_close(both[start : start + span].float(), alone.float(), rtol=3e-2, atol=3e-2)


QWEN_SHAPES = {  # Qwen2.5's shapes, random bf16 weights, its vocabulary's size
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, tie_word_embeddings=False),
}  # fmt: skip
QWEN_VOCAB = 151936


def word_tokenizer(size: int):
    """A word-level tokenizer of `size` ids ("<pad>", "<eos>", "<unk>", then "w3", "w4"...): any sampled id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.mark.usefixtures("fresh_compiler")
@pytest.mark.parametrize("shape, backbone", [("0.5B", "auto"), ("7B", "auto"), ("0.5B", "graphs"), ("0.5B", "stack")])
def test_train_with_every_default_at_qwen_shapes(tmp_path, shape, backbone):
    """`trainer.train()`: 3 optimizer steps, every CompiledGRPOTrainer default (GRPOConfig's gradient checkpointing;
    compile_backbone, padding_free and packed_attention "auto": compiled layers, packed on varlen FlashAttention),
    prompts of 4 and 60 tokens in each micro-batch (left padding that packing removes); and with
    `compile_backbone="graphs"` (the layers replayed as CUDA graphs: Inductor skipped none; not checkpointed) and
    "stack" (a packed forward's layers as a few compiled calls: it ran)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    config = Qwen2Config(**QWEN_SHAPES[shape], vocab_size=QWEN_VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    words = lambda n, at: " ".join(f"w{at + i}" for i in range(n))  # noqa: E731
    data = Dataset.from_dict({"prompt": [words(4, 10), words(60, 100)] * 8})
    args = GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=32, gradient_accumulation_steps=2, max_steps=3, bf16=True,
                      logging_steps=1, report_to=[], save_strategy="no",
                      gradient_checkpointing=backbone != "graphs")  # fmt: skip
    trainer = CompiledGRPOTrainer(model=model, reward_funcs=lambda completions, **k: [float(len(c)) for c in
                                  completions], args=args, train_dataset=data, processing_class=word_tokenizer(
                                  QWEN_VOCAB), compile_backbone=backbone)  # fmt: skip
    skips, stacks = counters["inductor"]["cudagraph_skips"], compiled_stack.through_layers.__code__
    trainer.train()
    assert backbone != "graphs" or counters["inductor"]["cudagraph_skips"] == skips
    stacked = trainer.backbone_stacks and torch._dynamo.eval_frame._debug_get_cache_entry_list(stacks)
    assert backbone != "stack" or stacked
    # every kind of call (with grad, without, sharing prompts or not) captured whole: none ran layer by layer
    layer_by_layer = [stack.one_by_one for stack in trainer.backbone_stacks.values() if stack.one_by_one]
    assert not layer_by_layer, layer_by_layer
    assert trainer.compile_backbone == {"auto": "stack"}.get(backbone, backbone)  # "auto" on a GPU: the stack
    assert trainer.packed_shapes.fixed
    assert trainer.model.is_gradient_checkpointing == (backbone != "graphs")  # "graphs" refuses checkpointing
    assert trainer.compile_backbone and regional_compile.compiled(trainer.backbone_layers)
    assert trainer.packed_attention == "varlen"
    logged = [e for e in trainer.state.log_history if "loss" in e and "padding_free/packed_fraction" in e]
    assert len(logged) == 3 and all(torch.isfinite(torch.tensor(e["loss"])) for e in logged)
    assert all(e["grad_norm"] > 0 for e in logged)
    packed = sum(e["padding_free/packed_fraction"] for e in logged) / 3
    # "auto" packs on varlen over compiled layers at every size, where a micro-batch has padding to remove (regrouped
    # by prompt, a micro-batch of one group's full-length completions may have too little)
    assert packed >= 0.5, packed
    assert sum(e.get("shared_prompts/saved_tokens", 0.0) for e in logged) > 0  # a group's completions share its prompt


@contextlib.contextmanager
def counted_waits():
    """The host's waits for the GPU inside the block (`torch.cuda.set_sync_debug_mode`), appended to the list it
    gives when the block ends: each as the line of the project's, TRL's or transformers' code that waited (the
    innermost such frame), so that a failure names the places."""
    waits = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing" not in str(message):  # not the mode's own "prototype feature" notice
            return
        ours = [f for f in traceback.extract_stack()[:-1] if any(k in f.filename for k in WAIT_SOURCES)]
        waits.append(f"{ours[-1].filename}:{ours[-1].lineno} {ours[-1].line}" if ours else str(message))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield waits
        finally:
            torch.cuda.set_sync_debug_mode("default")


WAIT_SOURCES = ("compiled_grpo", "/trl/", "/transformers/", "/accelerate/", "tests/")


@pytest.mark.parametrize("skip", [False, "backward"])
def test_a_packed_step_waits_once_for_its_plan_and_once_for_its_metrics(tmp_path, skip):
    """A generation batch of 3 micro-batches, packed on varlen, checkpointed (with `skip`: two rows of each at
    advantage 0, forwarded without grad): its plan reads back once (every micro-batch's rows at advantage 0 and real
    lengths); each micro-batch then waits once, for its loss's tile plan (the count of its tokens, the value checks'
    flags read with it), and with rows at advantage 0 once more, for the sparse gradient pass's count of tokens with
    a gradient; nothing else (the packing, its boundaries, the loss's packed layout and the row plan come from the
    plan on the host); the metrics read back once, when logged. Counted after a first pass (compiling and capturing
    wait)."""
    trainer = gpu_trainer(tmp_path, "varlen", skip=skip)
    trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with_zeros, zeros = trainer.skip_reason is None, (1, 2) if skip else ()
    assert with_zeros == bool(skip)

    def generation_batch():
        return [{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in varied_batch(seed, zeros).items()}
                for seed in range(3)]  # fmt: skip

    def step(batches):
        for inputs in batches:
            with trainer.accelerator.autocast():
                trainer._compute_loss(trainer.model, inputs).backward()

    warm = generation_batch()
    plan.annotate(trainer, warm, with_zeros)
    step(warm)
    settle(trainer._metrics["train"])
    batches = generation_batch()
    with counted_waits() as planning:
        plan.annotate(trainer, batches, with_zeros)
    with counted_waits() as stepping:
        step(batches)
    with counted_waits() as logging:
        settle(trainer._metrics["train"])
    assert trainer._metrics["train"]["padding_free/packed_fraction"][-1] == 1.0
    counted = {"planning": planning, "stepping": stepping, "logging": logging}
    where = "\n".join(f"{k}: {n} x {place}" for k, v in counted.items() for place, n in collections.Counter(v).items())
    waits_in = collections.Counter(place.split(":")[0].rsplit("/", 1)[-1] for place in stepping)
    expected = {"tiling.py": 3, **({"sparse_gradients.py": 3} if skip else {})}
    assert (len(planning), dict(waits_in), len(logging)) == (1, expected, 1), where
