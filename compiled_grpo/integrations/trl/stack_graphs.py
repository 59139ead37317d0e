"""What the stack's calls need to be replayed as CUDA graphs (`compile_backbone="stack-graphs"`, chosen by name: a
graph is recorded per shape, which pays where the shapes repeat): Inductor's CUDA-graph trees start a new generation
at every call of a compiled function, unless a forward's backward is pending, and a new generation frees the last
one's outputs (their memory is the graphs' pool, which the next replays overwrite).
On an H100 (torch 2.11, Qwen2.5-1.5B's shapes: 7 calls per forward, 4 micro-batches per optimizer step) a step read
such a freed output in two places, each met here:

- a forward without grad (the first-use checks, rows at advantage 0, old and reference log-probabilities) hands a
  group's output to the next group's call, which frees it before reading it: the stack keeps a copy of its own
  (`own_outputs`, a [tokens, hidden] copy per call);
- where a parameter has no `.grad`, autograd keeps the backward graph's output as its `.grad`, which the next
  micro-batch's forward frees before the next backward adds to it: `.grad` buffers allocated outside the graphs
  before a forward with grad (`grads_outside_graphs`, zeros: the sums stay exact) take the gradients instead.

With both, that step ran (and GPU tests of several calls per forward, a forward without grad and accumulated
micro-batches equal GRPOTrainer's steps), its wall clock 1.01-1.14x the GPU's busy time (docs/performance.md).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from compiled_grpo.capture import pool_segments


def own_outputs(out):
    """A compiled call's outputs with each tensor copied out of the graphs' pool."""
    return pytree.tree_map_only(torch.Tensor, torch.clone, out)


def grads_outside_graphs(parameters: list[list[torch.nn.Parameter]]) -> None:
    """A zero `.grad` for each trained parameter that has none, allocated here, outside the graphs' pool."""
    for layer in parameters:
        for p in layer:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def cuda_graphs_recorded(device_index: int = 0) -> tuple[int, int]:
    """(graphs recorded on the device's CUDA-graph trees, calls Inductor ran without its graphs, for any reason):
    Inductor says why it skips graphs only in its `cudagraphs` log, so a run that should replay reads these."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    pending, recorded = [n for ns in (manager.roots.values() if manager is not None else ()) for n in ns], 0
    while pending:
        recorded += 1
        pending += [child for children in pending.pop().children.values() for child in children]
    return recorded, torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]


def cuda_graph_pool(device_index: int = 0) -> tuple[int, int]:
    """(bytes the allocator's segments of the device's CUDA-graph trees' pool hold, of which no live tensor uses):
    the graphs' memory, which the step's allocated peak counts only while its tensors are alive; (0, 0) where no
    graph was recorded."""
    from torch._inductor import cudagraph_trees

    manager = cudagraph_trees.get_manager(device_index, create_if_none_exists=False)
    if manager is None:
        return 0, 0
    segments = pool_segments(manager.cuda_graphs_thread_pool)
    return sum(s["total_size"] for s in segments), sum(s["total_size"] - s["allocated_size"] for s in segments)
