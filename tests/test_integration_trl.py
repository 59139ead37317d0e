"""The TRL integration against TRL 1.16.0's own `_compute_loss`, on a tiny random causal LM built from a
transformers config and a tokenizer built locally (no download)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, settle, trainer_budget
from compiled_grpo.schedules import choice, memory

WORDS = [str(i) for i in range(10)] + list("abcdefghij")
VOCAB = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}


def tokenizer():
    tok = Tokenizer(models.WordLevel(VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_model(seed=0, dtype=torch.float64, tie=False, **head):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
        tie_word_embeddings=tie, **head,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(dtype)


def digit_reward(completions, **kwargs):
    """Reward completions for containing digits (a toy task the model can learn)."""
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def make_trainer(cls, tmp_path, model, max_steps=1, peft_config=None, loss_options=None, reward=None, skip=None,
                 options=None, **settings):  # fmt: skip
    """A trainer of `cls` on a tiny dataset; `settings` are GRPOConfig's, `options` CompiledGRPOTrainer's own."""
    args = GRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=6,
        max_steps=max_steps, learning_rate=5e-2, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        bf16=False,  # no autocast: TRL's head would round logits to bf16, which this library does not
        **settings,
    )  # fmt: skip
    data = Dataset.from_dict({"prompt": ["a b c", "d e f", "1 2 a", "g h i"] * 4})
    if settings.get("beta"):  # TRL loads its reference model from the policy's path: give it a local one
        model.save_pretrained(tmp_path / "policy")
        model.config._name_or_path = str(tmp_path / "policy")
    extra = {"compiled": False} if issubclass(cls, CompiledGRPOTrainer) else {}
    if peft_config is not None:
        extra["peft_config"] = peft_config
    if loss_options is not None:
        extra["loss_options"] = loss_options
    if skip is not None:  # "off" for False
        extra["skip_zero_advantage"] = False if skip == "off" else skip
    extra.update(options or {})
    return cls(model=model, reward_funcs=reward or digit_reward, args=args, train_dataset=data,
               processing_class=tokenizer(), **extra)  # fmt: skip


def micro_batch(seed=0, B=4, P=3, C=6):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([C, 3, 1, 5])[:B]
    inputs = {
        "prompt_ids": torch.randint(3, len(VOCAB), (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(3, len(VOCAB), (B, C), generator=g),
        "completion_mask": (torch.arange(C) < lengths[:, None]).long(),
        "advantages": torch.randn(B, generator=g, dtype=torch.float64),
    }
    inputs["prompt_mask"][0, 0] = 0  # left padding
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum().double()
    return inputs


def loss_and_grads(fn, trainer, inputs, mode="train"):
    trainer.model.zero_grad(set_to_none=True)
    trainer._metrics[mode].clear()
    loss = fn(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    settle(trainer._metrics[mode])  # as when logged
    # TRL's metrics (and the skip's, compared where they apply); what the padding-free forward logs of itself is
    # checked in test_train_checkpointed.py
    own = {k: v[-1] for k, v in trainer._metrics[mode].items() if not k.startswith("padding_free/")}
    return loss.detach(), grads, own


SETTINGS = [
    {"loss_type": "dapo"},
    {"loss_type": "grpo", "beta": 0.04},
    {"loss_type": "dapo", "top_entropy_quantile": 0.2},
    {"loss_type": "bnpo", "importance_sampling_level": "sequence", "entropy_coef": 0.01},
    {"loss_type": "cispo", "epsilon_high": 5.0, "off_policy_mask_threshold": 0.1},
    {"loss_type": "luspo", "importance_sampling_level": "sequence", "delta": 1.5},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_one_micro_batch_matches_trl(tmp_path, settings):
    compare_with_trl(tmp_path, tiny_model(), settings)


VARIANTS = {
    "softcap and logit scale": ({"final_logit_softcapping": 2.0, "logit_scale": 1.7}, {}, {}),
    "tool mask": ({}, {}, {"tool_mask": True}),
    "eval mode": ({}, {}, {"eval": True}),
    "cast_lm_head_to_fp32": ({}, {"cast_lm_head_to_fp32": True}, {}),
    # q = 0.4 puts the threshold between two of the 15 active entropies: a threshold that is itself an entropy
    # (q = 0.5 here) keeps or drops that token depending on its float32 rounding (TRL's stats are float32)
    "tied embeddings": ({"tie": True}, {"top_entropy_quantile": 0.4}, {}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trainer_variants_match_trl(tmp_path, variant):
    head, settings, how = VARIANTS[variant]
    compare_with_trl(tmp_path, tiny_model(**head), {"loss_type": "dapo", **settings}, **how)


def compare_with_trl(tmp_path, model, settings, tool_mask=False, eval=False, peft_config=None):
    trainer = make_trainer(CompiledGRPOTrainer, tmp_path, model, peft_config=peft_config, **settings)
    trainer.model.train(not eval)
    trainer.current_gradient_accumulation_steps = 2
    inputs = micro_batch()
    if tool_mask:  # tool-output tokens inside a completion are not trained on
        inputs["tool_mask"] = torch.ones_like(inputs["completion_mask"])
        inputs["tool_mask"][0, 1:3] = 0
    with torch.no_grad():  # off-policy old log-probs and a reference model's, as the trainer would carry them
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1),
        )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    inputs["old_per_token_logps"] = (logp + 0.1 * torch.randn(logp.shape, generator=g, dtype=logp.dtype)).clamp(max=0)
    if settings.get("beta"):
        inputs["ref_per_token_logps"] = (logp + 0.2 * torch.randn(logp.shape, generator=g, dtype=logp.dtype)).clamp(
            max=0
        )
    mode = "eval" if eval else "train"
    theirs = loss_and_grads(lambda m, i: GRPOTrainer._compute_loss(trainer, m, i), trainer, inputs, mode)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs, mode)
    # TRL's fused head keeps float32 statistics even for a float64 model: agreement to float32 rounding
    torch.testing.assert_close(ours[0], theirs[0].to(ours[0].dtype), rtol=2e-5, atol=1e-7)
    assert ours[1].keys() == theirs[1].keys()
    for name, g_theirs in theirs[1].items():
        scale = float(g_theirs.abs().max())
        err = float((ours[1][name] - g_theirs).abs().max())
        assert err <= 2e-5 * max(scale, 1e-6), f"{name}: {err:.2e} (scale {scale:.2e})"
    assert ours[2].keys() == theirs[2].keys()
    for name, value in theirs[2].items():
        assert ours[2][name] == pytest.approx(value, rel=2e-5, abs=1e-7), name
    return ours[2]


def test_three_training_steps_change_the_parameters(tmp_path):
    model = tiny_model(dtype=torch.float32, tie=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = make_trainer(CompiledGRPOTrainer, tmp_path, model, max_steps=3, top_entropy_quantile=0.5,
                           gradient_accumulation_steps=2)  # fmt: skip
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert "lm_head.weight" in changed or "model.embed_tokens.weight" in changed
    assert len(changed) >= len(before) // 2
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"entropy", "clip_ratio/region_mean", "loss"} <= logged
    assert all(isinstance(v, (int, float, str)) for entry in trainer.state.log_history for v in entry.values())


def test_auto_keeps_the_head_within_what_trls_head_holds(tmp_path, monkeypatch):
    """Inside the trainer "auto" bounds the lm_head's workspace by TRL's head's (a float32 dW sum and its copy),
    unless loss_options sets a budget; the schedule it picks fits that budget."""
    chosen = []
    original = choice.choose

    def recording(requested, engine, objective, head, budget):
        module, plan = original(requested, engine, objective, head, budget)
        fits = module is memory or module.workspace_bytes(engine, plan, head) <= budget
        chosen.append((module.__name__.rsplit(".", 1)[-1], budget, fits))
        return module, plan

    monkeypatch.setattr(choice, "choose", recording)
    model = tiny_model(dtype=torch.float32)
    trainer = make_trainer(CompiledGRPOTrainer, tmp_path, model)
    weight = model.get_output_embeddings().weight
    assert trainer.fused_loss.logits_budget_bytes == trainer_budget(trainer.fused_loss, weight, weight.device)
    assert trainer_budget(trainer.fused_loss, weight, weight.device) >= weight.numel() * 8
    trainer.current_gradient_accumulation_steps = 1
    loss_and_grads(trainer._compute_loss, trainer, micro_batch())
    assert chosen[-1][1:] == (trainer.fused_loss.logits_budget_bytes, True)
    assert chosen[-1][0] != "speed"  # its workspace here (tiles of 256 tokens on a CPU) exceeds TRL's head's
    roomy = make_trainer(CompiledGRPOTrainer, tmp_path, model, loss_options={"logits_budget_bytes": 1 << 30})
    roomy.current_gradient_accumulation_steps = 1
    loss_and_grads(roomy._compute_loss, roomy, micro_batch())
    assert chosen[-1][:2] == ("speed", 1 << 30)


def test_the_trainer_captures_small_heads_by_default(tmp_path):
    """Captured calls unless loss_options says, up to hidden size 2048 (on a CPU the captures stand aside)."""
    from compiled_grpo.integrations.trl import captures_by_default

    model = tiny_model(dtype=torch.float32)
    assert make_trainer(CompiledGRPOTrainer, tmp_path, model).fused_loss.captures is not None
    off = make_trainer(CompiledGRPOTrainer, tmp_path, model, loss_options={"capture": False})
    assert off.fused_loss.captures is None
    assert captures_by_default(torch.empty(10, 2048, device="meta"))
    assert not captures_by_default(torch.empty(10, 3584, device="meta"))


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"schedule": "memory"}, r"loss_options: 'schedule' is an argument of CompiledGRPOTrainer itself: pass "
                                 r"CompiledGRPOTrainer\(\.\.\., schedule=\.\.\.\)"),
        ({"compiled": False}, r"'compiled' is an argument of CompiledGRPOTrainer itself"),
        ({"loss_type": "grpo"}, r"loss_options: 'loss_type' is a loss setting, which CompiledGRPOTrainer reads from "
                                r"its GRPOConfig"),
        ({"logits_budget": 1}, r"loss_options got unknown keyword\(s\): 'logits_budget' \(did you mean "
                               r"'logits_budget_bytes'\?\)"),
    ],
)  # fmt: skip
def test_loss_options_say_where_a_misplaced_key_belongs(tmp_path, options, said):
    with pytest.raises(TypeError, match=said):
        make_trainer(CompiledGRPOTrainer, tmp_path, tiny_model(dtype=torch.float32), loss_options=options)


def tiny_moe(seed=0):
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=len(VOCAB), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.05, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    )  # fmt: skip
    return MixtralForCausalLM(config)  # float32: the experts' grouped GEMM has no float64 kernel


def test_moe_auxiliary_loss_matches_trl(tmp_path):
    metrics = compare_with_trl(tmp_path, tiny_moe(), {"loss_type": "grpo"})
    assert metrics["aux_loss"] > 0


def test_peft_adapter_matches_trl(tmp_path):
    peft = pytest.importorskip("peft", reason="peft is in the test extras")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    compare_with_trl(tmp_path, tiny_model(), {"loss_type": "dapo", "top_entropy_quantile": 0.2}, peft_config=lora)


def test_adaptive_entropy_controller_matches_trl(tmp_path):
    """Two accumulation windows: the coefficient gating, its update and the logged values agree with TRL's."""
    settings = {"use_adaptive_entropy": True, "entropy_coef": 0.05, "entropy_target": 5.0, "entropy_coef_delta": 0.02}
    trainer = make_trainer(CompiledGRPOTrainer, tmp_path, tiny_model(), loss_type="dapo", **settings)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    start = (trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats)
    batches = [micro_batch(seed=0), micro_batch(seed=1)]
    runs = []
    for fn in (lambda m, i: GRPOTrainer._compute_loss(trainer, m, i), trainer._compute_loss):
        trainer.entropy_coef, trainer._last_world_entropy, trainer._entropy_window_stats = start
        results = []
        for inputs in batches:
            loss, grads, metrics = loss_and_grads(fn, trainer, inputs)
            results.append((loss, metrics, trainer.entropy_coef, trainer._last_world_entropy))
        runs.append(results)
    for (l_t, m_t, c_t, e_t), (l_o, m_o, c_o, e_o) in zip(*runs, strict=True):
        torch.testing.assert_close(l_o, l_t.to(l_o.dtype), rtol=2e-5, atol=1e-7)
        assert c_o == pytest.approx(c_t) and e_o == pytest.approx(e_t, rel=1e-5)
        assert m_o.keys() == m_t.keys()
        for name in m_t:
            assert m_o[name] == pytest.approx(m_t[name], rel=2e-5, abs=1e-7), name
    assert runs[1][1][2] == pytest.approx(0.05 + 2 * 0.02)  # raised twice: entropy stayed below the target


def test_the_unwrapped_model_is_remembered_for_each_wrapper():
    """accelerate's `unwrap_model` reads installed packages' metadata on every call (host time in every
    micro-batch): the trainer asks it once per wrapper, and again for a new wrapper (train() wraps anew)."""
    from types import SimpleNamespace

    from compiled_grpo.integrations.trl.settings import unwrapped

    calls = []
    inner, wrappers = torch.nn.Linear(2, 2), [torch.nn.Sequential(), torch.nn.Sequential()]
    trainer = SimpleNamespace(accelerator=SimpleNamespace(unwrap_model=lambda m: calls.append(m) or inner))
    assert [unwrapped(trainer, w) for w in (wrappers[0], wrappers[0], wrappers[1], wrappers[0])] == [inner] * 4
    assert calls == wrappers
