"""The tile functions of `streaming`, under torch.compile or eager: the same code either way."""

from __future__ import annotations

import functools
import os
import sys
import warnings

import torch

from . import streaming

# Graphs each tile function may keep: one per tile shape (bulk, tail, stats rows, vocabulary slices), dtype and
# head (bias, softcap, rounding) in use in a process. Dynamo's default of 8 is reached by ordinary use (training
# and evaluation shapes, two dtypes), and under fullgraph=True reaching it is an error, not a fallback: a process
# that meets several vocabularies and hidden sizes (an evaluation harness, a test suite) keeps ~10 graphs per
# (vocabulary, dtype, head), so 64 was reached on a GPU by one pytest process.
RECOMPILE_LIMIT = 256


class CompilingNotice(UserWarning):
    """Given once per process, at the first call of a compiled tile function: torch.compile is compiling, which
    takes a while (silence it with `warnings.filterwarnings("ignore", category=CompilingNotice)`)."""


_compiling_noticed = False


def notice_compiling() -> None:
    global _compiling_noticed
    if not _compiling_noticed:
        _compiling_noticed = True
        warnings.warn(
            "compiled_grpo: the first compiled call compiles its tile kernels with torch.compile (10-30 s on a "
            "2-core CPU, less on a GPU host; new shapes compile a few more; Inductor's cache shortens later runs)",
            CompilingNotice,
            stacklevel=frames_to_caller(),
        )


# Frames a warning skips to reach the user's line: this package's, and torch's (a call through an autograd Function
# runs this package's forward from torch/autograd/function.py, which would otherwise be named); and those of the
# frameworks that call it on the user's behalf where they are loaded (a `trainer.train()` reaches the loss through
# transformers', accelerate's and TRL's trainers).
SKIPPED_PACKAGES = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                         for m in (sys.modules[__package__], torch))  # fmt: skip
CALLING_FRAMEWORKS = ("trl", "transformers", "accelerate", "peft", "deepspeed")


def skipped_packages() -> tuple[str, ...]:
    loaded = (sys.modules.get(name) for name in CALLING_FRAMEWORKS)
    frameworks = (os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in loaded if getattr(m, "__file__", 0))
    return SKIPPED_PACKAGES + tuple(frameworks)


def frames_to_caller() -> int:
    """warnings' stacklevel of the first frame outside this package, torch and the frameworks that call it (the
    user's call), counted from the caller."""
    skipped = skipped_packages()
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skipped):
        frame, level = frame.f_back, level + 1
    return level


def compile_tile(f):
    """`f` under torch.compile(fullgraph=True, dynamic=False), allowed RECOMPILE_LIMIT graphs (raised for the
    call and restored after it, so the process-wide setting is left alone; a plain attribute swap costs 5 us
    where `config.patch` costs 180 us, and a tile loop makes dozens of calls)."""
    compiled = torch.compile(f, fullgraph=True, dynamic=False)
    config = torch._dynamo.config

    @functools.wraps(f)
    def call(*args):
        notice_compiling()
        limit = config.recompile_limit
        config.recompile_limit = max(RECOMPILE_LIMIT, limit)
        try:
            return compiled(*args)
        finally:
            config.recompile_limit = limit

    return call


class Kernels:
    """The tile functions, under `torch.compile(fullgraph=True, dynamic=False)` (`compiled=True`) or eager."""

    def __init__(self, compiled: bool):
        wrap = compile_tile if compiled else (lambda f: f)
        self.compiled = compiled
        self.statistics = wrap(streaming.statistics_tile)
        self.statistics_with_extras = wrap(streaming.statistics_with_extras_tile)
        self.partial_statistics = wrap(streaming.partial_statistics_tile)
        self.statistics_and_product = wrap(streaming.statistics_and_product_tile)
        self.partial_statistics_and_product = wrap(streaming.partial_statistics_and_product_tile)
        self.gradient_from_product = wrap(streaming.gradient_from_product_tile)
        self.gradient_vocab = wrap(streaming.gradient_vocab_tile)
