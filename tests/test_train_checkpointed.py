"""`trainer.train()` as users run it: TRL's default gradient checkpointing on (reentrant and not), every padding-free
mode and every packed attention that runs on a CPU, on models created with "eager" and with "sdpa" attention. Each
optimizer step's loss and gradients equal GRPOTrainer's under the same checkpointing; packing is asserted to have
happened (the trainer's own `padding_free/packed_fraction` metric), so a silent fallback cannot pass. The sabotage:
today's packed forward under a model-wide switch of the attention, undone before the backward, turns them red."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from datasets import Dataset
from test_integration_trl import tokenizer
from test_skip_zero_advantage import tiny_qwen2
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, packed_attention, padding_free

STEPS = 3
# prompts of 1 and 8 tokens in every micro-batch (2 prompts x 4 generations): left padding that packing removes
PROMPTS = ["a", "b c d e f g h i", "1", "2 3 4 5 6 7 8 9"]


def prompt_reward(prompts, completions, **kwargs):
    """0 for every completion of a prompt of one token (groups at advantage 0), else the count of its digits."""
    pairs = zip(prompts, completions, strict=True)
    return [0.0 if len(p.split()) == 1 else float(sum(ch.isdigit() for ch in c)) for p, c in pairs]


class GradientsPerStep(TrainerCallback):
    """Each optimizer step's accumulated gradients, taken just before the optimizer applies them."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})


def lora():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def train(tmp_path, cls, attention: str, reentrant: bool, adapter: bool = False, checkpointing=True, **options):
    """(each step's logged loss, each step's gradients, the trainer) of `STEPS` optimizer steps of `train()` on a tiny
    float32 Qwen2 created with `attention`, checkpointing as GRPOConfig turns it on (`checkpointing`: or off)."""
    model = tiny_qwen2(tie=False)
    model.set_attn_implementation(attention)
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=6,
        gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1e-2, optim="sgd", logging_steps=1, seed=0,
        report_to=[], use_cpu=True, save_strategy="no", bf16=False, gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": reentrant},
    )  # fmt: skip
    data = Dataset.from_dict({"prompt": PROMPTS * 8})
    extra = {"compiled": False, **options} if cls is CompiledGRPOTrainer else {}
    if adapter:  # a LoRA adapter: TRL wraps the model (PEFT) and checkpoints it as it does
        extra["peft_config"] = lora()
    trainer = cls(model=model, reward_funcs=prompt_reward, args=args, train_dataset=data,
                  processing_class=tokenizer(), **extra)  # fmt: skip
    grads = GradientsPerStep()
    trainer.add_callback(grads)
    trainer.train()
    assert trainer.model.is_gradient_checkpointing == checkpointing
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, grads.steps, trainer


@functools.cache
def grpo_trainer_run(attention: str, reentrant: bool, tmp_root: str, adapter: bool = False):
    folder = f"{tmp_root}/trl-{attention}-{reentrant}-{adapter}"
    losses, grads, _ = train(folder, GRPOTrainer, attention, reentrant, adapter)
    return losses, grads


def assert_steps_equal(ours, theirs, rel=1e-5):
    losses, grads = ours
    assert len(losses) == len(theirs[0]) == STEPS and len(grads) == len(theirs[1]) == STEPS
    assert losses == pytest.approx(theirs[0], rel=rel, abs=1e-7)
    for step, (mine, their) in enumerate(zip(grads, theirs[1], strict=True)):
        assert mine.keys() == their.keys()
        for name, g in their.items():
            err, scale = float((mine[name] - g).abs().max()), float(g.abs().max())
            assert err <= rel * max(scale, 1e-6), f"step {step}, {name}: {err:.2e} (scale {scale:.2e})"


def saved_tokens(trainer) -> float:
    """The prompt tokens the run's packed forwards did not forward again (shared prompts), summed over its logs."""
    return sum(e.get("shared_prompts/saved_tokens", 0.0) for e in trainer.state.log_history)


def packed_share(trainer) -> float:
    """The share of micro-batches packed (0 where the trainer logs none: padding_free=False)."""
    shares = [e["padding_free/packed_fraction"] for e in trainer.state.log_history if "padding_free/packed_fraction"
              in e]  # fmt: skip
    return sum(shares) / max(len(shares), 1)


@pytest.fixture
def dispatched(monkeypatch):
    """The attention implementations the dispatching attention ran, call by call."""
    names, lookup = [], packed_attention.attention_function

    def recording(name, module):
        names.append(name)
        return lookup(name, module)

    monkeypatch.setattr(packed_attention, "attention_function", recording)
    return names


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("train"))


MODES = [("pack", "auto"), ("pack", "sdpa"), ("pack", "eager"), ("trim", "auto"), (False, "auto"), ("auto", "auto")]


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("model_attention", ["eager", "sdpa"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: f"{m[0]}-{m[1]}")
def test_train_with_checkpointing_equals_grpo_trainer(tmp_path, tmp_root, dispatched, mode, model_attention,
                                                      reentrant):  # fmt: skip
    padding, attention = mode
    losses, grads, trainer = train(tmp_path, CompiledGRPOTrainer, model_attention, reentrant, padding_free=padding,
                                   packed_attention=attention, skip_zero_advantage=False)  # fmt: skip
    assert_steps_equal((losses, grads), grpo_trainer_run(model_attention, reentrant, tmp_root))
    share = packed_share(trainer)  # regrouped by prompt, a micro-batch of whole groups may have too little padding
    assert (share > 0.5) if padding == "pack" else share == 0.0, f"packed share {share}"
    assert (saved_tokens(trainer) > 0) == (padding == "pack"), "a group's completions packed together share its prompt"
    other = padding == "pack" and attention not in ("auto", model_attention)
    assert packed_attention.installed(trainer.model) == other
    # where it is installed, the packed forwards (and their recomputations) ran the packed attention, generation and
    # the other forwards the model's own
    assert set(dispatched) == ({attention, model_attention} if other else set())


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("skip", ["backward", "all"])
def test_train_packed_and_skipping_equals_grpo_trainer(tmp_path, tmp_root, skip, reentrant):
    """Groups at advantage 0 skip their backward ("backward": forwarded without grad, packed apart) or everything
    ("all"), the packed forwards on another attention than the model's."""
    losses, grads, trainer = train(tmp_path, CompiledGRPOTrainer, "eager", reentrant, padding_free="pack",
                                   packed_attention="sdpa", skip_zero_advantage=skip)  # fmt: skip
    assert_steps_equal((losses, grads), grpo_trainer_run("eager", reentrant, tmp_root))
    skipped = [e["zero_advantage/skipped_backward"] for e in trainer.state.log_history if "zero_advantage/skipped_"
               "backward" in e]  # fmt: skip
    assert skipped and max(skipped) > 0 and packed_share(trainer) > 0 and saved_tokens(trainer) > 0


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_train_a_lora_adapter_packed_equals_grpo_trainer(tmp_path, tmp_root, reentrant):
    """A PEFT model (LoRA on q and v): the dispatching attention is installed on the model under the adapter, and
    the adapter's gradients are GRPOTrainer's at every step."""
    pytest.importorskip("peft", reason="peft is in the test extras")
    losses, grads, trainer = train(tmp_path, CompiledGRPOTrainer, "eager", reentrant, True, padding_free="pack",
                                   packed_attention="sdpa", skip_zero_advantage=False)  # fmt: skip
    assert_steps_equal((losses, grads), grpo_trainer_run("eager", reentrant, tmp_root, True))
    assert packed_attention.installed(padding_free.transformers_model(trainer.model))
    assert packed_share(trainer) > 0.5 and any("lora_" in name for name in grads[0]) and saved_tokens(trainer) > 0


def switched_forward(model, lm_head, attention, stack=None):
    """The sabotage: the packed forward under a model-wide switch of the attention, undone when the forward
    returns (before the backward recomputes the checkpointed layers)."""
    plain = ORIGINAL_PACKED_IDS_FORWARD(model, lm_head, None)

    @contextlib.contextmanager
    def switched():
        base = padding_free.transformers_model(model)
        own = base.config._attn_implementation
        base.set_attn_implementation(attention)
        try:
            yield
        finally:
            base.set_attn_implementation(own)

    def forward(packed):
        with switched():
            return plain(packed)

    return forward


ORIGINAL_PACKED_IDS_FORWARD = padding_free.packed_ids_forward


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_a_switch_undone_before_the_backward_turns_the_matrix_red(tmp_path, tmp_root, monkeypatch, reentrant):
    monkeypatch.setattr(padding_free, "packed_ids_forward", switched_forward)
    monkeypatch.setattr(packed_attention, "install", lambda model: None)  # the model stays on its own attention
    with pytest.raises((AssertionError, torch.utils.checkpoint.CheckpointError)):
        losses, grads, _ = train(tmp_path, CompiledGRPOTrainer, "eager", reentrant, padding_free="pack",
                                 packed_attention="sdpa", skip_zero_advantage=False)  # fmt: skip
        assert_steps_equal((losses, grads), grpo_trainer_run("eager", reentrant, tmp_root))


def test_flex_attention_on_a_cpu_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="FlexAttention's backward runs on a GPU only"):
        train(tmp_path, CompiledGRPOTrainer, "sdpa", False, padding_free="pack", packed_attention="flex_attention")


def varlen_on_the_cpu(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    """A stand-in of `torch.nn.attention.varlen.varlen_attn` (CUDA only) for the plumbing around it: each sequence
    of `cu_q` attends to its keys of `cu_k` by SDPA, causal from the end as FlashAttention aligns it where a
    sequence has more keys than queries (its last query sees every key), empty sequences skipped, the longest lengths
    bounds (FlashAttention sizes its grid by them), [tokens, heads, head_dim] in and out."""
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and max_k >= int((cu_k[1:] - cu_k[:-1]).max())  # bounds
    assert window_size == (-1, 0) and cu_q.dtype == cu_k.dtype == torch.int32
    assert int(cu_q[-1]) == q.shape[0] and int(cu_k[-1]) == k.shape[0] and len(cu_q) == len(cu_k)
    out = torch.empty_like(q)
    q_bounds, k_bounds = cu_q.tolist(), cu_k.tolist()
    for i, (start, end) in enumerate(zip(q_bounds[:-1], q_bounds[1:], strict=True)):
        k_start, k_end = k_bounds[i], k_bounds[i + 1]
        if end == start:  # an empty segment (fixed shapes pad the boundaries with them): nothing to attend
            continue
        query, key, value = (t.transpose(0, 1) for t in (q[start:end], k[k_start:k_end], v[k_start:k_end]))
        seen = torch.ones(end - start, k_end - k_start, dtype=torch.bool).tril(k_end - k_start - (end - start))
        attended = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=seen, scale=scale,
                                                                     enable_gqa=enable_gqa)  # fmt: skip
        out[start:end] = attended.transpose(0, 1)
    return out


@pytest.fixture
def varlen_stand_in(monkeypatch):
    monkeypatch.setattr(packed_attention, "varlen_attn", varlen_on_the_cpu)
    monkeypatch.setattr(packed_attention, "varlen_unavailable", lambda device, sixteen_bit: None)


@pytest.fixture
def packing_read_back(monkeypatch):
    """Calls of transformers' search for packed sequences in the position ids (a read-back from the device per
    packed forward that builds a mask)."""
    import transformers.masking_utils as masking

    calls, find = [], masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda *a, **k: calls.append(1) or find(*a, **k))
    return calls


@pytest.mark.parametrize("attention, read_backs", [("varlen", False), ("sdpa", True)])
def test_varlen_packed_forwards_build_no_mask_and_read_nothing_back(tmp_path, varlen_stand_in, packing_read_back,
                                                                    attention, read_backs):  # fmt: skip
    """Packed forwards under "varlen" give the model no mask to build (so transformers does not read the packing back
    from the device); under SDPA it builds the packed mask from the position ids (the contrast; prompts not shared,
    whose masks are passed)."""
    _, _, trainer = train(tmp_path, CompiledGRPOTrainer, "eager", False, padding_free="pack",
                          packed_attention=attention, skip_zero_advantage=False, share_prompts=False)  # fmt: skip
    assert packed_share(trainer) > 0.5 and bool(packing_read_back) == read_backs


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_train_on_varlen_attention_equals_grpo_trainer(tmp_path, tmp_root, dispatched, varlen_stand_in, reentrant):
    """`packed_attention="varlen"`: no mask, the sequences' boundaries from the plan among the forward's keyword
    arguments (replayed by checkpointing), the [1, heads, N, head_dim] layout turned into varlen's and back; with a
    stand-in kernel (the real one runs on a GPU only: tests/test_cuda_padding_free.py)."""
    losses, grads, trainer = train(tmp_path, CompiledGRPOTrainer, "eager", reentrant, padding_free="pack",
                                   packed_attention="varlen", skip_zero_advantage=False)  # fmt: skip
    assert_steps_equal((losses, grads), grpo_trainer_run("eager", reentrant, tmp_root))
    assert packed_share(trainer) > 0.5 and set(dispatched) == {"varlen", "eager"} and saved_tokens(trainer) > 0


def test_varlen_attention_on_a_cpu_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="varlen FlashAttention runs on CUDA GPUs"):
        train(tmp_path, CompiledGRPOTrainer, "sdpa", False, padding_free="pack", packed_attention="varlen")


def test_an_unknown_packed_attention_is_refused(tmp_path):
    with pytest.raises(ValueError, match="packed_attention: 'flash' is none of"):
        train(tmp_path, CompiledGRPOTrainer, "sdpa", False, padding_free="pack", packed_attention="flash")


def imports(function) -> list[str]:
    import dis

    return [i.argval for i in dis.get_instructions(function) if i.opname == "IMPORT_NAME"]


def test_nothing_is_imported_inside_a_layers_attention():
    """The dispatcher's per-call functions import nothing: dynamo cannot trace an import of transformers' lazy
    modules and breaks a compiled layer's graph there (seen on torch 2.11: one graph per layer became four)."""
    per_call = [packed_attention.attend, packed_attention.attention_function, packed_attention.varlen_attention,
                packed_attention.causal_options, packed_attention.mask]  # fmt: skip
    assert {f.__name__: imports(f) for f in per_call} == {f.__name__: [] for f in per_call}


def test_varlen_takes_this_torchs_keywords(monkeypatch):
    """torch 2.11's varlen_attn has no `enable_gqa` (its kernel takes fewer key and value heads as they are), and
    older ones causal by a flag without a window."""
    monkeypatch.setattr(packed_attention, "VARLEN_PARAMETERS", frozenset({"scale", "window_size", "return_aux"}))
    assert packed_attention.causal_options(None, grouped=True) == {"window_size": (-1, 0)}
    assert packed_attention.causal_options(4096, grouped=False) == {"window_size": (4095, 0)}
    monkeypatch.setattr(packed_attention, "VARLEN_PARAMETERS", frozenset({"scale", "window_size", "enable_gqa"}))
    assert packed_attention.causal_options(None, grouped=True) == {"window_size": (-1, 0), "enable_gqa": True}
    monkeypatch.setattr(packed_attention, "VARLEN_PARAMETERS", frozenset({"is_causal", "return_aux"}))
    assert packed_attention.causal_options(None, grouped=True) == {"is_causal": True}
    with pytest.raises(ValueError, match="takes no sliding window"):
        packed_attention.causal_options(4096, grouped=True)


@pytest.mark.skipif(packed_attention.varlen_attn is None, reason="this torch has no torch.nn.attention.varlen")
def test_varlen_attention_compiles_once_for_every_packed_length():
    """dynamo (dynamic shapes, as compiled layers run) makes one graph of the varlen call for packed rows of every
    length and longest sequence: `max_length_q` is a symbolic int, not a guard. The kernel is CUDA's: on a CPU the
    compiled call fails after compiling, which is all this counts."""
    import torch._dynamo.testing

    counter = torch._dynamo.testing.CompileCounter()
    attend = torch.compile(packed_attention.varlen_attention, backend=counter, dynamic=True)
    for total, longest in ((40, 12), (50, 17), (61, 23), (33, 9)):
        q, kv = torch.randn(1, 4, total, 16).bfloat16(), torch.randn(1, 2, total, 16).bfloat16()
        bounds = torch.tensor([0, total - longest, total], dtype=torch.int32)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            attend(None, q, kv, kv, None, cu_seq_lens_q=bounds, max_length_q=longest, scaling=0.25)
    assert counter.frame_count == 1
