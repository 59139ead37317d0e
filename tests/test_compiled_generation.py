"""`compile_generation`: TRL's `generate` path on transformers' compiled decode step (Inductor's C++ kernels on the
CPU here, float32). Greedy and seeded sampling give TRL's eager tokens; sampled first tokens follow the model's
own distribution; a run compiles once per prompt bucket and says so; a decode step that cannot compile falls back
to TRL's eager generation with the reason; `train()` with checkpointing equals GRPOTrainer's steps; the modes, and
the paths it leaves as TRL runs them (vLLM, continuous batching, a chosen cache, sharding engines, multimodal)."""

from __future__ import annotations

import types

import pytest
import torch
from datasets import Dataset
from scipy import stats
from test_integration_trl import VOCAB, tokenizer
from test_train_checkpointed import assert_steps_equal, grpo_trainer_run, tmp_root, train  # noqa: F401
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig, GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, rollouts

GENERATIONS = 4


def varied_model(seed=0, **config):
    """A tiny float32 Qwen2 whose random weights are large enough that its greedy tokens vary along a sequence."""
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        initializer_range=0.3, **config,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def generator(tmp_path, cls, greedy=True, model=None, **options):
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=GENERATIONS, max_completion_length=8,
        report_to=[], use_cpu=True, bf16=False, save_strategy="no",
        generation_kwargs={"do_sample": False} if greedy else None,
    )  # fmt: skip
    extra = {"compiled": False, **options} if cls is CompiledGRPOTrainer else {}
    data = Dataset.from_dict({"prompt": ["a b"] * 8})
    return cls(model=model or varied_model(), reward_funcs=lambda completions, **k: [0.0] * len(completions),
               args=args, train_dataset=data, processing_class=tokenizer(), **extra)  # fmt: skip


def prompts(longest: int, seed: int, count=8) -> list[list[int]]:
    """`count` random prompts of 1 to `longest` tokens, the first of `longest`."""
    g = torch.Generator().manual_seed(seed)
    lengths = [longest, *torch.randint(1, longest + 1, (count - 1,), generator=g).tolist()]
    return [torch.randint(3, len(VOCAB), (int(n),), generator=g).tolist() for n in lengths]


def completions(trainer, prompt_ids, seed=None):
    if seed is not None:
        torch.manual_seed(seed)
    ids, _ = trainer._generate_single_turn(prompt_ids, None, {}, GENERATIONS)
    return ids


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return generator(tmp_path_factory.mktemp("eager"), GRPOTrainer)


@pytest.mark.compiled
def test_greedy_tokens_equal_eager_generation_and_compile_once_per_bucket(tmp_path, eager):
    ours = generator(tmp_path, CompiledGRPOTrainer, compile_generation=True)
    with pytest.warns(rollouts.GenerationNotice, match=r"first generation compiled the decode step \(8 sequences, a "
                      r"cache of 264 tokens\) and took \d+\.\d s"):  # fmt: skip
        first = completions(ours, prompts(20, seed=0))
    assert first == completions(eager, prompts(20, seed=0))
    assert len({tuple(ids) for ids in first}) > 1 and any(len(set(ids)) > 1 for ids in first)  # not one token repeated
    assert decoded_compiled(ours) and not decoded_compiled(eager)
    for seed, longest in enumerate((3, 40, 200, 256), start=1):  # prompt lengths inside the first bucket
        assert completions(ours, prompts(longest, seed)) == completions(eager, prompts(longest, seed))
    state = ours.generation_compiles
    assert [length for length, _, _ in state.compiles] == [264] and state.calls == 5 and state.fallback is None
    with pytest.warns(rollouts.GenerationNotice, match="grew the cache to 520 tokens"):
        assert completions(ours, prompts(300, seed=9)) == completions(eager, prompts(300, seed=9))
    assert completions(ours, prompts(30, seed=10)) == completions(eager, prompts(30, seed=10))  # the bigger cache
    assert [length for length, _, _ in state.compiles] == [264, 520] and state.calls == 7


@pytest.mark.compiled
def test_sampled_tokens_follow_eager_generation(tmp_path):
    """Seeded sampling draws TRL's eager tokens; over 1,200 draws the first sampled token's frequencies agree with the
    model's own probabilities (chi-square, p > 1e-3)."""
    ours = generator(tmp_path / "ours", CompiledGRPOTrainer, greedy=False, compile_generation=True)
    theirs = generator(tmp_path / "theirs", GRPOTrainer, greedy=False)
    prompt_ids = [[5, 9, 12]] * 8
    for seed in range(3):
        assert completions(ours, prompt_ids, seed) == completions(theirs, prompt_ids, seed)
    firsts = torch.tensor([ids[0] for seed in range(150) for ids in completions(ours, prompt_ids, seed + 100)])
    with torch.no_grad():
        probs = ours.model(torch.tensor([prompt_ids[0]])).logits[0, -1].softmax(-1).double()
    seen = torch.bincount(firsts, minlength=len(VOCAB)).double()
    likely = probs * len(firsts) >= 5  # chi-square's cells: the tokens expected at least 5 times, the rest pooled
    observed = torch.cat([seen[likely], seen[~likely].sum().reshape(1)])
    expected = torch.cat([probs[likely], probs[~likely].sum().reshape(1)])
    expected = expected / expected.sum() * len(firsts)
    assert stats.chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
    assert decoded_compiled(ours) and not decoded_compiled(theirs)


def decoded_compiled(trainer) -> bool:
    """Whether transformers took its compiled decode step for this model (it makes the call there only)."""
    return hasattr(trainer.model, "_compiled_call")


@pytest.mark.compiled
def test_a_decode_step_that_cannot_compile_falls_back_to_eager_generation(tmp_path, eager):
    ours = generator(tmp_path, CompiledGRPOTrainer, compile_generation=True)

    def failing_backend(graph, example_inputs):
        raise RuntimeError("this decode step cannot compile")

    ours.generation_config.compile_config.backend = failing_backend
    with pytest.warns(rollouts.GenerationNotice, match="compiling the decode step failed .*cannot compile.*eagerly"):
        assert completions(ours, prompts(20, seed=0)) == completions(eager, prompts(20, seed=0))
    assert not ours.compile_generation and "cannot compile" in ours.generation_compiles.fallback
    assert ours.generation_config.disable_compile and ours.generation_config.cache_implementation is None
    assert completions(ours, prompts(30, seed=1)) == completions(eager, prompts(30, seed=1))  # eager from here


@pytest.mark.compiled
def test_train_on_compiled_generation_equals_grpo_trainer(tmp_path, tmp_root):  # noqa: F811
    """`train()` with gradient checkpointing: the compiled decode step samples TRL's tokens, so every optimizer
    step's loss and gradients are GRPOTrainer's."""
    losses, grads, trainer = train(tmp_path, CompiledGRPOTrainer, "eager", False, compile_generation=True)
    assert trainer.compile_generation and len(trainer.generation_compiles.compiles) == 1
    assert trainer.generation_compiles.calls >= 3  # one generation a step, every one on the first compile
    assert_steps_equal((losses, grads), grpo_trainer_run("eager", False, tmp_root))


@pytest.mark.compiled
def test_train_a_lora_adapter_on_compiled_generation_equals_grpo_trainer(tmp_path, tmp_root):  # noqa: F811
    """A PEFT model (LoRA on q and v, unmerged): its decode step compiles with the adapters in it and samples TRL's
    tokens, so every step's loss and adapter gradients are GRPOTrainer's."""
    pytest.importorskip("peft", reason="peft is in the test extras")
    losses, grads, trainer = train(tmp_path, CompiledGRPOTrainer, "eager", False, True, compile_generation=True)
    assert trainer.compile_generation and len(trainer.generation_compiles.compiles) == 1
    assert trainer.generation_compiles.fallback is None and any("lora_" in name for name in grads[0])
    assert_steps_equal((losses, grads), grpo_trainer_run("eager", False, tmp_root, True))


@pytest.mark.compiled
def test_a_sliding_window_models_greedy_tokens_equal_eager_generation(tmp_path):
    """Qwen2 with sliding-window attention in every layer (a window shorter than the prompts): transformers' static
    cache keeps the window's layers, and the compiled decode step gives TRL's tokens."""

    def windowed(cls, folder, **options):
        model = varied_model(use_sliding_window=True, sliding_window=8, max_window_layers=0)
        assert all(layer.self_attn.sliding_window == 8 for layer in model.model.layers)
        return generator(tmp_path / folder, cls, model=model, **options)

    ours = windowed(CompiledGRPOTrainer, "ours", compile_generation=True)
    theirs = windowed(GRPOTrainer, "theirs")
    for seed, longest in enumerate((20, 60)):
        assert completions(ours, prompts(longest, seed)) == completions(theirs, prompts(longest, seed))
    assert decoded_compiled(ours) and ours.generation_compiles.fallback is None


def test_the_default_leaves_cpu_generation_as_trl_runs_it(tmp_path):
    trainer = generator(tmp_path, CompiledGRPOTrainer)
    assert not trainer.compile_generation and "GPU only" in trainer.generation_compiles.fallback
    assert trainer.generation_config.disable_compile and trainer.generation_config.cache_implementation is None


def test_compile_generation_takes_auto_a_bool_or_loop(tmp_path):
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="compile_generation: expected 'auto', True, False or 'loop'"):
            generator(tmp_path, CompiledGRPOTrainer, compile_generation=bad)


def stand_in(**settings):
    """What `reason_not_to_compile` reads of a trainer: TRL's transformers path on a GPU, text-only, unless told."""
    values = dict(use_vllm=False, continuous=False, cache=None, device="cuda", shards=False, vlm=False) | settings
    return types.SimpleNamespace(
        use_vllm=values["use_vllm"], use_transformers_continuous_batching=values["continuous"],
        args=types.SimpleNamespace(cache_implementation=values["cache"]), _is_vlm=values["vlm"],
        accelerator=types.SimpleNamespace(device=torch.device(values["device"])), shards_parameters=values["shards"],
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["auto", True, False, "loop"])
def test_vllm_and_continuous_batching_are_left_as_trl_runs_them(mode):
    for settings in ({"use_vllm": True}, {"continuous": True}):
        trainer = stand_in(**settings)
        trainer.generation_config = object()  # anything configure touched would raise
        rollouts.configure(trainer, mode)
        assert not trainer.compile_generation and "left as TRL runs it" in trainer.generation_compiles.fallback
        assert rollouts.generate(trainer, lambda: "TRL's generation", [[1, 2]]) == "TRL's generation"


def test_auto_compiles_on_a_gpu_on_the_transformers_path_only():
    reason = rollouts.reason_not_to_compile
    assert reason(stand_in(), "auto") is None and reason(stand_in(cache="static"), "auto") is None
    assert "GPU only" in reason(stand_in(device="cpu"), "auto") and reason(stand_in(device="cpu"), True) is None
    assert "gathers the parameters" in reason(stand_in(shards=True), "auto")
    assert reason(stand_in(shards=True), True) is None  # asked for: tried, and falls back if it cannot compile
    assert "multimodal" in reason(stand_in(vlm=True), "auto")
    assert "needs the static cache" in reason(stand_in(cache="dynamic"), True)
    assert reason(stand_in(), False) == "compile_generation=False"
    assert reason(stand_in(device="cpu", shards=True), "loop") is None  # asked for by name, as True
    assert "left as TRL runs it" in reason(stand_in(use_vllm=True), "loop")


def test_the_cache_is_pinned_to_the_longest_prompts_bucket():
    assert [rollouts.prompt_bucket(n) for n in (1, 200, 256, 257, 600, 1024, 1025)] == [
        256, 256, 256, 512, 1024, 1024, 2048]  # fmt: skip
    trainer = types.SimpleNamespace(cache_floor=0, generation_config=types.SimpleNamespace(max_new_tokens=100))
    assert rollouts.cache_length(trainer, [[1] * 20, [1] * 300]) == 612
    trainer.cache_floor = 1000  # a user's max_cache_len
    assert rollouts.cache_length(trainer, [[1] * 20]) == 1000


def decode(model, ids, deferred: bool, **settings):
    """transformers' generation on a static cache from one seed, the stop decided one step late where `deferred`."""
    torch.manual_seed(7)
    with rollouts.deferred_stop_check(deferred):
        return model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation="static", pad_token_id=0,
                              **settings)  # fmt: skip


class HostEvent:
    """`torch.Event` where the CPU has none: its work is done when issued, so nothing is waited for."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass


@pytest.mark.parametrize("sample", [False, True])
def test_the_deferred_stop_check_returns_the_same_tokens(monkeypatch, sample):
    """`rollouts.deferred_stop_check` (on the CPU as on a GPU, a stand-in event): transformers stops one decode step
    late on a static cache and undoes that step, so greedy and seeded sampled tokens equal its usual decoding, where
    every sequence ends early (one more step run and undone) and where the length limit ends them; outside the block,
    and with the switch off, transformers decides as before (not on a CPU)."""
    from transformers.generation import utils as generation

    monkeypatch.setattr(rollouts, "DEFERRED_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(torch, "Event", HostEvent)
    undone, finish = [], generation.DeferredStopCheck.finish
    monkeypatch.setattr(generation.DeferredStopCheck, "finish", lambda self: undone.append(finish(self)) or undone[-1])
    model = varied_model(seed=3)
    ids = (torch.tensor(prompts(12, seed=4)[0]).repeat(6, 1) + torch.arange(6)[:, None]) % (len(VOCAB) - 3) + 3
    for ends, limit in (([1, *range(3, len(VOCAB), 4)], 40), ([1], 6)):  # a quarter of the tokens end: all end early
        settings = dict(max_new_tokens=limit, do_sample=sample, eos_token_id=ends)
        before = len(undone)
        usual = decode(model, ids, deferred=False, **settings)
        assert len(undone) == before  # transformers itself defers on Apple's GPUs only
        deferred = decode(model, ids, deferred=True, **settings)
        assert torch.equal(deferred, usual), (deferred, usual)
        assert undone[-1] == (1 if usual.shape[1] < ids.shape[1] + limit else 0), (undone, usual.shape)
    assert undone == [1, 0]  # the first case ended early, the second at its limit
    assert generation.DeferredStopCheck.is_supported(torch.device("cpu"), None, False, is_assistant=False) is False
