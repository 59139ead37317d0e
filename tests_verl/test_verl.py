"""verl 0.9.1's fused-kernel forward on compiled_grpo, against verl's own torch backend, on the CPU.

These tests need verl, which pins transformers < 5.11 (the TRL tests need newer): CI runs them in an
environment of their own (`.ci/run`: `python -m pytest tests_verl`). verl's patched forward of a tiny
Qwen2 causal LM, upstream gradients zero on prompt tokens and on a zero-advantage sequence, entropy with and
without a gradient; padded and padding-removed batches, verl's label rolling and `shift_labels`, the triton
backend's forward (whose Triton kernel cannot run on a CPU, so verl's torch backend is the reference for it too),
and a per-token temperature.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from verl.models.transformers.monkey_patch import patch_forward_with_backends

from compiled_grpo.integrations import verl as adapter

V, PROMPT = 97, 5


def tiny_model(seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)  # fmt: skip
    return Qwen2ForCausalLM(config).float()


def batch(seed=1, B=4, T=12):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (B, T), generator=g)
    advantages = torch.randn(B, generator=g)
    advantages[-1] = 0.0  # a group whose rewards tied
    # the policy-loss gradient verl's actor sends back: zero on prompt tokens and on the zero-advantage row
    g_logp = torch.randn(B, T, generator=g) * advantages.unsqueeze(1)
    g_logp[:, : PROMPT - 1] = 0.0
    return input_ids, g_logp


def run(model, backend: str, ours: bool, input_ids, g_logp, entropy_coeff=0.0, **forward):
    """verl's patched forward (`backend`), the actor's use of its outputs, and the gradients."""
    model = copy.deepcopy(model)
    patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend=backend)
    uninstall = adapter.install(compiled=False) if ours else (lambda: None)
    try:
        out = model(input_ids=input_ids, return_dict=True, use_cache=False, **forward)
    finally:
        uninstall()
    loss = (out.log_probs * g_logp.reshape(out.log_probs.shape)).sum()
    if entropy_coeff:
        loss = loss - entropy_coeff * out.entropy.sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return out.log_probs.detach(), out.entropy.detach(), grads


def assert_same(ours, verls, rtol=1e-5):
    (logp, entropy, grads), (ref_logp, ref_entropy, ref_grads) = ours, verls
    torch.testing.assert_close(logp.reshape(ref_logp.shape), ref_logp, rtol=rtol, atol=1e-5)
    torch.testing.assert_close(entropy.reshape(ref_entropy.shape).float(), ref_entropy.float(), rtol=rtol, atol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(autouse=True)
def restore_forward():
    """verl patches the model class's forward: restore it after each test."""
    forward = Qwen2ForCausalLM.forward
    yield
    Qwen2ForCausalLM.forward = forward


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("entropy_coeff", [0.0, 0.01])
def test_padded_batch_matches_verls_torch_backend(backend, entropy_coeff):
    model = tiny_model()
    input_ids, g_logp = batch()
    reference = run(model, "torch", False, input_ids, g_logp, entropy_coeff)
    assert_same(run(model, backend, True, input_ids, g_logp, entropy_coeff), reference)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padding_removed_batch_and_shift_labels(backend):
    """verl's remove-padding layout: one row of every sequence's tokens, position ids restarting per sequence,
    labels rolled by the caller and given as `shift_labels` (as under Ulysses sequence parallelism)."""
    model = tiny_model()
    input_ids, g_logp = batch()
    lengths = [12, 9, 7, 12]
    flat = torch.cat([input_ids[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    g_flat = torch.cat([g_logp[i, :n] for i, n in enumerate(lengths)]).unsqueeze(0)
    shift = torch.roll(flat, shifts=-1, dims=-1)
    forward = {"position_ids": positions, "shift_labels": shift}
    reference = run(model, "torch", False, flat, g_flat, **forward)
    assert_same(run(model, backend, True, flat, g_flat, **forward), reference)


def test_per_token_temperature():
    """A per-sample temperature expanded to its tokens, through the triton backend's forward (verl's own kernels
    take a float only): equal to verl's torch backend run one sequence at a time at its own temperature."""
    model = tiny_model()
    input_ids, g_logp = batch()
    temperatures = torch.tensor([0.7, 1.0, 1.3, 0.9])
    per_token = temperatures.unsqueeze(1).expand_as(input_ids)
    logp, entropy, _ = run(model, "triton", True, input_ids, g_logp, temperature=per_token)
    logp, entropy = logp.reshape(input_ids.shape), entropy.reshape(input_ids.shape)  # the triton path's are flat
    for i, t in enumerate(temperatures.tolist()):
        ref = run(model, "torch", False, input_ids[i : i + 1], g_logp[i : i + 1], temperature=t)
        torch.testing.assert_close(logp[i], ref[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(entropy[i], ref[1][0].float(), rtol=1e-5, atol=1e-5)


def test_zero_gradient_positions_are_skipped(monkeypatch):
    """The backward recomputes logits only at positions with a non-zero upstream gradient: here the completion
    tokens of the three sequences with a non-zero advantage."""
    from compiled_grpo.schedules import sparse_gradients

    counts = []
    original = sparse_gradients.gradients_of_rows

    def counted(e, x, h, selected, *rest):
        counts.append(selected.numel())
        return original(e, x, h, selected, *rest)

    monkeypatch.setattr(sparse_gradients, "gradients_of_rows", counted)
    input_ids, g_logp = batch()
    run(tiny_model(), "triton", True, input_ids, g_logp)
    assert counts == [int((g_logp != 0).sum())] == [3 * (12 - (PROMPT - 1))]  # 24 of the 48 positions


def test_install_restores_verls_kernels():
    import verl.utils.experimental.torch_functional as torch_backend
    import verl.utils.kernel.linear_cross_entropy as triton_backend

    before = (triton_backend.linear_cross_entropy, torch_backend.FusedLinearForPPO)
    with adapter.compiled_grpo_kernels(compiled=False):
        assert torch_backend.FusedLinearForPPO is adapter.EagerFusedLinearForPPO
    assert (triton_backend.linear_cross_entropy, torch_backend.FusedLinearForPPO) == before


@pytest.mark.parametrize("module", ["dense_common", "qwen2_vl", "qwen3_vl", "glm4v", "qwen3_5"])
def test_every_fused_forward_looks_up_the_names_install_replaces(module):
    """The VL models' fused forwards (not run here: they need their vision towers) reach the kernels the same
    way as the dense one: each imports `linear_cross_entropy` and `FusedLinearForPPO` from the modules `install`
    patches, at call time, so the patch reaches them."""
    import importlib
    import inspect

    source = inspect.getsource(importlib.import_module(f"verl.models.transformers.{module}"))
    lookups = {
        "forward_with_triton_backend": "from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy",
        "forward_with_torch_backend": "from verl.utils.experimental.torch_functional import FusedLinearForPPO",
    }
    for name, lookup in lookups.items():
        body = source.split(f"def {name}(")[1].split("\ndef ")[0]
        assert lookup in body, f"{module}.{name} does not import its kernel at call time"
