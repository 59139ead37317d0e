"""The stack's CUDA-graph helpers (`stack_graphs`), on the CPU: a call's outputs copied out of the graphs' pool, and
`.grad` buffers made outside it only where a trained parameter has none."""

from __future__ import annotations

import pytest
import torch

from compiled_grpo.integrations.trl import stack_graphs


def test_own_outputs_copies_each_tensor_and_keeps_the_rest():
    hidden, extra = torch.randn(3, 4), torch.randn(2)
    out = stack_graphs.own_outputs((hidden, None, extra))
    assert out[1] is None and all(torch.equal(a, b) for a, b in zip((out[0], out[2]), (hidden, extra), strict=True))
    assert out[0].data_ptr() != hidden.data_ptr() and out[2].data_ptr() != extra.data_ptr()
    alone = stack_graphs.own_outputs(hidden)
    assert torch.equal(alone, hidden) and alone.data_ptr() != hidden.data_ptr()


def test_grads_outside_graphs_fills_only_missing_grads_of_trained_parameters():
    trained, frozen, accumulated = (torch.nn.Parameter(torch.randn(2, 2)) for _ in range(3))
    frozen.requires_grad_(False)
    accumulated.grad = torch.ones(2, 2)
    kept = accumulated.grad
    stack_graphs.grads_outside_graphs([[trained, frozen], [accumulated]])
    assert torch.equal(trained.grad, torch.zeros(2, 2)) and frozen.grad is None and accumulated.grad is kept
    (trained * 3.0).sum().backward()  # autograd adds into the buffer in place
    assert torch.equal(trained.grad, torch.full((2, 2), 3.0))


def test_no_graph_pool_where_no_graph_was_recorded():
    """On a machine that recorded no CUDA graph (the CPU) the pool is empty; the GPU test reads a pool where the stack
    replayed graphs."""
    if torch.cuda.is_available():
        pytest.skip("this process may have recorded graphs on the GPU")
    assert stack_graphs.cuda_graph_pool() == (0, 0)
