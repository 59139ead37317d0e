"""Captured calls, as far as a CPU can check them: a stand-in for the CUDA graph that replays the captured work
on its static inputs, so that what a graph would read (the static copies of the call's tensors, rebuilt into
the objective, head and plan) and what it returns (copies out of its static outputs) are checked against the
uncaptured call and the float64 reference. The graph itself runs in tests/test_cuda.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from cases import TILES, assert_matches, make_inputs, run_reference

from compiled_grpo import FusedLinearGRPOLoss, capture, capture_outputs
from compiled_grpo.schedules import captured_call, passes


class NoHostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Fails on what a CUDA graph cannot capture: a read of a value back to the host, or a tensor made from host
    data (a host-to-device copy on a GPU)."""

    FORBIDDEN = ("aten._local_scalar_dense", "aten.nonzero", "aten.lift_fresh", "aten.masked_select", "aten.unique")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        assert not name.startswith(self.FORBIDDEN), f"{name} inside a captured call"
        return func(*args, **(kwargs or {}))


class ReplayOnTheStaticInputs(capture.Captures):
    """Captures whose 'graph' re-runs the work on the static inputs and writes the static outputs in place; what
    it records must not read the device back nor copy from the host (`NoHostReads`)."""

    any_device = True

    def _capture(self, key, work, tensors):
        static = self.static_inputs(tensors)
        outputs = capture.StaticOutputs.of(self._recorded(work, static))
        captures = self

        class Graph:
            @staticmethod
            def replay():  # a graph writes where it was captured writing: the shared outputs too
                fresh = capture.StaticOutputs.of(captures._recorded(work, static))
                for out, new in zip(outputs.tensors(), fresh.tensors(), strict=True):
                    out.copy_(new)

        entry = self._keep(key, capture.Graph(Graph, static, outputs))
        self._measure_pool()
        return entry

    def _recorded(self, work, static):
        with self.recording(), NoHostReads():
            return work(*static)

    def pool_reserved(self) -> int:  # what the static outputs would hold, each storage once
        return capture.storage_bytes(t for e in self.graphs.values() for t in e.outputs.tensors())


POSITIONAL = ("hidden", "weight", "completion_ids", "completion_mask", "advantages")


class Model:
    """One lm_head across calls, as in training (a graph reads the weight in place); fresh hidden states."""

    def __init__(self, x):
        self.weight = x["weight"].clone().requires_grad_()
        self.bias = x["bias"].clone().requires_grad_() if "bias" in x else None

    def call(self, loss_fn, x, **extra):
        with torch.no_grad():
            self.weight.copy_(x["weight"])
            if self.bias is not None:
                self.bias.copy_(x["bias"])
        self.weight.grad = None
        if self.bias is not None:
            self.bias.grad = None
        hidden = x["hidden"].clone().requires_grad_()
        rest = {k: v for k, v in x.items() if k not in (*POSITIONAL, "bias")}
        out = loss_fn(hidden, self.weight, x["completion_ids"], x["completion_mask"], x["advantages"], bias=self.bias,
                      **rest, **extra)  # fmt: skip
        out.loss.backward()
        grads = {"hidden": hidden.grad, "weight": self.weight.grad.clone()}
        if self.bias is not None:
            grads["bias"] = self.bias.grad.clone()
        return out, grads


def pytree_leaves(tree):
    from torch.utils import _pytree as pytree

    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def captured_and_plain(schedule, settings):
    """A captured loss (the stand-in graph) and one whose captured work runs directly, on the same bucketed layout."""
    captured = FusedLinearGRPOLoss(compiled=False, schedule=schedule, capture=True, **TILES, **settings)
    captured.captures = ReplayOnTheStaticInputs()
    plain = FusedLinearGRPOLoss(compiled=False, schedule=schedule, capture=True, **TILES, **settings)
    plain.captures = ReplayOnTheStaticInputs()
    plain.captures.run = lambda key, work, tensors: work(*tensors)
    return captured, plain


SETTINGS = [
    {"loss_type": "dapo", "beta": 0.04, "entropy_coef": 0.01},
    {"loss_type": "grpo", "importance_sampling_level": "sequence", "delta": 1.5},
    {"loss_type": "vespo"},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: s["loss_type"])
def test_replays_match_the_reference_across_batches(settings, monkeypatch):
    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule="speed", capture=True, **TILES, **settings)
    loss_fn.captures = ReplayOnTheStaticInputs()
    inputs = {"bias": True, "ref": True, "is_shape": "BT", "sampling": True, "zero_advantage_rows": 1}
    # the same shape four times with new values (run, capture, replay, replay), then a new shape
    model = Model(make_inputs(seed=30, **inputs))
    for seed, (B, T) in enumerate([(3, 37)] * 4 + [(4, 29)]):
        x = make_inputs(seed=30 + seed, B=B, T=T, dtype=torch.float64, **inputs)
        if seed < 4:  # the same mask: the same plan, new values
            x["completion_mask"] = make_inputs(seed=30, B=B, T=T, **inputs)["completion_mask"]
        out, grads = model.call(loss_fn, x, num_items_in_batch=50 + seed)
        ref, ref_grads = run_reference(x, settings, num_items_in_batch=50 + seed)
        assert_matches(out, grads, ref, ref_grads, rtol=1e-9)
    assert loss_fn.captures.replays >= 2


def test_replays_equal_the_uncaptured_call_with_the_same_plan(monkeypatch):
    """Bitwise: the captured work is the uncaptured call's, on the same bucketed plan."""
    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    settings = {"loss_type": "dapo", "entropy_coef": 0.01}
    captured = FusedLinearGRPOLoss(compiled=False, schedule="speed", capture=True, **TILES, **settings)
    captured.captures = ReplayOnTheStaticInputs()
    plain = FusedLinearGRPOLoss(compiled=False, schedule="speed", capture=True, **TILES, **settings)
    plain.captures = ReplayOnTheStaticInputs(limit=0)  # buckets like the captured one, never replays
    plain.captures.run = lambda key, work, tensors: work(*tensors)
    model = Model(make_inputs(seed=40, dtype=torch.float32, bias=True))
    mask = make_inputs(seed=40)["completion_mask"]
    for seed in range(3):
        x = {**make_inputs(seed=40 + seed, dtype=torch.float32, bias=True), "completion_mask": mask}
        a, a_grads = model.call(captured, x)
        b, b_grads = model.call(plain, x)
        assert torch.equal(a.loss, b.loss) and torch.equal(a.per_token_logps, b.per_token_logps)
        for k in a_grads:
            assert torch.equal(a_grads[k], b_grads[k]), k
    assert captured.captures.replays_of["speed"] == 2  # calls 2 and 3 (the first runs uncaptured)


def test_a_result_stays_valid_after_later_calls(monkeypatch):
    """Outputs are copies: two losses made before either backward get their own gradients."""
    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule="speed", capture=True, **TILES)
    loss_fn.captures = ReplayOnTheStaticInputs()
    mask = make_inputs(seed=50)["completion_mask"]
    xs = [{**make_inputs(seed=50 + i, dtype=torch.float64), "completion_mask": mask} for i in range(4)]
    model = Model(xs[0])
    model.call(loss_fn, xs[0]), model.call(loss_fn, xs[1])  # run, then capture
    hiddens = [x["hidden"].clone().requires_grad_() for x in xs[2:]]
    old = [x["old_per_token_logps"] for x in xs[2:]]
    outs = [loss_fn(h, model.weight, x["completion_ids"], mask, x["advantages"], old_per_token_logps=o)
            for x, h, o in zip(xs[2:], hiddens, old, strict=True)]  # fmt: skip
    (outs[0].loss + outs[1].loss).backward()
    assert loss_fn.captures.replays >= 2
    for x, h in zip(xs[2:], hiddens, strict=True):
        ref, ref_grads = run_reference({**x, "weight": xs[1]["weight"]}, {})
        torch.testing.assert_close(h.grad, ref_grads["hidden"], rtol=1e-9, atol=1e-12)


def test_a_failed_capture_is_said_once_and_runs_uncaptured():
    captures = capture.Captures()
    captures._capture = lambda key, work, tensors: captures._failed(key, RuntimeError("a host read"))
    t = torch.ones(3)
    with pytest.warns(capture.CaptureNotice, match="a host read"):
        for _ in range(3):
            assert torch.equal(captures.run("k", lambda a: a * 2, [t]), t * 2)
    assert captures.replays == 0


def test_completion_lengths_share_a_graph(monkeypatch):
    """Lengths 37, 45 and 60 run as length 128 (and active counts as one slot bucket): one graph, replayed; the
    per-position outputs and dX come back at each call's own length."""
    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 256)
    settings = {"loss_type": "grpo", "entropy_coef": 0.01, "delta": 1.5}
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule="speed", capture=True, **TILES, **settings)
    loss_fn.captures = ReplayOnTheStaticInputs()
    inputs = {"bias": True, "adv_shape": "BT", "is_shape": "BT", "sampling": True}
    model = Model(make_inputs(seed=60, **inputs))
    for seed, T in enumerate((37, 45, 60, 37)):
        x = make_inputs(seed=60 + seed, T=T, **inputs)
        out, grads = model.call(loss_fn, x)
        ref, ref_grads = run_reference(x, settings)
        assert out.per_token_logps.shape == (3, T) and grads["hidden"].shape == x["hidden"].shape
        assert_matches(out, grads, ref, ref_grads, rtol=1e-9)
    assert graph_names(loss_fn.captures).count("speed") == 1 and loss_fn.captures.replays_of["speed"] == 3


@pytest.mark.parametrize("settings", [*SETTINGS, {"loss_type": "sapo", "off_policy_mask_threshold": 0.5}],
                         ids=lambda s: s["loss_type"])  # fmt: skip
def test_the_captured_work_reads_nothing_back(settings, monkeypatch):
    """What the graph records (the eager tile functions standing in for the compiled ones) never reads the device
    back nor copies from the host."""
    from compiled_grpo.schedules import speed

    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule="speed", capture=True, **TILES, **settings)
    loss_fn.captures = ReplayOnTheStaticInputs()
    work = speed.gradient_work

    def checked(*args, **kwargs):
        with NoHostReads():
            return work(*args, **kwargs)

    monkeypatch.setattr(speed, "gradient_work", checked)
    x = make_inputs(seed=80, bias=True, ref=True, is_shape="BT", sampling=True, zero_advantage_rows=1)
    model = Model(x)
    for _ in range(3):
        model.call(loss_fn, x, num_items_in_batch=77)
    assert loss_fn.captures.replays_of["speed"] == 2


def test_capture_on_a_cpu_runs_as_without_it():
    """capture=True applies to CUDA tensors only: on a CPU the call, its plan and its bits are capture=False's."""
    x = make_inputs(seed=90, dtype=torch.float32, bias=True)
    outs = []
    for capture_on in (True, False):
        loss_fn = FusedLinearGRPOLoss(compiled=False, schedule="speed", capture=capture_on, **TILES)
        outs.append(Model(x).call(loss_fn, x))
        if capture_on:
            assert loss_fn.captures.replays == 0 and not loss_fn.captures.seen
    (a, a_grads), (b, b_grads) = outs
    assert torch.equal(a.loss, b.loss) and all(torch.equal(a_grads[k], b_grads[k]) for k in b_grads)


@pytest.mark.parametrize(
    "schedule, settings",
    [
        ("memory", {"loss_type": "dapo", "top_entropy_quantile": 0.5, "entropy_coef": 0.01}),
        ("memory", {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04}),
        ("sparse", {"loss_type": "dapo", "top_entropy_quantile": 0.2}),
        ("sparse", {"loss_type": "bnpo", "top_entropy_quantile": 0.5, "entropy_coef": 0.01}),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_memory_and_sparse_passes_replayed(schedule, settings, dtype, monkeypatch):
    """The statistics pass and the gradient pass (vocabulary-outer; token-outer over the selected rows) of the
    memory and sparse schedules as replays: the reference's values in float64, and bitwise the uncaptured
    call's in bf16 (same bucketed plan)."""
    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    captured, plain = captured_and_plain(schedule, settings)
    inputs = {"bias": True, "ref": True, "zero_advantage_rows": 1}
    mask = make_inputs(seed=100, **inputs)["completion_mask"]
    model = Model(make_inputs(seed=100, dtype=dtype, **inputs))
    for seed in range(4):
        x = {**make_inputs(seed=100 + seed, dtype=dtype, **inputs), "completion_mask": mask}
        out, grads = model.call(captured, x)
        if dtype == torch.float64:
            ref, ref_grads = run_reference(x, settings)
            assert_matches(out, grads, ref, ref_grads, rtol=1e-9)
        else:
            same, same_grads = model.call(plain, x)
            assert torch.equal(out.loss, same.loss) and torch.equal(out.entropy, same.entropy)
            assert all(torch.equal(grads[k], same_grads[k]) for k in grads)
    # per call, the statistics pass and the gradient pass: from the third call on, both replay
    assert captured.captures.replays >= 4


def test_primitive_passes_replayed(monkeypatch):
    """fused_linear_logprobs(capture=True): per-token temperature, zero-gradient rows, both passes replayed."""
    import reference
    from compiled_grpo import fused_linear_logprobs, logprobs

    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    monkeypatch.setattr(logprobs, "PRIMITIVE_CAPTURES", ReplayOnTheStaticInputs())
    g = torch.Generator().manual_seed(110)
    B, T, H, V = 3, 37, 16, 1021
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[:, 30:] = -100
    for _ in range(4):
        hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).requires_grad_()
        temperature = torch.rand(B, 1, generator=g, dtype=torch.float64) + 0.5
        g_logp = torch.randn(B, T, generator=g, dtype=torch.float64) * (torch.rand(B, T, generator=g) < 0.5)
        weight.grad = None
        out = fused_linear_logprobs(
            hidden,
            weight,
            targets,
            temperature=temperature,
            compiled=False,
            capture=True,
            **{k: TILES[k] for k in ("token_tile", "tail_tile", "vocab_tile", "sparse_tile")},
        )
        ((out.logp * g_logp).sum() + out.entropy.sum() * 0.1).backward()
        h, w = hidden.detach().requires_grad_(), weight.detach().clone().requires_grad_()
        ref = reference.fused_linear_logprobs(h, w, targets, temperature=temperature)
        ((ref.logp * g_logp).sum() + ref.entropy.sum() * 0.1).backward()
        torch.testing.assert_close(out.logp, ref.logp, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(hidden.grad, h.grad, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(weight.grad, w.grad, rtol=1e-9, atol=1e-12)
    assert logprobs.PRIMITIVE_CAPTURES.replays >= 4


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode], ids=["no_grad", "inference_mode"])
@pytest.mark.parametrize("schedule", ["speed", "memory", "sparse"])
def test_captured_calls_without_grad_mode(schedule, context, monkeypatch):
    """Old and reference log-probs from a captured loss: bitwise the grad-mode call's (the statistics pass is the
    same replayed work), call after call."""
    from compiled_grpo import fused_linear_logprobs, logprobs

    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    monkeypatch.setattr(logprobs, "PRIMITIVE_CAPTURES", ReplayOnTheStaticInputs())
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, capture=True, **TILES, loss_type="dapo")
    loss_fn.captures = ReplayOnTheStaticInputs()
    mask = make_inputs(seed=120)["completion_mask"]
    model = Model(make_inputs(seed=120, dtype=torch.float32))
    for seed in range(3):
        x = {**make_inputs(seed=120 + seed, dtype=torch.float32), "completion_mask": mask}
        grad_mode, _ = model.call(loss_fn, x)
        with context():
            out = loss_fn(x["hidden"], model.weight, x["completion_ids"], mask, x["advantages"],
                          old_per_token_logps=x["old_per_token_logps"])  # fmt: skip
            primitive = fused_linear_logprobs(
                x["hidden"],
                model.weight,
                x["completion_ids"],
                compiled=False,
                capture=True,
                **{k: TILES[k] for k in ("token_tile", "tail_tile")},
            )
        assert torch.equal(out.per_token_logps, grad_mode.per_token_logps)
        assert torch.equal(out.entropy, grad_mode.entropy)
        active = mask.bool()
        torch.testing.assert_close(primitive.logp[active], grad_mode.per_token_logps[active], rtol=1e-6, atol=1e-6)


def test_the_work_sees_one_layout_in_every_call():
    """An expanded input (a broadcast gradient, say) and one that requires grad reach the warm-up, the capture and
    the replays with the same strides and requires_grad: compiled tiles guard on both, and a recompile inside a
    capture breaks it (seen on the H200)."""
    seen = []

    def work(t, u):
        seen.append((t.stride(), t.requires_grad, u.requires_grad))
        return t * 2 + u

    captures = ReplayOnTheStaticInputs()
    expanded, leaf = torch.ones(1).expand(6), torch.zeros(6, requires_grad=True)
    for _ in range(3):
        assert torch.equal(captures.run("key", work, [expanded, leaf]), torch.full((6,), 2.0))
    assert len(set(seen)) == 1 and captures.replays == 2


def test_a_pool_past_the_budget_stops_capture():
    """The graphs' pool counts against the workspace budget: past it, the graphs are dropped and the calls run
    uncaptured (said once), with the same values."""
    # one input and one output of 8 float32 values each (the static inputs count too): just too much
    captures = ReplayOnTheStaticInputs(pool_limit=2 * 8 * 4 - 1)
    work = lambda t: t * 3
    with pytest.warns(capture.CaptureNotice, match="memory pool .* exceeds the workspace budget"):
        for i in range(4):
            assert torch.equal(captures.run("key", work, [torch.full((8,), float(i))]), torch.full((8,), 3.0 * i))
    assert captures.stopped and not captures.graphs
    roomy = ReplayOnTheStaticInputs(pool_limit=2 * 8 * 4)
    for i in range(3):
        roomy.run("key", work, [torch.full((8,), float(i))])
    assert roomy.replays == 2 and roomy.pool_bytes == 64


def test_graphs_share_their_static_inputs():
    """Every graph's static input at one position views one storage per dtype (graphs never run at the same
    time): a smaller layout after a larger one adds no storage, each replay still reads its own values; a larger
    one gets a new storage, and the old one goes when the graphs that view it are dropped."""
    captures = ReplayOnTheStaticInputs(limit=2)
    work = lambda t, ids: t * 2 + ids
    call = lambda n, v: captures.run(("key", n), work, [torch.full((n,), float(v)), torch.arange(n)])
    for v in range(3):  # 8 then 4 entries, taking turns: captured once each, then replayed
        for n in (8, 4):
            assert torch.equal(call(n, v), 2.0 * v + torch.arange(n))
    storages = lambda: {t.untyped_storage().data_ptr() for e in captures.graphs.values() for t in e.inputs}
    assert captures.replays == 4 and len(storages()) == 2  # one per position, both layouts in them
    assert captures.inputs_reserved() == 8 * 4 + 8 * 8
    call(8, 9)  # the 4-entry graph now the least recently used
    for v in range(2):  # 16 entries: a larger storage per position; the 4-entry graph is dropped (limit 2)
        call(16, v)
    assert len(captures.graphs) == 2 and len(storages()) == 4  # the 8-entry graph keeps the old ones
    for v in range(2):
        call(12, v)  # the 8-entry graph is dropped: its storages with it
    assert len(storages()) == 2 and captures.inputs_reserved() == 16 * 4 + 16 * 8
    assert torch.equal(call(16, 7), 14.0 + torch.arange(16)) and torch.equal(call(12, 3), 6.0 + torch.arange(12))


@pytest.mark.parametrize("schedule", ["memory", "sparse", "speed"])
def test_layouts_share_one_weight_gradient(schedule, monkeypatch):
    """Two completion lengths taking turns: each length's gradient pass is its own graph, and every one writes dW
    into one shared buffer, counted once in the pool; each call's gradients are still its own (the reference's)."""
    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    monkeypatch.setattr(capture_outputs, "PACKED_NUMEL", 256)  # dW (of this small lm_head) as a large output
    settings = {"loss_type": "dapo", "entropy_coef": 0.01}
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule=schedule, capture=True, **TILES, **settings)
    loss_fn.captures = ReplayOnTheStaticInputs()
    inputs = {"bias": True, "zero_advantage_rows": 1}
    masks = {T: make_inputs(seed=150 + T, T=T, **inputs)["completion_mask"] for T in (37, 150)}
    model = Model(make_inputs(seed=150, **inputs))
    for seed in range(8):
        T = (37, 150)[seed % 2]
        x = {**make_inputs(seed=150 + seed, T=T, **inputs), "completion_mask": masks[T]}
        out, grads = model.call(loss_fn, x)
        ref, ref_grads = run_reference(x, settings)
        assert_matches(out, grads, ref, ref_grads, rtol=1e-9)
    captures = loss_fn.captures
    weight_sized = lambda e: [t for t in e.outputs.tensors() if t.shape == model.weight.shape]
    writers = [e for e in captures.graphs.values() if weight_sized(e)]
    shared = [v for k, v in captures.storages.items() if k[0] == ("output", "weight gradient")]
    assert len(writers) == 2 and len(shared) == 1
    assert all(weight_sized(e)[0].data_ptr() == shared[0].data_ptr() for e in writers)
    assert not any(t is model.weight.grad for e in writers for t in weight_sized(e))  # the grad is a copy


def test_the_primitives_graph_pool_has_the_losss_default_budget():
    """The primitive's process-wide captures stop (and release their pool) past the loss's default workspace."""
    import inspect

    from compiled_grpo import FusedLinearGRPOLoss, logprobs

    default = inspect.signature(FusedLinearGRPOLoss).parameters["logits_budget_bytes"].default
    assert logprobs.PRIMITIVE_CAPTURES.pool_limit == default == 6 << 30


def test_primitive_captures_is_the_set_the_primitive_uses_and_reset_starts_afresh(monkeypatch):
    """`compiled_grpo.primitive_captures()` is the set `fused_linear_logprobs(capture=True)` replays from; after
    `reset=True` a call captures into the new, empty set at the default budget."""
    import compiled_grpo
    from compiled_grpo import logprobs

    monkeypatch.setattr(logprobs, "PRIMITIVE_CAPTURES", ReplayOnTheStaticInputs())
    before = compiled_grpo.primitive_captures()
    assert before is logprobs.PRIMITIVE_CAPTURES
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 8, 16, generator=g), torch.randn(40, 16, generator=g)
    targets = torch.randint(0, 40, (2, 8), generator=g)
    for _ in range(3):
        compiled_grpo.fused_linear_logprobs(hidden, weight, targets, compiled=False, capture=True)
    assert before.replays >= 1
    fresh = compiled_grpo.primitive_captures(reset=True)
    assert fresh is not before and fresh is logprobs.PRIMITIVE_CAPTURES
    assert fresh.replays == 0 and not fresh.graphs and fresh.pool_limit == 6 << 30


def graph_names(captures) -> list:
    """The name of each kept graph ("whole forward", "statistics", ...)."""
    return sorted(capture.key_name(k) for k in captures.graphs)


WHOLE_FORWARD_SETTINGS = [
    ("memory", {"loss_type": "dapo", "entropy_coef": 0.01}, {"is_shape": "BT", "sampling": True}),
    ("memory", {"loss_type": "grpo", "importance_sampling_level": "sequence", "beta": 0.04}, {"ref": True}),
    ("memory", {"loss_type": "vespo"}, {"adv_shape": "BT"}),
    ("sparse", {"loss_type": "bnpo"}, {"zero_advantage_rows": 1}),
    ("sparse", {"loss_type": "dapo", "off_policy_mask_threshold": 0.5}, {"zero_advantage_rows": 2}),
    # the entropy threshold taken inside the graph
    ("sparse", {"loss_type": "dapo", "top_entropy_quantile": 0.5}, {"zero_advantage_rows": 1}),
    ("memory", {"loss_type": "grpo", "top_entropy_quantile": 0.2, "beta": 0.04}, {"ref": True}),
]


@pytest.mark.parametrize("schedule, settings, inputs", WHOLE_FORWARD_SETTINGS, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_the_whole_forward_is_one_replay(schedule, settings, inputs, dtype, monkeypatch):
    """A captured memory or sparse call's forward (gather, statistics, the entropy threshold, objective and its
    gradients, metrics) is one graph and its backward the schedule's gradient pass: the reference's values in
    float64, bitwise the same work run uncaptured in bf16, and two replays per call once captured."""
    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    captured, plain = captured_and_plain(schedule, settings)
    inputs = {"bias": True, **inputs}
    mask = make_inputs(seed=130, **inputs)["completion_mask"]
    model = Model(make_inputs(seed=130, dtype=dtype, **inputs))
    for seed in range(4):
        x = {**make_inputs(seed=130 + seed, dtype=dtype, **inputs), "completion_mask": mask}
        out, grads = model.call(captured, x, num_items_in_batch=60 + seed)
        if dtype == torch.float64:
            ref, ref_grads = run_reference(x, settings, num_items_in_batch=60 + seed)
            assert_matches(out, grads, ref, ref_grads, rtol=1e-9)
        else:
            same, same_grads = model.call(plain, x, num_items_in_batch=60 + seed)
            assert torch.equal(out.loss, same.loss) and torch.equal(out.per_token_logps, same.per_token_logps)
            assert (out.entropy_mask is None) == (same.entropy_mask is None) == ("top_entropy_quantile" not in settings)
            assert out.entropy_mask is None or torch.equal(out.entropy_mask, same.entropy_mask)
            assert all(torch.equal(out.metrics[k], same.metrics[k]) for k in same.metrics)
            assert all(torch.equal(grads[k], same_grads[k]) for k in grads)
    assert "whole forward" in graph_names(captured.captures)
    assert "statistics" not in graph_names(captured.captures)
    # the forward (and memory's gradient pass) in calls 2 to 4; the sparse rows' pass replays where its rows recur
    assert captured.captures.replays_of["whole forward"] == 3
    if schedule == "memory":
        assert captured.captures.replays_of["vocabulary-outer gradients"] == 3


def test_whole_forward_lengths_share_a_graph(monkeypatch):
    """Completion lengths 37, 45 and 60 run the whole forward as length 128: one forward graph, replayed, whose
    per-position outputs and dX come back at each call's length."""
    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 256)
    settings = {"loss_type": "grpo", "entropy_coef": 0.01}
    loss_fn = FusedLinearGRPOLoss(compiled=False, schedule="memory", capture=True, **TILES, **settings)
    loss_fn.captures = ReplayOnTheStaticInputs()
    model = Model(make_inputs(seed=140, bias=True))
    for seed, T in enumerate((37, 45, 60, 37)):
        x = make_inputs(seed=140 + seed, T=T, bias=True)
        out, grads = model.call(loss_fn, x)
        ref, ref_grads = run_reference(x, settings)
        assert out.per_token_logps.shape == (3, T) and grads["hidden"].shape == x["hidden"].shape
        assert_matches(out, grads, ref, ref_grads, rtol=1e-9)
    assert graph_names(loss_fn.captures).count("whole forward") == 1


def test_outputs_share_a_buffer_per_dtype():
    """A graph's small outputs come out of one copy per dtype; large ones, each on its own."""
    small = [torch.arange(3.0), torch.tensor(2.0), torch.ones(2, 2)]
    large = torch.zeros(capture_outputs.PACKED_NUMEL + 1)
    outputs = capture.StaticOutputs.of({"a": small[0], "b": (small[1], None, 7), "c": small[2], "d": large,
                                        "e": torch.tensor([1, 2])})  # fmt: skip
    assert [b.numel() for b in outputs.buffers] == [3 + 1 + 4, 2]
    got = outputs.copied()
    assert torch.equal(got["a"], small[0]) and torch.equal(got["b"][0], small[1]) and got["b"][1:] == (None, 7)
    assert got["c"].shape == (2, 2) and torch.equal(got["c"], small[2]) and torch.equal(got["e"], torch.tensor([1, 2]))
    assert got["d"] is not large and torch.equal(got["d"], large)
    outputs.buffers[0].fill_(-1)  # a later replay writes the static buffers: earlier results stay as they were
    assert torch.equal(got["a"], small[0])


@pytest.mark.parametrize("context", [contextlib.nullcontext, torch.no_grad, torch.inference_mode],
                         ids=["grad", "no_grad", "inference_mode"])  # fmt: skip
def test_the_work_runs_in_one_mode_in_every_call(context):
    """The warm-up, the capture and the replays run the work with grad mode off and outside inference mode,
    whatever the caller's: a compiled tile guards on grad mode, and a recompile inside a capture breaks it."""
    captures = ReplayOnTheStaticInputs()
    modes = []

    def work(t):
        modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return t * 2

    for _ in range(3):
        with context():
            captures.run("k", work, [torch.ones(3, requires_grad=True)])
    assert modes == [(False, False)] * 4  # warm-up, capture, and the replays re-running the work


def test_checks_are_captured_at_bucket_lengths_only(monkeypatch):
    """The value and statistics checks replay where the completion length is a multiple of the length bucket;
    at other lengths (a graph per length would crowd out the passes' graphs) they run as they are."""
    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    for T, captured in ((37, False), (captured_call.LENGTH_BUCKET, True)):
        loss_fn = FusedLinearGRPOLoss(compiled=False, schedule="memory", capture=True, **TILES)
        loss_fn.captures = ReplayOnTheStaticInputs()
        x = make_inputs(seed=150, T=T, bias=True)
        model = Model(x)
        for _ in range(3):
            out, grads = model.call(loss_fn, x)
        ref, ref_grads = run_reference(x, {})
        assert_matches(out, grads, ref, ref_grads, rtol=1e-9)
        names = graph_names(loss_fn.captures)
        assert ("value checks" in names) == ("statistics checks" in names) == captured, (T, names)


class CompilesCounted(ReplayOnTheStaticInputs):
    """The stand-in graph, counting what torch.compile compiles while the work runs on the static inputs (a compile
    inside a real capture breaks it: Inductor reads values back while it compiles). No `NoHostReads` here: a
    dispatch mode stops torch.compile."""

    def __init__(self):
        super().__init__()
        self.compiled_inside = 0

    def _recorded(self, work, static):
        from torch._dynamo.utils import counters

        before = counters["frames"]["ok"]
        with self.recording():
            outputs = work(*static)
        self.compiled_inside += counters["frames"]["ok"] - before
        return outputs


@pytest.mark.compiled
@pytest.mark.parametrize("schedule", ["memory", "sparse", "speed"])
def test_captured_work_compiles_nothing_new_across_layouts(schedule, monkeypatch):
    """Two completion lengths taking turns, the compiled tiles and objective: a graph's work on its static inputs
    (which share storage with the other layout's) hits the graphs compiled by the key's first, uncaptured call.
    Static inputs that were views of the shared storage failed this: torch.compile guarded on the view's base, sized
    by the larger layout, and recompiled inside the capture."""
    monkeypatch.setattr(passes, "CAPTURE_SLOT_BUCKET", 16)
    monkeypatch.setattr(passes, "COMPILE_OBJECTIVE_ON_CPU", True)
    loss_fn = FusedLinearGRPOLoss(compiled=True, schedule=schedule, capture=True, loss_type="dapo", **TILES)
    loss_fn.captures = CompilesCounted()
    inputs = {"zero_advantage_rows": 1}  # rows the sparse pass skips
    masks = {T: make_inputs(seed=170 + T, T=T, **inputs)["completion_mask"] for T in (37, 150)}
    model = Model(make_inputs(seed=170, **inputs))
    for seed in range(6):
        T = (150, 37)[seed % 2]
        x = {**make_inputs(seed=170 + seed, T=T, **inputs), "completion_mask": masks[T]}
        out, grads = model.call(loss_fn, x, num_items_in_batch=40 + seed)
        ref, ref_grads = run_reference(x, {"loss_type": "dapo"}, num_items_in_batch=40 + seed)
        assert_matches(out, grads, ref, ref_grads, rtol=2e-5)
    assert loss_fn.captures.replays >= 4
    assert loss_fn.captures.compiled_inside == 0
