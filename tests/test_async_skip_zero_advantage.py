"""CompiledAsyncGRPOTrainer with `skip_zero_advantage`: the samples at advantage 0 packed into a second prefix
trie that runs without grad ("backward") or not at all ("all"). Against TRL 1.16's own `AsyncGRPOTrainer.compute_loss`
on the usual one-trie batch, with a plain-torch tree attention (TRL's needs FlashAttention-3): the same loss,
gradients and metrics ("all": loss and gradients); the calls every rank makes agree."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from test_trl_async import TEMPERATURE, VOCAB, loss_and_gradients, stand_in, tiny_model
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
from trl.experimental.async_grpo import AsyncGRPOTrainer  # noqa: E402
from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout  # noqa: E402
from trl.experimental.async_grpo.packing import TreeRow  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from compiled_grpo import FusedLinearGRPOLoss  # noqa: E402
from compiled_grpo.integrations.trl import async_zero_advantage  # noqa: E402
from compiled_grpo.integrations.trl.async_grpo import ASYNC_METRICS, async_loss_settings, packed_row_loss  # noqa: E402

TREE = "tree_reference"


def tree_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                   tree_cu_seqlens_k, scaling=None, **kwargs):  # fmt: skip
    """What TRL's tree attention computes, in plain torch: each segment of the trie attends causally (aligned at
    the end) to the K/V rows of its root-to-segment path."""
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, heads, d]
    k, v = (t.index_select(0, tree_kv_index).repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    cq, ck, out = tree_cu_seqlens_q.tolist(), tree_cu_seqlens_k.tolist(), []
    for s in range(len(cq) - 1):
        qs, ks, vs = q[cq[s] : cq[s + 1]], k[ck[s] : ck[s + 1]], v[ck[s] : ck[s + 1]]
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * (scaling or qs.shape[-1] ** -0.5)
        late = torch.arange(ks.shape[0])[None, :] > (ks.shape[0] - qs.shape[0] + torch.arange(qs.shape[0]))[:, None]
        out.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(late, float("-inf")).softmax(-1), vs))
    return torch.cat(out).unsqueeze(0), None


AttentionInterface.register(TREE, tree_attention)
AttentionMaskInterface.register(TREE, lambda **kwargs: None)


def samples(groups=3, per_group=3, prompt=5, zero_groups=(1,), seed=0) -> list[dict]:
    """Groups of samples sharing their prompt; every sample of a group in `zero_groups` at advantage 0."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(groups):
        head = torch.randint(3, VOCAB, (prompt,), generator=g)
        for _ in range(per_group):
            tail = torch.randint(3, VOCAB, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g)
            ids = torch.cat([head, tail])
            mask = (torch.arange(len(ids)) >= prompt).long()
            advantage = 0.0 if group in zero_groups else float(torch.randn((), generator=g))
            out.append({"input_ids": ids, "completion_mask": mask, "advantage": advantage, "group_id": group,
                        "old_log_probs": -4.5 + torch.randn(len(ids), generator=g), "metrics": {}})  # fmt: skip
    return out


def rows_of(per_rank: list[list[dict]]) -> list[TreeRow]:
    return [async_zero_advantage.row_of(s) for s in per_rank]


def batches(per_rank, forward_untrained=True):
    """(TRL's batch, the split batch) of the same rows."""
    trl = DataCollatorForRollout(pad_token_id=0, num_processes=len(per_rank)).torch_call([rows_of(per_rank)])
    split = async_zero_advantage.SplitCollator(pad_token_id=0, num_processes=len(per_rank),
                                               forward_untrained=forward_untrained)  # fmt: skip
    return trl, split.torch_call([rows_of(per_rank)])


def model_with_tree_attention():
    model = tiny_model()
    model.set_attn_implementation(TREE)
    add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))  # TRL's loss reads them
    return model


@pytest.mark.parametrize("mode", ["backward", "all"])
def test_split_rows_give_trls_loss_gradients_and_metrics(mode):
    model = model_with_tree_attention()
    trl_batch, split_batch = batches([samples()], forward_untrained=mode == "backward")
    assert ("zero/input_ids" in split_batch) == (mode == "backward")
    assert split_batch["input_ids"].shape[1] < trl_batch["input_ids"].shape[1]  # the trie with a gradient is smaller
    theirs, ours = stand_in(model), stand_in(model)
    ours.fused_loss = FusedLinearGRPOLoss(compiled=False, **async_loss_settings(ours))
    calls = []
    model.model.register_forward_pre_hook(lambda m, a, kw: calls.append(torch.is_grad_enabled()), with_kwargs=True)
    trl_loss, trl_grads = loss_and_gradients(lambda m, x: AsyncGRPOTrainer.compute_loss(theirs, m, x), model,
                                             copy.deepcopy(trl_batch))  # fmt: skip
    calls.clear()
    loss, grads = loss_and_gradients(lambda m, x: packed_row_loss(ours, m, x), model, copy.deepcopy(split_batch))
    assert calls == ([True, False] if mode == "backward" else [True])
    torch.testing.assert_close(loss, trl_loss, rtol=1e-5, atol=1e-7)
    assert grads.keys() == trl_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, trl_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    if mode == "backward":
        for name in ("ratio", "kl", *ASYNC_METRICS):
            assert ours._metrics["train"][name] == pytest.approx(theirs._metrics["train"][name], rel=1e-5), name
    for field in ("_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted", "_step_samples"):
        assert getattr(ours, field) == getattr(theirs, field), field  # TRL's accounting of the whole micro-batch


def test_no_sample_at_advantage_0_packs_as_trl():
    trl_batch, split_batch = batches([samples(zero_groups=())])
    assert trl_batch.keys() == split_batch.keys()
    assert all(torch.equal(trl_batch[k], split_batch[k]) for k in trl_batch)


def test_every_rank_runs_the_same_calls():
    """Rank 0 wholly at advantage 0, rank 1 with none: rank 0's first row holds one of its samples (loss 0), rank
    1's second row a stand-in copy whose terms are dropped; under "all", rank 0's first row counts nowhere."""
    everything = samples(groups=2, zero_groups=(0,))
    per_rank = [everything[:3], everything[3:]]
    _, split = batches(per_rank)
    assert split["input_ids"].shape[0] == split["zero/input_ids"].shape[0] == 2
    assert split["zero/stand_in"].tolist() == [False, True]
    assert split["zero/first_stand_in"].tolist() == [False, False]
    assert [int((split["token_index"][r] >= 0).sum()) > 0 for r in range(2)] == [True, True]
    _, sliced = batches(per_rank, forward_untrained=False)
    assert "zero/input_ids" not in sliced and sliced["zero/first_stand_in"].tolist() == [True, False]


def test_the_collator_logs_the_share_of_samples_that_skip():
    """3 of 9 samples at advantage 0 on one rank ("backward": their backward; "all": their forward too); on two
    ranks, one of rank 0's 3 is moved into its row with grad."""
    for forward_untrained, forward_share in ((True, 0.0), (False, 3 / 9)):
        collator = async_zero_advantage.SplitCollator(pad_token_id=0, num_processes=1,
                                                      forward_untrained=forward_untrained)  # fmt: skip
        collator.torch_call([rows_of([samples()])])
        assert collator.metrics["zero_advantage/skipped_backward"] == [pytest.approx(3 / 9)]
        assert collator.metrics["zero_advantage/skipped_forward"] == [pytest.approx(forward_share)]
    everything = samples(groups=2, zero_groups=(0,))
    collator = async_zero_advantage.SplitCollator(pad_token_id=0, num_processes=2)
    collator.torch_call([rows_of([everything[:3], everything[3:]])])
    assert collator.metrics["zero_advantage/skipped_backward"] == [pytest.approx(2 / 6)]


@pytest.mark.parametrize("mode, splits", [("backward", True), ("all", True), ("auto", False), (False, False)])
def test_the_trainer_packs_with_the_split_collator(tmp_path, monkeypatch, mode, splits):
    """The trainer's dataloader collates with `SplitCollator` where it splits ("auto" does not at this hidden size),
    and TRL's module is left as it was."""
    from test_trl_async import trainer
    from trl.experimental.async_grpo import async_grpo_trainer

    from compiled_grpo.integrations.trl.async_grpo import CompiledAsyncGRPOTrainer

    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda accelerator, dtype: 1e12)
    monkeypatch.setattr(async_grpo_trainer, "RolloutQueueDataset", lambda **kwargs: [])
    tiny_model().save_pretrained(tmp_path / "model")
    t = trainer(CompiledAsyncGRPOTrainer, tmp_path / "model", tmp_path / "out", compiled=False,
                skip_zero_advantage=mode)  # fmt: skip
    t.args.token_budget = 0  # a fixed sample count per micro-batch: no vLLM server asked for its length
    loader = t.get_train_dataloader()
    collate = getattr(loader, "collate_fn", None) or loader.base_dataloader.collate_fn
    assert isinstance(collate, async_zero_advantage.SplitCollator) == splits
    if splits:
        assert collate.forward_untrained == (mode == "backward")
    assert async_grpo_trainer.DataCollatorForRollout is DataCollatorForRollout
