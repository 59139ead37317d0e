"""TRL 1.16's fused LM head on this library (`compiled_fused_head`): the drop-in against TRL's own
`ChunkedLogProbFunction` (its torch path on the CPU), and one training step of TRL's SFT, DPO, KTO and GRPO
trainers with it against the same step with TRL's head."""

from __future__ import annotations

import copy

import pytest
import torch
from datasets import Dataset
from test_integration_trl import digit_reward, tiny_model, tokenizer
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer
from trl.kernels import ChunkedLogProbFunction

import compiled_grpo.integrations.trl.head as integration
from compiled_grpo.integrations.trl import EagerFusedHeadFunction, compiled_fused_head

OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def head_inputs(seed=0, N=77, H=24, V=301, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, dtype=dtype)
    weight = torch.randn(V, H, generator=g, dtype=dtype) / H**0.5 * 2
    bias = torch.randn(V, generator=g, dtype=dtype) * 0.3
    targets = torch.randint(0, V, (N,), generator=g)
    targets[:4] = (hidden[:4] @ weight.T + bias).argmax(-1)  # some targets are the top-1 token
    return hidden, weight, bias, targets, g


@pytest.mark.parametrize("head", [{}, {"final_logit_softcapping": 3.0, "logit_scale": 0.7}], ids=["plain", "softcap"])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_drop_in_matches_trls_function(head, temperature):
    hidden, weight, bias, targets, g = head_inputs()
    g_logp, g_entropy = torch.randn(len(targets), generator=g), torch.randn(len(targets), generator=g) * 0.1
    results = []
    for function in (ChunkedLogProbFunction, EagerFusedHeadFunction):
        h, w, b = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        out = function.apply(h, w, b, targets, temperature, 128, head.get("final_logit_softcapping"),
                             head.get("logit_scale", 1.0), OUTPUTS)  # fmt: skip
        ((out[0] * g_logp).sum() + (out[1] * g_entropy).sum()).backward()
        results.append((out, (h.grad, w.grad, b.grad)))
    (trl_out, trl_grads), (ours, our_grads) = results
    for name, a, b in zip(("log_probs", *OUTPUTS), ours, trl_out, strict=True):
        if name == "is_top1":
            assert torch.equal(a, b) and bool(a[:4].all()), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    for name, a, b in zip(("hidden", "weight", "bias"), our_grads, trl_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


def test_outputs_not_asked_for_are_none():
    hidden, weight, bias, targets, _ = head_inputs()
    out = EagerFusedHeadFunction.apply(hidden, weight, bias, targets, 1.0, 128, None, 1.0, ("log_probs",))
    assert out[0].shape == targets.shape and all(x is None for x in out[1:])


def test_the_switch_restores_trls_head():
    import trl.trainer.utils as trl_utils

    before = trl_utils._ChunkedLogProbFunction
    with compiled_fused_head(compiled=False):
        assert trl_utils._ChunkedLogProbFunction is EagerFusedHeadFunction
    assert trl_utils._ChunkedLogProbFunction is before


def test_the_switch_with_rounded_logits():
    """compiled_fused_head(round_logits=True) on bf16 inputs: TRL's head's log-probs and entropies (it rounds the
    product to bf16 too), where the default's float32 product gives different ones; a non-bool is refused."""
    import trl.trainer.utils as trl_utils

    hidden, weight, _, targets, _ = head_inputs(dtype=torch.bfloat16)
    trl_logp, trl_entropy, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, 128, None, 1.0,
                                                             ("entropy",))  # fmt: skip
    found = {}
    for rounded in (False, True):
        with compiled_fused_head(compiled=False, round_logits=rounded):
            function = trl_utils._ChunkedLogProbFunction
            found[rounded] = function.apply(hidden, weight, None, targets, 1.0, 128, None, 1.0, ("entropy",))[:2]
    torch.testing.assert_close(found[True][0], trl_logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(found[True][1], trl_entropy, rtol=0, atol=1e-5)
    assert (found[False][0] - trl_logp).abs().max() > 1e-3  # the default keeps the float32 product
    with pytest.raises(ValueError, match="round_logits"), compiled_fused_head(round_logits="backward"):
        pass


def test_the_switch_narrows_widened_hidden_states_for_the_fp32_head(monkeypatch):
    """compiled_fused_head(hidden_dtype=torch.bfloat16): the float32 hidden states TRL's `cast_lm_head_to_fp32`
    widened are narrowed back (exactly), so the float32 weight meets bf16 hidden states and the fp32 head's split
    products run (`products.SPLIT_ON_CPU` here): the numbers of the primitive called on the bf16 states, the gradient
    coming back to TRL's float32 states; without it, float32 GEMMs. A dtype other than 16-bit is refused."""
    import trl.trainer.utils as trl_utils

    from compiled_grpo import fused_linear_logprobs, products

    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    hidden, weight, _, targets, _ = head_inputs()  # a float32 weight (not bf16 values)
    hidden = hidden.bfloat16()
    found = {}
    for narrowed in (None, torch.bfloat16):
        widened = hidden.float().requires_grad_()
        with compiled_fused_head(compiled=False, hidden_dtype=narrowed):
            logp, entropy = trl_utils._ChunkedLogProbFunction.apply(widened, weight, None, targets, 1.0, 128, None,
                                                                    1.0, ("entropy",))[:2]  # fmt: skip
        logp.sum().backward()
        found[narrowed] = (logp, widened.grad)
    direct = fused_linear_logprobs(hidden, weight, targets, compiled=False)
    assert torch.equal(found[torch.bfloat16][0], direct.logp)
    assert not torch.equal(found[None][0], direct.logp)  # float32 GEMMs: not the split's numbers
    assert found[torch.bfloat16][1].dtype == torch.float32
    with pytest.raises(ValueError, match="hidden_dtype"), compiled_fused_head(hidden_dtype=torch.float32):
        pass


def test_the_switch_with_captured_calls(monkeypatch):
    """compiled_fused_head(capture=True): TRL's head on the primitive with its passes captured (here through the
    CPU stand-in graph), equal to TRL's function; capture without compile is refused."""
    import trl.trainer.utils as trl_utils
    from test_capture import ReplayOnTheStaticInputs

    from compiled_grpo import logprobs
    from compiled_grpo.integrations.trl import CapturedFusedHeadFunction
    from compiled_grpo.schedules import passes

    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    monkeypatch.setattr(logprobs, "PRIMITIVE_CAPTURES", ReplayOnTheStaticInputs())
    monkeypatch.setattr(CapturedFusedHeadFunction, "compiled", False)  # eager tiles: no compile on the CPU
    with pytest.raises(ValueError, match="capture"), compiled_fused_head(compiled=False, capture=True):
        pass
    with compiled_fused_head(capture=True):
        function = trl_utils._ChunkedLogProbFunction
    assert function is CapturedFusedHeadFunction
    hidden, weight, bias, targets, g = head_inputs()
    g_logp = torch.randn(len(targets), generator=g)
    weights = {f: weight.clone().requires_grad_() for f in (ChunkedLogProbFunction, function)}  # one per head
    for _ in range(3):
        outs = []
        for f, w in weights.items():
            w.grad = None
            h = hidden.clone().requires_grad_()
            out = f.apply(h, w, None, targets, 0.8, 128, None, 1.0, ("entropy",))
            (out[0] * g_logp).sum().backward()
            outs.append((out[0], h.grad, w.grad))
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert logprobs.PRIMITIVE_CAPTURES.replays >= 2


def one_step(make_trainer, ours: bool):
    """Parameters after one optimizer step and the logged loss; TRL's head, or ours via the switch."""
    trainer = make_trainer()
    calls = []
    entries = ("fused_linear_logprobs", "fused_linear_logprobs_with_extras")  # the head's two ways in
    originals = {name: getattr(integration, name) for name in entries}
    for name, original in originals.items():
        setattr(integration, name, lambda *a, original=original, **k: calls.append(1) or original(*a, **k))
    try:
        if ours:
            with compiled_fused_head(compiled=False):
                trainer.train()
        else:
            trainer.train()
    finally:
        for name, original in originals.items():
            setattr(integration, name, original)
    assert bool(calls) == ours  # the switch reached the trainer's head, and only inside the block
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters()}, logged


def assert_same_step(make_trainer, rtol=1e-6):
    """The same parameters after the step, and the same logged values (the loss, and the metrics the head's extra
    fields feed: SFT's mean_token_accuracy, DPO's logits/*), but timings."""
    theirs, their_log = one_step(make_trainer, ours=False)
    ours, our_log = one_step(make_trainer, ours=True)
    timed = ("time", "runtime", "per_second")
    names = [k for k, v in their_log.items() if isinstance(v, (int, float)) and not any(t in k for t in timed)]
    assert "loss" in names and set(names) <= set(our_log)
    for name in names:
        assert our_log[name] == pytest.approx(their_log[name], rel=rtol * 10, abs=1e-6), name
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=rtol, atol=1e-9, msg=name)


COMMON = {"per_device_train_batch_size": 4, "max_steps": 1, "learning_rate": 1e-2, "logging_steps": 1,
          "report_to": [], "use_cpu": True, "save_strategy": "no", "bf16": False, "seed": 0}  # fmt: skip


def test_sft_step_equals_trls(tmp_path):
    base = tiny_model(dtype=torch.float32)
    data = Dataset.from_dict({"text": ["a b c 1 2", "d e f 3", "1 2 a b c d", "g h i 4 5 6"] * 2})

    def make():
        args = SFTConfig(output_dir=str(tmp_path), max_length=16, **COMMON)
        return SFTTrainer(model=copy.deepcopy(base), args=args, train_dataset=data, processing_class=tokenizer())

    assert_same_step(make)


def saved_policy(tmp_path):
    """A tiny model saved where its config points: DPO and KTO load their reference model from the policy's path."""
    base = tiny_model(dtype=torch.float32)
    base.save_pretrained(tmp_path / "policy")
    base.config._name_or_path = str(tmp_path / "policy")
    return base


def test_dpo_step_equals_trls(tmp_path):
    base = saved_policy(tmp_path)
    data = Dataset.from_dict({
        "prompt": ["a b", "c d", "1 2", "e f"] * 2,
        "chosen": [" 1 2", " 3", " a b", " 4 5"] * 2,
        "rejected": [" c", " d e", " f", " g"] * 2,
    })  # fmt: skip

    def make():
        args = DPOConfig(output_dir=str(tmp_path), max_length=16, **COMMON)
        return DPOTrainer(model=copy.deepcopy(base), args=args, train_dataset=data, processing_class=tokenizer())

    assert_same_step(make)


def test_kto_step_equals_trls(tmp_path):
    """KTO asks its head for mean_logits too (its logits/* metrics)."""
    base = saved_policy(tmp_path)
    data = Dataset.from_dict({
        "prompt": ["a b", "c d", "1 2", "e f"] * 2,
        "completion": [" 1 2", " 3", " a b", " 4 5"] * 2,
        "label": [True, False, True, False] * 2,
    })  # fmt: skip

    def make():
        args = KTOConfig(output_dir=str(tmp_path), max_length=16, **COMMON)
        return KTOTrainer(model=copy.deepcopy(base), args=args, train_dataset=data, processing_class=tokenizer())

    assert_same_step(make)


def test_grpo_step_equals_trls(tmp_path):
    base = tiny_model(dtype=torch.float32)
    data = Dataset.from_dict({"prompt": ["a b c", "d e f", "1 2 a", "g h i"] * 2})

    def make():
        torch.manual_seed(0)  # the same sampled completions
        args = GRPOConfig(output_dir=str(tmp_path), num_generations=4, max_completion_length=6, **COMMON)
        return GRPOTrainer(model=copy.deepcopy(base), reward_funcs=digit_reward, args=args, train_dataset=data,
                           processing_class=tokenizer())  # fmt: skip

    assert_same_step(make, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "round_logits", "fp32_head"),
                         [(torch.float32, False, False), (torch.bfloat16, True, False), (torch.bfloat16, False, True)],
                         ids=["float32", "bf16-rounded", "bf16-fp32-head"])  # fmt: skip
def test_compiled_grpo_trainer_old_log_probs_equal_the_losss(tmp_path, monkeypatch, dtype, round_logits, fp32_head):
    """With old log-probs computed (num_iterations=2), CompiledGRPOTrainer scores them with this library's kernels,
    at the loss's round_logits: on the first (on-policy) step they equal the loss's log-probs bitwise, so the
    importance ratio is exactly 1; with `cast_lm_head_to_fp32` too (the split products, run here on the CPU)."""
    from test_integration_trl import make_trainer

    from compiled_grpo import products
    from compiled_grpo.integrations.trl import CompiledGRPOTrainer

    monkeypatch.setattr(products, "SPLIT_ON_CPU", True)
    monkeypatch.setattr(products, "SPLIT_TERMS", 2)  # on a tiny model 3 terms round as float32 GEMMs: 2 tell them apart
    trainer = make_trainer(CompiledGRPOTrainer, tmp_path, tiny_model(dtype=dtype), num_iterations=2,
                           loss_options={"round_logits": round_logits},
                           cast_lm_head_to_fp32=fp32_head)  # fmt: skip
    if fp32_head:  # float32 values bf16 cannot hold, so that the split's lower terms are not 0
        with torch.no_grad():
            weight = trainer.model.get_output_embeddings().weight
            weight.add_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)) * 1e-3)
    seen = []
    loss_fn = trainer.fused_loss

    class Spy:
        kernels = loss_fn.kernels
        check = loss_fn.check
        round_logits = loss_fn.round_logits

        def __call__(self, *args, **kwargs):
            out = loss_fn(*args, **kwargs)
            seen.append((kwargs["old_per_token_logps"], out.per_token_logps, args[3].bool()))
            return out

    trainer.fused_loss = Spy()
    trainer.train()
    old, logp, mask = seen[0]
    assert old is not None and bool(mask.any())
    assert torch.equal(old[mask], logp[mask])
