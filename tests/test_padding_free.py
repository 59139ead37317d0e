"""CompiledGRPOTrainer on real tokens only: a packed sequence equals the sequence forwarded alone, and the trainer's
packed (or trimmed) step equals GRPOTrainer's padded `_compute_loss` (left-padded prompts, right-padded completions of
varied lengths) in loss, every gradient and every logged metric, across loss types and settings. Each comparison
also checks that the step did pack (`packed_forward` counted), so a packing that silently fell back cannot pass."""

from __future__ import annotations

import pytest
import torch
from test_integration_trl import VOCAB, loss_and_grads, make_trainer
from test_skip_zero_advantage import assert_same, tiny_qwen2, trl_loss
from trl import GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, packed_attention, packing, padding_free, plan

B, P, C = 6, 5, 9
PROMPTS, COMPLETIONS = [5, 2, 4, 1, 3, 5], [9, 3, 1, 6, 8, 2]  # real tokens of each row


def varied_batch(seed=0, zeros=(), truncated=(), tool=False) -> dict:
    """B rows of left-padded prompts and right-padded completions of the lengths above (row 0 the longest)."""
    g = torch.Generator().manual_seed(seed)
    prompt, completion = torch.tensor(PROMPTS), torch.tensor(COMPLETIONS)
    inputs = {
        "prompt_ids": torch.randint(3, len(VOCAB), (B, P), generator=g),
        "prompt_mask": (torch.arange(P) >= P - prompt[:, None]).long(),
        "completion_ids": torch.randint(3, len(VOCAB), (B, C), generator=g),
        "completion_mask": (torch.arange(C) < completion[:, None]).long(),
        "advantages": torch.randn(B, generator=g),
    }
    inputs["advantages"][list(zeros)] = 0.0
    inputs["completion_mask"][list(truncated)] = 0  # mask_truncated_completions: a truncated row masked out whole
    if tool:  # tool-output tokens inside a completion: forwarded, not trained on
        inputs["tool_mask"] = torch.ones_like(inputs["completion_mask"])
        inputs["tool_mask"][0, 2:5] = 0
    inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()
    return inputs


def with_logps(trainer, inputs: dict, beta: float) -> dict:
    """Off-policy old log-probs (and reference ones) from the trainer's own scoring, as `_prepare_inputs` makes them."""
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), C,
        )  # fmt: skip
    g = torch.Generator().manual_seed(1)
    inputs["old_per_token_logps"] = (logp + 0.1 * torch.randn(logp.shape, generator=g)).clamp(max=0.0)
    if beta:
        inputs["ref_per_token_logps"] = (logp + 0.2 * torch.randn(logp.shape, generator=g)).clamp(max=0.0)
    return inputs


@pytest.fixture
def packed_calls(monkeypatch):
    calls, packed_forward = [], padding_free.packed_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return packed_forward(*args, **kwargs)

    monkeypatch.setattr(padding_free, "packed_forward", counting)
    return calls


def trainer_for(tmp_path, skip="off", accumulation=2, **settings):
    trainer = make_trainer(CompiledGRPOTrainer, tmp_path, tiny_qwen2(), skip=skip, **settings)
    trainer.padding_free_mode = "pack"  # "auto" packs on a GPU from hidden size 2048 only (trims here)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = accumulation
    return trainer


def packed_step_matches_trl(trainer, inputs, packed_calls, metrics=True):
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert packed_calls and trainer.packing_refused == "", "the step did not pack"
    assert_same(ours, theirs, metrics=metrics)


LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")


@pytest.mark.parametrize("q", [1.0, 0.5])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_loss_type_packed_equals_trl(tmp_path, packed_calls, loss_type, q):
    trainer = trainer_for(tmp_path, loss_type=loss_type, top_entropy_quantile=q)
    packed_step_matches_trl(trainer, with_logps(trainer, varied_batch(), 0.0), packed_calls)


CASES = {  # (trainer settings, batch options, num_items_in_batch as a multiple of the micro-batch's tokens)
    "beta 0.04, grpo": ({"loss_type": "grpo", "beta": 0.04}, {}, 1),
    "beta 0.04, dapo, seq IS": ({"loss_type": "dapo", "beta": 0.04, "importance_sampling_level": "sequence"}, {}, 1),
    "num_items_in_batch of 4 micro-batches, vespo": ({"loss_type": "vespo"}, {}, 4),
    "num_iterations 2, cispo": ({"loss_type": "cispo", "num_iterations": 2}, {}, 1),
    "tool mask, bnpo": ({"loss_type": "bnpo"}, {"tool": True}, 1),
    "truncated masked, grpo": ({"loss_type": "grpo", "mask_truncated_completions": True}, {"truncated": (3,)}, 1),
    "entropy bonus, dapo": ({"loss_type": "dapo", "entropy_coef": 0.01}, {}, 1),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_settings_packed_equal_trl(tmp_path, packed_calls, case):
    settings, batch, items = CASES[case]
    trainer = trainer_for(tmp_path, **settings)
    inputs = with_logps(trainer, varied_batch(**batch), settings.get("beta", 0.0))
    inputs["num_items_in_batch"] = inputs["num_items_in_batch"] * items
    packed_step_matches_trl(trainer, inputs, packed_calls)


@pytest.mark.parametrize("mode", ["backward", "all"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo"])
def test_skip_modes_packed_equal_trl(tmp_path, packed_calls, loss_type, mode):
    """Rows at advantage 0 packed into a forward without grad ("backward") or left out ("all")."""
    trainer = trainer_for(tmp_path, skip=mode, loss_type=loss_type)
    inputs = with_logps(trainer, varied_batch(zeros=(1, 2, 4)), 0.0)
    packed_step_matches_trl(trainer, inputs, packed_calls, metrics=mode == "backward")


def test_old_logps_packed_equal_trls(tmp_path, packed_calls):
    """The old log-probs scored packed, in chunks of `batch_size` rows, are TRL's padded ones (0 where no token)."""
    trainer = trainer_for(tmp_path, loss_type="dapo")
    inputs = varied_batch()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        ours, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, C, batch_size=4)
        theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(trainer, trainer.model, ids, mask, C, 4)
    assert trainer.packing_refused == ""
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=2e-6)
    assert bool((ours[inputs["completion_mask"] == 0] == 0).all())


def test_a_packed_sequence_equals_the_sequence_alone():
    model = tiny_qwen2().eval()
    inputs = varied_batch()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    lengths = plan.read(None, [inputs], with_zeros=False)[0].lengths
    forward = padding_free.packed_ids_forward(model, model.get_output_embeddings(), None)
    with torch.no_grad():
        packed = packing.pack(ids, lengths, torch.arange(B), 8)
        both, _ = forward(packed)
        for row in range(B):
            alone, _ = forward(packing.pack(ids, lengths, torch.tensor([row]), 1))
            start, span = int(packed.starts[row]), PROMPTS[row] + COMPLETIONS[row]
            torch.testing.assert_close(both[start : start + span], alone, rtol=1e-5, atol=1e-5)
    assert both.shape[0] % 8 == 0 and padding_free.packing_fails(forward, ids, lengths) is None


def test_positions_not_restarted_are_caught(monkeypatch):
    """The sabotage: positions running on across sequences. The packed rows then differ from the rows alone, and
    the model check says so (the trainer would trim instead)."""
    pack = packing.pack

    def running_positions(ids, lengths, rows, bucket):
        packed = pack(ids, lengths, rows, bucket)
        positions = torch.arange(packed.position_ids.shape[1]).unsqueeze(0)
        return packed._replace(position_ids=positions)

    monkeypatch.setattr(padding_free, "pack", running_positions)
    model = tiny_qwen2().eval()
    inputs = varied_batch()
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    lengths = plan.read(None, [inputs], with_zeros=False)[0].lengths
    forward = padding_free.packed_ids_forward(model, model.get_output_embeddings(), None)
    assert "keep packed sequences apart" in (padding_free.packing_fails(forward, ids, lengths) or "")


def test_a_model_that_cannot_pack_is_trimmed_and_said(tmp_path, monkeypatch):
    """A model whose attention ignores the positions' restarts (here: its position_ids dropped) fails the check:
    one notice, then trimmed steps that still equal TRL's."""
    trainer = trainer_for(tmp_path, loss_type="dapo")
    backbone = trainer.model.model
    forward = backbone.forward
    monkeypatch.setattr(backbone, "forward", lambda *a, position_ids=None, **k: forward(*a, **k))
    with pytest.warns(padding_free.PaddingFreeNotice, match="trimmed instead of packed"):
        inputs = with_logps(trainer, varied_batch(), 0.0)  # the first packed forward checks the model
    assert "keep packed sequences apart" in trainer.packing_refused
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert_same(ours, theirs)


def test_trim_only_equals_trl(tmp_path, packed_calls):
    trainer = trainer_for(tmp_path, loss_type="grpo")
    trainer.padding_free_mode = "trim"
    inputs = with_logps(trainer, varied_batch(tool=True), 0.0)
    theirs = loss_and_grads(trl_loss(trainer), trainer, inputs)
    ours = loss_and_grads(trainer._compute_loss, trainer, inputs)
    assert not packed_calls
    assert_same(ours, theirs)


def test_auto_packs_on_a_gpu_on_compiled_varlen_layers_or_from_hidden_size_2048():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert padding_free.effective_mode("auto", 3584, cuda) == "pack"
    assert padding_free.effective_mode("auto", 896, cuda, compiled_varlen=True) == "pack"
    assert padding_free.effective_mode("auto", 1536, cuda) == padding_free.effective_mode("auto", 3584, cpu) == "trim"
    assert padding_free.effective_mode("auto", 896, cpu, compiled_varlen=True) == "trim"
    assert padding_free.effective_mode(False, 3584, cuda) is False


def test_auto_attention_is_varlen_where_it_runs(monkeypatch):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cuda = torch.device("cuda")
    model = lambda **kw: Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64,  # noqa: E731
                                                      num_hidden_layers=1, num_attention_heads=2, **kw))  # fmt: skip
    monkeypatch.setattr(packed_attention, "varlen_unavailable", lambda device, sixteen_bit: None)
    assert padding_free.attention_for("auto", model(), cuda) == "varlen"
    assert padding_free.attention_for("auto", model(), torch.device("cpu")) is None
    assert padding_free.attention_for("auto", model(attention_dropout=0.1), cuda) == "sdpa"  # varlen runs none
    monkeypatch.setattr(packed_attention, "varlen_unavailable", lambda device, sixteen_bit: "no varlen here")
    assert padding_free.attention_for("auto", model(), cuda) == "sdpa"


@pytest.mark.parametrize("bad", [{"padding_free": "yes"}, {"padding_free": 1}, {"packed_bucket": 0},
                                 {"packed_bucket": 2.5}, {"packed_attention": 3}])  # fmt: skip
def test_bad_options_are_refused(bad):
    with pytest.raises((ValueError, TypeError), match=next(iter(bad))):
        CompiledGRPOTrainer(model=None, **bad)  # refused before the model is read


def test_bucketed_lengths_compile_a_bounded_number_of_graphs(tmp_path):
    """50 steps of random prompt and completion lengths (29 to 65 real tokens) on a compiled backbone (static shapes)
    and the compiled loss: the backbone sees packed rows of 64 or 128 tokens only, and dynamo compiles new graphs
    only in the first steps (the loss's tile variants) and where a new bucket first appears (dynamo's counters)."""
    from torch._dynamo.utils import counters

    trainer = trainer_for(tmp_path, loss_type="dapo")
    trainer.fused_loss = type(trainer.fused_loss)(compiled=True, **trainer.fused_loss.config.__dict__)
    trainer.packed_shapes = packing.Shapes(64)
    seen = []
    record = lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1])  # noqa: E731
    trainer.model.model.register_forward_pre_hook(record, with_kwargs=True)
    trainer.model.model = torch.compile(trainer.model.model, dynamic=False)
    g = torch.Generator().manual_seed(3)
    graphs = counters["stats"]["unique_graphs"]
    for step in range(50):
        prompt, completion = torch.randint(1, P + 1, (B,), generator=g), torch.randint(1, C + 1, (B,), generator=g)
        inputs = varied_batch(seed=step)
        inputs["prompt_mask"] = (torch.arange(P) >= P - prompt[:, None]).long()
        inputs["completion_mask"] = (torch.arange(C) < completion[:, None]).long()
        inputs["num_items_in_batch"] = inputs["completion_mask"].sum().float()
        lengths_before = set(seen)
        trainer._compute_loss(trainer.model, inputs).backward()
        new = counters["stats"]["unique_graphs"] - graphs
        graphs += new
        assert step < 3 or not new or not set(seen) <= lengths_before, f"step {step}: {new} new graphs"
    assert trainer.packing_refused == "" and set(seen) == {64, 128}
