"""Captured calls: the work of a schedule call after its plan, issued as one CUDA graph replay.

At small hidden sizes a call's GPU work is short and its tile loop issues hundreds of kernels, so the host's
launch rate, not the GPU, sets its time. After planning (the one wait on the GPU), a call's work reads only
tensors whose shapes the plan fixes, with no host read; so it can be recorded once as a CUDA graph and replayed.

`Captures.run(key, work, tensors)`: `key` holds everything the graph bakes in besides the tensors' values (shapes,
dtypes, settings, the tile plan's structure, the address of tensors used in place, such as the lm_head weight). The
first call of a key runs `work` uncaptured (it compiles and warms the kernels); the second captures it; later calls
copy their tensors into the graph's static inputs and replay. Outputs are copied out of the graph's static buffers,
so a result stays valid across later calls; the small ones are written by the graph into one buffer per dtype
(`StaticOutputs`), so that a replay's results come out in a copy or two rather than one per metric. A capture that
fails (work that reads the host, say) is said once, and that key then runs uncaptured; the kept graphs are dropped
with the pool the failed capture left recording, and later captures start a fresh one. Graphs share one memory pool
(they never run at the same time); at most `limit` graphs are kept, the least recently used dropped first. For the
same reason their large buffers share storage: every graph's static input at one position lies on one storage per
dtype, and so does every graph's dX and dW (`Captures.shared`); a run whose batches change layout keeps one copy of
each, not one per graph. The pool keeps each graph's workspace reserved between calls: where it and the static
inputs grow past `pool_limit` bytes (the loss's workspace budget), every graph is dropped and the calls run
uncaptured, said once.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from .capture_outputs import PACKED_NUMEL, Packed, StaticOutputs  # noqa: F401 - StaticOutputs is part of this API

SEEN_LIMIT = 4096  # keys remembered as seen once
# Graphs kept at most. A training run's layouts (completion lengths bucketed to 128, slots to 512) need 30-40 graphs;
# with fewer kept, dropped graphs are captured again (each a wait for the GPU). A kept graph costs little: its
# static inputs and its large outputs share storage with every other graph's, its workspace is the shared pool's.
GRAPH_LIMIT = 64


class CaptureNotice(UserWarning):
    """A call could not be captured as a CUDA graph and ran uncaptured (said once per reason)."""


@dataclass
class Graph:
    graph: object  # torch.cuda.CUDAGraph, or None after a failed capture
    inputs: list  # the static input tensors the graph reads
    outputs: StaticOutputs | None  # the static outputs it writes


class SharedStorages:
    """The storages that every graph's large buffers of one role lie on (graphs never run at the same time, each
    replay's inputs are copied in right before it and its outputs copied out right after it), and the span of a
    capture (`recording`), inside which the work writes its large outputs there (`shared_output`)."""

    def __init__(self):
        self.capturing = False  # a graph is being captured (`shared_output`)
        self.storages: dict = {}  # (role, dtype, device) -> the storage that graphs share (`shared`)

    def shared(self, role, like: torch.Tensor) -> torch.Tensor:
        """A buffer of `like`'s shape and dtype on the one storage of `role` (and dtype, device) that every graph's
        buffer of that role lies on. Sound because graphs never run at the same time, each replay's
        inputs are copied in right before it and its outputs copied out right after it. A larger buffer than the
        storage holds gets a new storage; graphs captured before keep the old one alive until they are dropped."""
        key = (role, like.dtype, like.device)
        storage = self.storages.get(key)
        if storage is None or storage.numel() < like.numel():
            storage = self.storages[key] = torch.empty(like.numel(), dtype=like.dtype, device=like.device)
        # set on the storage, not a view of it: torch.compile guards on a view's base, whose size is the largest
        # layout's, so a compiled tile or objective would recompile inside a capture (which breaks it)
        return torch.empty(0, dtype=like.dtype, device=like.device).set_(storage.untyped_storage(), 0, like.shape)

    def shared_output(self, like: torch.Tensor, role: str) -> torch.Tensor | None:
        """While a graph is being captured, the shared buffer (`shared`) that it writes a large output of `role`
        into (a gradient pass's dW, as large as the lm_head weight; its dX), else None (the work makes its own).
        Each graph's own would stay reserved in the pool, one per token layout; shared, the pool holds one. Made
        while capturing, so in the pool, and kept alive here for every later graph."""
        return self.shared(("output", role), like) if self.capturing else None

    def static_inputs(self, tensors: list) -> list:
        """A graph's static inputs, each a copy of `tensors[i]` in the shared buffer of input position i."""
        return [self.shared(("input", i), t).copy_(t) for i, t in enumerate(tensors)]

    @contextlib.contextmanager
    def recording(self):
        """The span of a capture: the work sees `capturing` (`shared_output`)."""
        self.capturing = True
        try:
            yield
        finally:
            self.capturing = False


class GraphPool(SharedStorages):
    """The kept graphs (at most `limit`, the least recently used dropped first) and the memory they hold: the
    shared pool their workspaces lie in and their static inputs' storages, measured after each capture against
    `pool_limit`, past which every graph is dropped and capture stops (said once)."""

    def __init__(self, limit: int, pool_limit: int | None):
        super().__init__()
        self.limit = limit
        self.pool_limit = pool_limit  # bytes the graphs' memory pool may reserve; past it, capture stops
        self.graphs: OrderedDict = OrderedDict()
        self.pool = None
        self.pool_bytes = 0  # what the pool reserves on the device, measured after each capture
        self.stopped = False
        self.said: set = set()

    def _abandon_pool(self) -> None:
        """After a failed capture, drop the kept graphs (captured again on their next calls) and their pool; the
        next capture makes a fresh one (`release_pool` says why)."""
        old = self.pool
        self._drop_graphs()
        if old is not None:
            release_pool(old)

    def _drop_graphs(self) -> None:
        """Drop every kept graph and the storages they share; the next capture makes a new pool."""
        self.graphs.clear()
        self.storages.clear()
        self.pool = None

    def _measure_pool(self) -> None:
        """The pool's reserved bytes (its segments in the allocator's snapshot) and the static inputs' storages;
        past `pool_limit`, every graph is dropped and later calls run uncaptured (said once): the pool holds each
        graph's workspace for good, so it counts against the same budget as the workspace of an uncaptured call."""
        self.pool_bytes = self.pool_reserved() + self.inputs_reserved()
        if self.pool_limit is not None and self.pool_bytes > self.pool_limit:
            self.say(f"the CUDA graphs' memory pool ({self.pool_bytes / 2**30:.2f} GiB) exceeds the workspace budget "
                     f"({self.pool_limit / 2**30:.2f} GiB); calls run uncaptured")  # fmt: skip
            self._drop_graphs()
            self.stopped = True
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()  # the pool's segments, free once its graphs are gone

    def pool_reserved(self) -> int:
        """Bytes the allocator's segments of the graphs' pool hold (`torch.cuda.memory_snapshot`)."""
        return sum(s["total_size"] for s in pool_segments(self.pool))

    def pool_free(self) -> int:
        """Bytes the graphs' pool reserves without a live tensor in it (their workspaces between replays)."""
        return sum(s["total_size"] - s["allocated_size"] for s in pool_segments(self.pool)) if self.pool else 0

    def inputs_reserved(self) -> int:
        """Bytes of the storages that the kept graphs' static inputs view (outside the pool), each counted once."""
        return storage_bytes(t for entry in self.graphs.values() for t in entry.inputs)

    def _keep(self, key, entry: Graph) -> Graph:
        self.graphs[key] = entry
        while len(self.graphs) > self.limit:
            self.graphs.popitem(last=False)
        return entry

    def say(self, message: str) -> None:
        if message not in self.said:
            self.said.add(message)
            warnings.warn(f"compiled_grpo: {message}", CaptureNotice, stacklevel=3)


class Captures(GraphPool):
    any_device = False  # True in a stand-in that captures nothing (tests on a CPU)

    def __init__(self, limit: int = GRAPH_LIMIT, pool_limit: int | None = None):
        super().__init__(limit, pool_limit)
        self.seen: set = set()
        self.replays = 0  # for tests and benchmarks: how many calls ran as a replay
        self.replays_of: Counter = Counter()  # the same, per graph name (`key_name`)
        self.failures: list[str] = []  # why captures failed (their keys then run uncaptured)

    def applies_to(self, tensor, pool_limit: int | None = None) -> Captures | None:
        """These captures where a call on `tensor` can be captured (a GPU, or the stand-in's any device), else None:
        an engine carries captures only where they apply. `pool_limit` (the caller's workspace budget, which the
        graphs' pool counts against) replaces the current one when given."""
        if pool_limit is not None:
            self.pool_limit = pool_limit
        return self if tensor.is_cuda or self.any_device else None

    def run(self, key, work, tensors: list):
        """work(*tensors) -> a pytree of tensors (None allowed), captured per `key` as described above."""
        # the same tensors for the warm-up, the capture and the replays: compiled tiles guard on their inputs' strides
        # and requires_grad, and a recompile inside a capture breaks it (an expanded gradient whose static copy is
        # dense, hidden states that require grad where their static copy does not); the work never needs autograd
        tensors = [t.detach().contiguous() for t in tensors]
        # and the same mode: static buffers are ordinary tensors whatever the caller's mode (made under
        # inference_mode they could not be written by a later call outside it), and grad mode off throughout (a
        # compiled tile guards on it too)
        with torch.inference_mode(False), torch.no_grad():
            return self._run(key, work, tensors)

    def run_with_absent(self, key, work, tensors):
        """`run` of `work(*tensors)` where some of `tensors` may be None: those stay out of the graph's inputs, and
        the key gets where they are and the present ones' shapes."""
        present = [t for t in tensors if t is not None]
        layout = tuple(t is None for t in tensors)

        def on_static(*static):
            it = iter(static)
            return work(*(None if absent else next(it) for absent in layout))

        return self.run((key, layout, signature(present)), on_static, present)

    def _run(self, key, work, tensors: list):
        if self.stopped:  # the pool outgrew its budget (`_measure_pool`)
            return work(*tensors)
        entry = self.graphs.get(key)
        if entry is None and key not in self.seen:
            if len(self.seen) >= SEEN_LIMIT:  # keys that never recur (a weight at a new address each call)
                self.seen.clear()
            self.seen.add(key)
            return work(*tensors)
        if entry is None:
            entry = self._capture(key, work, tensors)
        if entry.graph is not None and key in self.graphs:  # not dropped with the pool (`_measure_pool`)
            self.graphs.move_to_end(key)
            for static, given in zip(entry.inputs, tensors, strict=True):
                static.copy_(given)
            entry.graph.replay()
            self.replays += 1
            self.replays_of[key_name(key)] += 1
        if entry.graph is None or self.stopped:  # failed, or dropped with the pool just now
            return work(*tensors)
        return entry.outputs.copied()

    def _capture(self, key, work, tensors) -> Graph:
        static = self.static_inputs(tensors)
        graph = torch.cuda.CUDAGraph()
        inside = []  # the error raised inside the capture: the one ending it reports only that capture broke
        caller_stream = torch.cuda.current_stream()
        try:
            torch.cuda.synchronize()
            with self.recording(), torch.cuda.graph(graph, pool=self.pool):
                try:
                    outputs = StaticOutputs.of(work(*static))
                except Exception as error:
                    inside.append(error)
                    raise
        except Exception as error:  # noqa: BLE001 - any failure: run this key uncaptured, say why once
            # torch.cuda.graph leaves its capture stream current where its capture_end raised
            torch.cuda.set_stream(caller_stream)
            torch.cuda.synchronize()
            self._abandon_pool()
            return self._failed(key, inside[0] if inside else error)
        self.pool = graph.pool() if self.pool is None else self.pool
        entry = self._keep(key, Graph(graph, static, outputs))
        self._measure_pool()
        return entry

    def _failed(self, key, error) -> Graph:
        self.failures.append(failure_report(key, error))
        self.say(f"a call could not be captured as a CUDA graph ({type(error).__name__}: {error}); calls like it "
                 f"run uncaptured")  # fmt: skip
        return self._keep(key, Graph(None, [], None))


def storage_bytes(tensors) -> int:
    """Bytes of the storages under `tensors`, each counted once however many of them view it."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def key_name(key) -> str:
    """The name a key starts with ("whole forward", "statistics", "value checks", ...), however deeply it is
    wrapped (`Captures.run_with_absent`, `passes.captured_pass`)."""
    while isinstance(key, tuple) and key:
        key = key[0]
    return key if isinstance(key, str) else repr(key)


def signature(tensors: list) -> tuple:
    """The shapes, dtypes and devices of `tensors`, for a key."""
    return tuple((tuple(t.shape), t.dtype, t.device) for t in tensors)


def pool_segments(pool) -> list[dict]:
    """The allocator's segments of a graphs' memory pool."""
    return [s for s in torch.cuda.memory_snapshot() if tuple(s.get("segment_pool_id", ())) == tuple(pool)]


def release_pool(pool) -> None:
    """Hand a pool back after a failed capture. Where CUDA ended the capture (an operation a capture cannot hold),
    torch's capture_end raises before it hands the pool back to the allocator, and every later capture into that
    pool fails ("already recording to mempool_id"); handing it back by hand (`torch._C._cuda_endAllocateToPool`)
    did not clear that on torch 2.11 (seen on an H200). So the failed capture's hold on the pool is released and
    the next capture makes a pool of its own, whose id no stale recording names. Failures are said once per
    reason, so this happens rarely."""
    device = torch.cuda.current_device()
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):  # each may have happened already: no matter
        hand_back = getattr(torch._C, name, None)
        if hand_back is not None:
            with contextlib.suppress(RuntimeError):
                hand_back(device, pool)
    torch.cuda.empty_cache()  # the old pool's segments, free once nothing holds it


def failure_report(key, error) -> str:
    """Why a capture failed, with the last frames of where (for benchmarks and bug reports)."""
    where = "".join(traceback.format_tb(error.__traceback__)[-3:])
    return f"{key_name(key)}: {type(error).__name__}: {error}\n{where}"
