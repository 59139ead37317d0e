"""Several ranks on gloo (processes spawned here) against one process on the whole batch.

Data parallel: equal B per rank (as DDP gives), unequal token counts, a rank with no active token. For the loss
types whose normalizer spans the whole batch, the loss averaged over ranks, the weight gradient averaged over
ranks (what DDP does) and each rank's hidden gradient divided by P match the single process; bnpo normalizes per
rank by definition, so each rank matches the reference on its own shard with the global entropy threshold. The
entropy mask and the metrics are the global ones everywhere. Vocabulary parallel: two ranks each holding half
of the lm_head match the unsharded loss, on every schedule. Sequence parallel: ranks holding slices of every
sequence's positions (alone, and beside data-parallel ranks) match the unsplit batch. An FSDP2-style DTensor
weight matches a plain one.
"""

from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import reference
from audits.harness import POSITIONAL, pack
from compiled_grpo import FusedLinearGRPOLoss

GLOBAL_LOSSES = ("grpo", "dr_grpo", "luspo", "dapo", "cispo", "vespo")
B_PER_RANK, T, H, V = 3, 9, 8, 37
TILES = {"token_tile": 16, "tail_tile": 4, "vocab_tile": 16, "speed_tile": 16}


def spawn(worker, world: int, *args):
    # The ranks meet through a fresh file rather than a TCP port: a port found free can be taken by another
    # test running beside this one before the ranks bind it.
    with tempfile.TemporaryDirectory() as folder:
        rendezvous = f"file://{os.path.join(folder, 'rendezvous')}"
        mp.spawn(_entry, args=(world, rendezvous, worker, args), nprocs=world, join=True)


def _entry(rank, world, rendezvous, worker, args):
    os.environ["GRPO_TEST_RENDEZVOUS"] = rendezvous
    torch.set_num_threads(1)
    worker(rank, world, *args)
    # A rank that finished ends here, not in the interpreter's teardown: a gloo worker thread can still be releasing a
    # finished collective's tensors then, and taking the GIL from it while the interpreter finalizes aborts the
    # process (torch's, pytorch/pytorch#190489; docs/scaling.md). A rank that raised goes on to spawn's error report.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def backend() -> str:
    """gloo on CPU (the tests); nccl on GPUs when run as `python tests/test_distributed.py --nccl`."""
    return os.environ.get("GRPO_TEST_BACKEND", "gloo")


def device() -> str:
    return "cuda" if backend() == "nccl" else "cpu"


def init(rank, world):
    if backend() == "nccl":
        torch.cuda.set_device(rank)
    rendezvous = os.environ["GRPO_TEST_RENDEZVOUS"]
    dist.init_process_group(backend(), init_method=rendezvous, rank=rank, world_size=world)


def on_device(x: dict) -> dict:
    return {k: (v.to(device()) if isinstance(v, torch.Tensor) else v) for k, v in x.items()}


def whole_batch(world: int, seed: int, empty_rank=None) -> dict:
    g = torch.Generator().manual_seed(seed)
    B = world * B_PER_RANK
    lengths = torch.randint(1, T + 1, (B, 1), generator=g)
    mask = (torch.arange(T) < lengths).long()
    if empty_rank is not None:
        mask[empty_rank * B_PER_RANK : (empty_rank + 1) * B_PER_RANK] = 0
    x = {
        "hidden": torch.randn(B, T, H, generator=g, dtype=torch.float64),
        "weight": torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7,
        "completion_ids": torch.randint(0, V, (B, T), generator=g),
        "completion_mask": mask,
        "advantages": torch.randn(B, generator=g, dtype=torch.float64),
        "old_per_token_logps": -torch.rand(B, T, generator=g, dtype=torch.float64) * 4,
        "ref_per_token_logps": -torch.rand(B, T, generator=g, dtype=torch.float64) * 4,
    }
    return x


def shard(x: dict, rank: int) -> dict:
    rows = slice(rank * B_PER_RANK, (rank + 1) * B_PER_RANK)
    return {k: (v if k == "weight" else v[rows]) for k, v in x.items()}


def run(fn, x: dict, **kw):
    """loss, outputs and gradients of hidden and weight for a loss callable on inputs x."""
    h = x["hidden"].detach().clone().requires_grad_()
    w = x["weight"].detach().clone().requires_grad_()
    rest = {
        k: v for k, v in x.items() if k not in ("hidden", "weight", "completion_ids", "completion_mask", "advantages")
    }
    out = fn(h, w, x["completion_ids"], x["completion_mask"], x["advantages"], **rest, **kw)
    out.loss.backward()
    return out, h.grad, w.grad


def settings(loss_type: str, q: float) -> dict:
    return {"loss_type": loss_type, "top_entropy_quantile": q, "beta": 0.04, "max_completion_length": T}


def reference_fn(s):
    return lambda *a, **k: reference.grpo_loss(*a, **k, **s)


def close(a, b, what, rtol=1e-9):
    a, b = torch.as_tensor(a).detach().double().cpu(), torch.as_tensor(b).detach().double().cpu()
    if torch.isnan(b).all() and torch.isnan(a).all():
        return
    err = float((a - b).abs().max()) if b.numel() else 0.0
    assert err <= rtol * max(float(b.abs().max()) if b.numel() else 0.0, 1e-12) + 1e-12, f"{what}: {err:.2e}"


def data_parallel_worker(rank, world, seed, empty_rank):
    x = whole_batch(world, seed, empty_rank)
    cases = [(lt, q) for lt in GLOBAL_LOSSES for q in (1.0, 0.5)]
    single = {c: run(reference_fn(settings(*c)), x) for c in cases}  # before any process group exists
    init(rank, world)
    try:
        mine = on_device(shard(x, rank))
        rows = slice(rank * B_PER_RANK, (rank + 1) * B_PER_RANK)
        for loss_type, q in cases:
            out, dh, dw = run(FusedLinearGRPOLoss(compiled=False, **TILES, **settings(loss_type, q)), mine)
            ref, ref_dh, ref_dw = single[(loss_type, q)]
            what = f"rank {rank} {loss_type} q={q}"
            close(dist_mean(out.loss.detach()), ref.loss, f"{what} loss averaged over ranks")
            close(dist_mean(dw), ref_dw, f"{what} weight gradient averaged over ranks")
            close(dh / world, ref_dh[rows], f"{what} hidden gradient")
            if q < 1:
                assert torch.equal(out.entropy_mask.cpu(), ref.entropy_mask[rows]), f"{what} entropy mask"
            for name, value in ref.metrics.items():
                close(out.metrics[name], value, f"{what} metric {name}")
            # the same shard packed (padding-free): the padded call's loss, gradients and metrics
            p_out, p_dh, p_dw = run(FusedLinearGRPOLoss(compiled=False, **TILES, **settings(loss_type, q)), pack(mine))
            close(p_out.loss, out.loss, f"{what} packed loss")
            close(p_dw, dw, f"{what} packed weight gradient")
            close(p_dh, dh[mine["completion_mask"].bool()], f"{what} packed hidden gradient")
            for name, value in out.metrics.items():
                close(p_out.metrics[name], value, f"{what} packed metric {name}")
        # bnpo normalizes per rank: each rank against the reference on its own shard (global threshold)
        for q in (1.0, 0.5):
            s = settings("bnpo", q)
            out, dh, dw = run(FusedLinearGRPOLoss(compiled=False, **TILES, **s), mine)
            ref, ref_dh, ref_dw = run(reference_fn(s), mine)  # the reference gathers the threshold too
            close(out.loss, ref.loss, f"rank {rank} bnpo q={q} loss")
            close(dh, ref_dh, f"rank {rank} bnpo q={q} hidden gradient")
            close(dw, ref_dw, f"rank {rank} bnpo q={q} weight gradient")
            if q < 1:
                expected = single[("dapo", q)][0].entropy_mask[rows]
                assert torch.equal(out.entropy_mask.cpu(), expected), "bnpo entropy mask"
    finally:
        dist.destroy_process_group()


def dist_mean(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


@pytest.mark.parametrize("world, empty_rank", [(2, None), (3, 2)], ids=["2 ranks", "3 ranks, one empty"])
def test_data_parallel_matches_one_process(world, empty_rank):
    spawn(data_parallel_worker, world, 7, empty_rank)


def vocab_parallel_worker(rank, world, seed):
    x = whole_batch(1, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x["bias"] = torch.randn(V, generator=g, dtype=torch.float64)
    s = {**settings("dapo", 0.5), "temperature": 0.8, "final_logit_softcapping": 3.0, "entropy_coef": 0.02}
    ref, ref_dh, ref_dw = run(reference_fn(s), x)
    ref_hidden = x["hidden"] + 0.1
    no_kl = {**s, "beta": 0.0}  # the reference model's log-probs under the same head settings
    streamed = run(reference_fn(no_kl), {**x, "ref_per_token_logps": None, "hidden": ref_hidden})[0].per_token_logps
    with_streamed_ref = run(reference_fn(s), {**x, "ref_per_token_logps": streamed})
    init(rank, world)
    try:
        cut = [0, 19, V]  # unequal slices
        lo, hi = cut[rank], cut[rank + 1]
        x, ref_hidden = on_device(x), ref_hidden.to(device())
        mine = {**x, "weight": x["weight"][lo:hi]}
        loss_fn = FusedLinearGRPOLoss(compiled=False, vocab_parallel_group=dist.group.WORLD, **TILES, **s)
        for expected, extra in ((ref, {}), (with_streamed_ref[0], {"ref_hidden": ref_hidden})):
            inputs = dict(mine)
            if extra:
                inputs.pop("ref_per_token_logps")
            inputs["bias"] = x["bias"][lo:hi].clone().requires_grad_()
            out, dh, dw = run(loss_fn, inputs, vocab_start=lo, **extra)
            close(out.loss, expected.loss, f"rank {rank} vocab-parallel loss")
            close(out.per_token_logps, expected.per_token_logps, "logp")
            close(out.entropy, expected.entropy, "entropy")
            assert torch.equal(out.entropy_mask.cpu(), expected.entropy_mask)
            for name, value in expected.metrics.items():
                close(out.metrics[name], value, f"metric {name}")
            if not extra:
                close(dh, ref_dh, "hidden gradient")
                close(dw, ref_dw[lo:hi], "weight gradient slice")
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_matches_unsharded_head():
    spawn(vocab_parallel_worker, 2, 11)


def vocab_parallel_fp32_head_worker(rank, world, seed):
    """An fp32 head's products from its terms made per vocabulary slice on each rank (the memory schedule), the
    slices' partial statistics merged on the rank and combined across ranks: the unsharded split head's call."""
    from compiled_grpo import products

    products.SPLIT_ON_CPU = True
    x = whole_batch(1, seed)
    x = {k: v.float() if v.is_floating_point() else v for k, v in x.items()}
    x["hidden"] = x["hidden"].bfloat16()
    s = {**settings("dapo", 1.0), "temperature": 0.8}
    expected, expected_dh, expected_dw = run(FusedLinearGRPOLoss(compiled=False, schedule="memory", **TILES, **s), x)
    init(rank, world)
    try:
        cut = [0, 19, V]  # unequal slices, each cut again into vocab_tile slices on its rank
        lo, hi = cut[rank], cut[rank + 1]
        loss_fn = FusedLinearGRPOLoss(compiled=False, schedule="memory", vocab_parallel_group=dist.group.WORLD,
                                      **TILES, **s)  # fmt: skip
        out, dh, dw = run(loss_fn, {**x, "weight": x["weight"][lo:hi]}, vocab_start=lo)
        close(out.loss, expected.loss, f"rank {rank} fp32-head loss", rtol=1e-5)
        close(out.per_token_logps, expected.per_token_logps, "logp", rtol=1e-5)
        close(out.entropy, expected.entropy, "entropy", rtol=1e-5)
        close(dw, expected_dw[lo:hi], "weight gradient slice", rtol=1e-5)
        close(dh, expected_dh, "hidden gradient (bf16)", rtol=2e-2)
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_fp32_head_terms_per_slice():
    spawn(vocab_parallel_fp32_head_worker, 2, 23)


# (schedule asked for, settings, the schedule that runs): the speed and sparse schedules on a vocabulary-parallel
# head, and "auto" choosing among them as on one process
VOCAB_PARALLEL_CASES = [
    ("speed", {"loss_type": "dapo", "entropy_coef": 0.02}, "speed"),
    ("speed", {"loss_type": "luspo", "importance_sampling_level": "sequence"}, "speed"),
    ("speed", {"loss_type": "grpo", "off_policy_mask_threshold": 0.3}, "speed"),
    ("sparse", {"loss_type": "dapo", "top_entropy_quantile": 0.5}, "sparse"),
    ("sparse", {"loss_type": "vespo", "top_entropy_quantile": 0.2, "beta": 0.0}, "sparse"),
    ("auto", {"loss_type": "cispo", "epsilon_high": 5.0}, "speed"),
    ("auto", {"loss_type": "bnpo", "top_entropy_quantile": 0.5}, "sparse"),
]


def vocab_parallel_schedules_worker(rank, world, seed):
    """Each rank holds a slice of the vocabulary (unequal slices); every schedule matches the unsharded head:
    loss, log-probs, entropies, mask, metrics, and the gradients of hidden and of this rank's weight and bias rows
    (half the rows at advantage 0, so the speed schedule's statistics-only tokens are crossed too)."""
    x = whole_batch(1, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x["bias"] = torch.randn(V, generator=g, dtype=torch.float64)
    x["advantages"][1] = 0.0
    x["importance_sampling_ratio"] = torch.rand(B_PER_RANK, T, generator=g, dtype=torch.float64) + 0.5
    head = {"temperature": 0.8, "final_logit_softcapping": 3.0, "max_completion_length": T}
    cases = [(asked, {"beta": 0.04, **head, **s}, ran) for asked, s, ran in VOCAB_PARALLEL_CASES]
    expected = [run_with_bias(reference_fn(s), x) for _, s, _ in cases]  # before any process group exists
    init(rank, world)
    try:
        cut = [0, 15, V]
        lo, hi = cut[rank], cut[rank + 1]
        x = on_device(x)
        mine = {**x, "weight": x["weight"][lo:hi], "bias": x["bias"][lo:hi]}
        for (asked, s, ran), (ref, ref_grads) in zip(cases, expected, strict=True):
            loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=asked, vocab_parallel_group=dist.group.WORLD,
                                          **TILES, **s)  # fmt: skip
            out, grads = run_with_bias(loss_fn, mine, vocab_start=lo)
            what = f"rank {rank} {asked} {s['loss_type']}"
            assert out.schedule == ran, f"{what}: ran {out.schedule}"
            close(out.loss, ref.loss, f"{what} loss")
            close(out.per_token_logps, ref.per_token_logps, f"{what} logp")
            close(out.entropy, ref.entropy, f"{what} entropy")
            if ref.entropy_mask is not None:
                assert torch.equal(out.entropy_mask.cpu(), ref.entropy_mask), f"{what} entropy mask"
            for name, value in ref.metrics.items():
                close(out.metrics[name], value, f"{what} metric {name}")
            close(grads["hidden"], ref_grads["hidden"], f"{what} hidden gradient")
            close(grads["weight"], ref_grads["weight"][lo:hi], f"{what} weight gradient slice")
            close(grads["bias"], ref_grads["bias"][lo:hi], f"{what} bias gradient slice")
            for context in (torch.no_grad, torch.inference_mode):  # without grad mode: the same outputs
                with context():
                    rest = {k: v for k, v in mine.items() if k not in POSITIONAL}
                    plain = loss_fn(*(mine[k] for k in POSITIONAL), vocab_start=lo, **rest)
                close(plain.loss, out.loss, f"{what} loss under {context.__name__}")
                assert torch.equal(plain.per_token_logps, out.per_token_logps), f"{what} logp under {context.__name__}"
    finally:
        dist.destroy_process_group()


def run_with_bias(fn, x: dict, **kw):
    """`run` with the bias as a leaf too: (output, {hidden, weight, bias: gradient})."""
    leaves = {k: x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    rest = {k: v for k, v in x.items() if k not in (*leaves, "completion_ids", "completion_mask", "advantages")}
    out = fn(leaves["hidden"], leaves["weight"], x["completion_ids"], x["completion_mask"], x["advantages"],
             bias=leaves["bias"], **rest, **kw)  # fmt: skip
    out.loss.backward()
    return out, {k: v.grad for k, v in leaves.items()}


def test_vocab_parallel_speed_and_sparse_schedules():
    spawn(vocab_parallel_schedules_worker, 2, 17)


SEQUENCE_PARALLEL_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")


def sequence_parallel_cases(data_parallel: bool):
    """Every loss type at token and sequence level, q = 1 and 0.5 alternating; the off-policy mask with vLLM's
    sampling log-probs on grpo and dapo; the entropy bonus; the schedule each case asks for. With data-parallel
    ranks too, the ones whose data-parallel loss is the whole batch's (bnpo and the bonus normalize per rank)."""
    out = []
    for i, (loss_type, level) in enumerate((lt, lv) for lt in SEQUENCE_PARALLEL_LOSSES for lv in ("token", "sequence")):
        if data_parallel and loss_type == "bnpo":
            continue
        coef = 0.0 if data_parallel else 0.01
        s = {**settings(loss_type, 1.0 if i % 2 else 0.5), "importance_sampling_level": level, "entropy_coef": coef}
        if loss_type == "cispo":
            s["epsilon_high"] = 5.0
        if loss_type in ("grpo", "dapo"):
            s["off_policy_mask_threshold"] = 0.2
        out.append((s, ("auto", "memory", "sparse")[i % 3]))
    return out


def sequence_parallel_worker(rank, world, seed, data_ranks):
    """`world` ranks: `data_ranks` data-parallel groups of `world // data_ranks` sequence-parallel ranks, each
    holding a contiguous, unequal slice of every position of its group's sequences. Against one process on the
    whole batch: the loss on every rank (averaged over the data-parallel ranks), log-probs, entropies, the
    entropy mask and the hidden-state gradient at each rank's positions (over the data-parallel ranks, as DDP
    averages), the metrics, and the weight gradient summed over the sequence-parallel ranks (averaged over the
    data-parallel ones)."""
    sp = world // data_ranks
    x = whole_batch(data_ranks, seed)
    g = torch.Generator().manual_seed(seed + 3)
    noise = torch.randn(x["old_per_token_logps"].shape, generator=g, dtype=torch.float64)
    x["sampling_per_token_logps"] = (x["old_per_token_logps"] + noise * 0.3).clamp(max=0.0)
    x["importance_sampling_ratio"] = torch.rand(x["advantages"].shape[0], T, generator=g, dtype=torch.float64) + 0.5
    cases = sequence_parallel_cases(data_ranks > 1)
    single = [run(reference_fn(s), x) for s, _ in cases]  # before any process group exists
    init(rank, world)
    try:
        d, r = divmod(rank, sp)
        sp_groups = [dist.new_group(list(range(k * sp, (k + 1) * sp))) for k in range(data_ranks)]
        dp_groups = [dist.new_group(list(range(j, world, sp))) for j in range(sp)]
        cuts = [0, 2, 6, T] if sp == 3 else [0, 4, T]
        cols = slice(cuts[r], cuts[r + 1])
        rows = slice(d * B_PER_RANK, (d + 1) * B_PER_RANK)
        mine = {k: (v if k == "weight" else v[rows] if v.dim() == 1 else v[rows, cols]) for k, v in x.items()}
        mine = on_device(mine)
        for (s, schedule), (ref, ref_dh, ref_dw) in zip(cases, single, strict=True):
            groups = {
                "sequence_parallel_group": sp_groups[d],
                "process_group": dp_groups[r] if data_ranks > 1 else None,
            }
            loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, **groups, **TILES, **s)
            out, dh, dw = run(loss_fn, mine)
            what = f"rank {rank} {s['loss_type']} {s['importance_sampling_level']} q={s['top_entropy_quantile']}"
            close(mean_over(out.loss.detach(), dp_groups[r]), ref.loss, f"{what} loss")
            close(out.per_token_logps, ref.per_token_logps[rows, cols], f"{what} logp")
            close(out.entropy, ref.entropy[rows, cols], f"{what} entropy")
            if ref.entropy_mask is not None:
                assert torch.equal(out.entropy_mask.cpu(), ref.entropy_mask[rows, cols]), f"{what} entropy mask"
            for name, value in ref.metrics.items():
                close(out.metrics[name], value, f"{what} metric {name}")
            close(dh / data_ranks, ref_dh[rows, cols], f"{what} hidden gradient")
            close(mean_over(sum_over(dw, sp_groups[d]), dp_groups[r]), ref_dw, f"{what} weight gradient")
            for context in (torch.no_grad, torch.inference_mode):  # without grad mode: the same outputs
                with context():
                    plain = loss_fn(
                        *(mine[k] for k in POSITIONAL), **{k: v for k, v in mine.items() if k not in POSITIONAL}
                    )
                close(plain.loss, out.loss, f"{what} loss under {context.__name__}")
                assert torch.equal(plain.per_token_logps, out.per_token_logps), f"{what} logp under {context.__name__}"
    finally:
        dist.destroy_process_group()


def sum_over(t: torch.Tensor, group) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def mean_over(t: torch.Tensor, group) -> torch.Tensor:
    return sum_over(t, group) / dist.get_world_size(group)


@pytest.mark.parametrize("world, data_ranks", [(3, 1), (4, 2)], ids=["3 sequence ranks", "2 x 2 data x sequence"])
def test_sequence_parallel_matches_one_process(world, data_ranks):
    spawn(sequence_parallel_worker, world, 19, data_ranks)


def primitive_vocab_parallel_worker(rank, world, seed):
    """fused_linear_logprobs with each rank holding an equal slice of the vocabulary (as verl's
    `dist_process_group` has it, through the verl adapter's signature): the unsharded head's log-probs,
    entropies and gradients, per-token temperature and ignored targets included."""
    from compiled_grpo.integrations.verl import linear_cross_entropy

    g = torch.Generator().manual_seed(seed)
    vocab = 2 * 20
    hidden = torch.randn(2, 9, H, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, H, generator=g, dtype=torch.float64) / H**0.5
    targets = torch.randint(0, vocab, (2, 9), generator=g)
    temperature = torch.rand(2, 9, generator=g, dtype=torch.float64) + 0.5
    g_logp, g_entropy = torch.randn(2, 9, generator=g, dtype=torch.float64), torch.randn(2, 9, generator=g)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = reference.fused_linear_logprobs(h, w, targets, temperature=temperature)
    ((ref.logp * g_logp).sum() + (ref.entropy * g_entropy).sum()).backward()
    init(rank, world)
    try:
        lo, hi = rank * vocab // world, (rank + 1) * vocab // world
        mine_h = hidden.to(device()).requires_grad_()
        mine_w = weight[lo:hi].clone().to(device()).requires_grad_()
        logp, entropy = linear_cross_entropy(mine_h, mine_w, targets.to(device()), temperature.to(device()),
                                             "none", dist.group.WORLD, compiled=False)  # fmt: skip
        ((logp * g_logp.flatten().to(device())).sum() + (entropy * g_entropy.flatten().to(device())).sum()).backward()
        close(logp, ref.logp.flatten(), f"rank {rank} vocab-parallel primitive logp")
        close(entropy, ref.entropy.flatten(), "entropy")
        close(mine_h.grad, h.grad, "hidden gradient")
        close(mine_w.grad, w.grad[lo:hi], "weight gradient slice")
    finally:
        dist.destroy_process_group()


def test_vocab_parallel_primitive_matches_unsharded_head():
    spawn(primitive_vocab_parallel_worker, 2, 13)


def dtensor_worker(rank, world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    init(rank, world)
    try:
        mesh = init_device_mesh(device(), (world,))
        x = on_device(shard(whole_batch(world, seed), rank))
        s = settings("dapo", 0.5)
        loss_fn = FusedLinearGRPOLoss(compiled=False, **TILES, **s)
        plain, plain_dh, plain_dw = run(loss_fn, x)
        w = distribute_tensor(x["weight"].clone(), mesh, [Shard(0)]).requires_grad_()
        h = x["hidden"].clone().requires_grad_()
        rest = {k: v for k, v in x.items() if k not in ("hidden", "weight", "completion_ids", "completion_mask",
                                                         "advantages")}  # fmt: skip
        out = loss_fn(h, w, x["completion_ids"], x["completion_mask"], x["advantages"], **rest)
        out.loss.backward()
        close(out.loss, plain.loss, "DTensor loss")
        close(h.grad, plain_dh, "DTensor hidden gradient")
        assert w.grad.placements == w.placements, "gradient in the DTensor's layout"
        rows = w.grad.to_local().shape[0]
        start = rank * ((V + world - 1) // world)  # torch.chunk-style Shard(0) rows
        # each rank's gradient is its own batch's: the shard holds their mean, as FSDP2 reduces its own gradients
        mean_dw = plain_dw.clone()
        dist.all_reduce(mean_dw)
        close(w.grad.to_local(), mean_dw[start : start + rows] / world, "DTensor weight gradient shard, ranks' mean")
    finally:
        dist.destroy_process_group()


def test_fsdp2_dtensor_weight():
    spawn(dtensor_worker, 2, 5)


if __name__ == "__main__":  # the same comparisons over NCCL, one GPU per rank
    import sys

    if "--nccl" in sys.argv:
        os.environ["GRPO_TEST_BACKEND"] = "nccl"
    spawn(data_parallel_worker, 2, 7, None)
    print(f"data parallel, 2 ranks ({backend()}): loss, gradients, entropy mask and metrics match one process")
    spawn(data_parallel_worker, 2, 8, 1)
    print(f"data parallel, 2 ranks, rank 1 without active tokens ({backend()}): matches one process")
    spawn(vocab_parallel_worker, 2, 11)
    print(f"vocabulary parallel, 2 ranks ({backend()}): matches the unsharded lm_head")
    spawn(vocab_parallel_schedules_worker, 2, 17)
    print(f"vocabulary parallel, speed and sparse schedules, 2 ranks ({backend()}): match the unsharded lm_head")
    spawn(dtensor_worker, 2, 5)
    print(f"DTensor (FSDP2) weight, 2 ranks ({backend()}): matches a plain weight, gradient: the ranks' mean")
    spawn(sequence_parallel_worker, 2, 19, 1)
    print(f"sequence parallel, 2 ranks ({backend()}): every loss type and IS level matches the unsplit batch")
