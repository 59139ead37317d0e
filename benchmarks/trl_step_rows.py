"""The rows `benchmarks.trl_step` can time: each a trainer with its options, and the label its table prints."""

from __future__ import annotations

import contextlib

import torch
from trl import GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer


@contextlib.contextmanager
def trl_head_after_a_wait():
    """TRL's own fused head, its forward starting with a wait of the host for every kernel queued before it (as
    the primitive's plan waits to count the positions with a target)."""
    import trl.trainer.utils as trl_utils

    previous = trl_utils._ChunkedLogProbFunction

    class Waiting(previous):
        @classmethod
        def apply(cls, *args, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            return previous.apply(*args, **kwargs)

    trl_utils._ChunkedLogProbFunction = Waiting
    try:
        yield
    finally:
        trl_utils._ChunkedLogProbFunction = previous


class WaitingGRPOTrainer(GRPOTrainer):
    """GRPOTrainer whose fused head starts with a host wait for the GPU (a diagnostic: what one such wait, which
    CompiledGRPOTrainer's plan makes, costs the step)."""

    def _compute_loss(self, model, inputs):
        with trl_head_after_a_wait():
            return super()._compute_loss(model, inputs)


TRAINERS = {  # name: (trainer, its options)
    "grpo": (GRPOTrainer, None),
    "grpo-wait": (WaitingGRPOTrainer, None),
    "auto": (CompiledGRPOTrainer, {}),  # the trainer's defaults (on a GPU: the grouped stack, as CUDA graphs)
    "uncaptured": (CompiledGRPOTrainer, {"loss_options": {"capture": False}}),
    "memory": (CompiledGRPOTrainer, {"schedule": "memory"}),
    "roomy": (CompiledGRPOTrainer, {"loss_options": {"logits_budget_bytes": 6 << 30}}),  # the library's own budget
    "memory16k": (CompiledGRPOTrainer, {"schedule": "memory", "loss_options": {"vocab_tile": 16384}}),
    # auto with captured calls (each schedule's passes as CUDA graph replays)
    "captured": (CompiledGRPOTrainer, {"loss_options": {"capture": True}}),
    "captured-unvalidated": (CompiledGRPOTrainer, {"loss_options": {"capture": True, "validate": False}}),
    # captured with a statistics pass of 512 (256) rows at a time: half (a quarter of) its [rows, V] float32 workspace
    # in the graphs' pool
    "captured-stats512": (CompiledGRPOTrainer, {"loss_options": {"capture": True, "stats_rows": 512}}),
    "captured-stats256": (CompiledGRPOTrainer, {"loss_options": {"capture": True, "stats_rows": 256}}),
    # and with 4096-entry vocabulary slices in the gradient pass: half its [token_tile, vocab_tile] logits
    "captured-small": (CompiledGRPOTrainer, {"loss_options": {"capture": True, "stats_rows": 256, "vocab_tile": 4096}}),
    # captured on the uncaptured calls' tiles (1024-row statistics, 8192-entry slices): a larger pool, fewer kernels
    "captured-large": (
        CompiledGRPOTrainer,
        {"loss_options": {"capture": True, "stats_rows": 1024, "vocab_tile": 8192}},
    ),  # fmt: skip
    # and with a 128-row statistics pass and 4096-token gradient-pass tiles: half the default captured workspace
    "captured-smaller": (
        CompiledGRPOTrainer,
        {"loss_options": {"capture": True, "stats_rows": 128, "token_tile": 4096}},
    ),  # fmt: skip
    # small speed tiles, which fit the trainer's budget at 0.5B (256) and 1.5B (512)
    "speed256": (CompiledGRPOTrainer, {"schedule": "speed", "loss_options": {"speed_tile": 256, "speed_group": 256}}),
    "speed512": (CompiledGRPOTrainer, {"schedule": "speed", "loss_options": {"speed_tile": 512, "speed_group": 512}}),
    # sequences at advantage 0: no backward, and no forward ("all"); or trained as TRL does (False)
    "skip-all": (CompiledGRPOTrainer, {"skip_zero_advantage": "all"}),
    "skip-backward": (CompiledGRPOTrainer, {"skip_zero_advantage": "backward"}),
    "noskip": (CompiledGRPOTrainer, {"skip_zero_advantage": False}),
    # the default without shared prompts (each completion forwards its prompt again)
    "noshare": (CompiledGRPOTrainer, {"share_prompts": False}),
    # real tokens only: the default packs (FlexAttention or SDPA by hidden size on a GPU); forced choices, trimming
    # alone, and TRL's padded forward
    "packed-sdpa": (CompiledGRPOTrainer, {"padding_free": "pack", "packed_attention": "sdpa"}),
    "packed-flex": (CompiledGRPOTrainer, {"padding_free": "pack", "packed_attention": "flex_attention"}),
    # torch's varlen FlashAttention (CUDA, 16-bit): no mask, the sequences' boundaries from the plan
    "packed-varlen": (CompiledGRPOTrainer, {"padding_free": "pack", "packed_attention": "varlen"}),
    # the trainer's own `compile_backbone=True` (decoder layers compiled by region at its first step) with each
    # padding-free choice
    "backbone": (CompiledGRPOTrainer, {"compile_backbone": True}),
    "trim-backbone": (CompiledGRPOTrainer, {"padding_free": "trim", "compile_backbone": True}),
    "sdpa-backbone": (
        CompiledGRPOTrainer,
        {"padding_free": "pack", "packed_attention": "sdpa", "compile_backbone": True},
    ),  # fmt: skip
    "flex-backbone": (
        CompiledGRPOTrainer,
        {"padding_free": "pack", "packed_attention": "flex_attention", "compile_backbone": True},
    ),  # fmt: skip
    "varlen-backbone": (
        CompiledGRPOTrainer,
        {"padding_free": "pack", "packed_attention": "varlen", "compile_backbone": True},
    ),  # fmt: skip
    # the default's layers replayed as CUDA graphs, its packed rows on a few fixed capacities (it refuses gradient
    # checkpointing: run it with --no-gradient-checkpointing)
    "graphs": (CompiledGRPOTrainer, {"compile_backbone": "graphs"}),
    # the default's packed forwards through the layers as a few compiled calls (`compiled_stack`: groups of layers),
    # not replayed as CUDA graphs
    "stack": (CompiledGRPOTrainer, {"compile_backbone": "stack"}),
    "stack-noshare": (CompiledGRPOTrainer, {"compile_backbone": "stack", "share_prompts": False}),
    "trim": (CompiledGRPOTrainer, {"padding_free": "trim"}),
    "padded": (CompiledGRPOTrainer, {"padding_free": False}),
    # the lm_head product rounded to bf16 before the softmax, as GRPOTrainer's own head does
    "rounded": (CompiledGRPOTrainer, {"loss_options": {"round_logits": True}}),
    "rounded-captured": (CompiledGRPOTrainer, {"loss_options": {"round_logits": True, "capture": True}}),
    # the fp32 head (`cast_lm_head_to_fp32=True`: TRL makes lm_head a float32 module, in place on the model, so
    # these run in a process of their own)
    "grpo-fp32": (GRPOTrainer, {"config": {"cast_lm_head_to_fp32": True}}),
    # the peers a user would pick: GRPOTrainer with Liger's kernels (its RMSNorm, SwiGLU and RoPE patched into the
    # model, and its GRPO loss; GPU only: Triton), and GRPOTrainer on decoder layers compiled by region (each layer
    # `torch.compile`d, dynamic lengths, as a user can do by hand), and this library's default on them
    "grpo-liger": (GRPOTrainer, {"config": {"use_liger_kernel": True}}),
    "grpo-compiled-layers": (GRPOTrainer, {"compiled_layers": True}),
    "auto-compiled-layers": (CompiledGRPOTrainer, {"compiled_layers": True}),
    "auto-fp32": (CompiledGRPOTrainer, {"config": {"cast_lm_head_to_fp32": True}}),
    # the default with its compiled layers' kernels launched from Inductor's C++ wrapper instead of Python (the host
    # issues every kernel of the small models' steps)
    "auto-cpp-wrapper": (CompiledGRPOTrainer, {"inductor": {"cpp_wrapper": True}}),
    # and with them replayed as CUDA graphs (what `mode="reduce-overhead"` sets; a graph per packed length, which the
    # trainer rounds up to `packed_bucket`); a warm-up that fails is reported in the row, a later failure ends the
    # run, so it runs in a process of its own
    "auto-cudagraphs": (CompiledGRPOTrainer, {"inductor": {"triton.cudagraphs": True}}),
    # the stack replayed as CUDA graphs (a graph per shape; the benchmark's repeated batches replay them), with and
    # without shared prompts
    "stack-graphs": (CompiledGRPOTrainer, {"compile_backbone": "stack-graphs"}),
    "noshare-graphs": (CompiledGRPOTrainer, {"compile_backbone": "stack-graphs", "share_prompts": False}),
}
DEFAULT_TRAINERS = "grpo,auto,uncaptured,memory"
LABELS = {
    "grpo": "GRPOTrainer",
    "grpo-wait": "GRPOTrainer, one host wait where its head starts",
    "auto": "CompiledGRPOTrainer (defaults: the grouped compiled stack on a GPU)",
    "uncaptured": "CompiledGRPOTrainer auto, uncaptured",
    "memory": "CompiledGRPOTrainer memory",
    "roomy": "CompiledGRPOTrainer auto, 6 GiB budget",
    "memory16k": "CompiledGRPOTrainer memory, 16384-entry vocabulary tiles",
    "captured": "CompiledGRPOTrainer auto, captured calls",
    "captured-unvalidated": "CompiledGRPOTrainer auto, captured calls, validate=False",
    "captured-stats512": "CompiledGRPOTrainer auto, captured calls, 512-row statistics pass",
    "captured-stats256": "CompiledGRPOTrainer auto, captured calls, 256-row statistics pass",
    "captured-small": "CompiledGRPOTrainer auto, captured calls, 256-row statistics, 4096-entry vocabulary slices",
    "captured-large": "CompiledGRPOTrainer auto, captured calls on the uncaptured tiles (1024-row statistics, "
    "8192-entry slices)",
    "captured-smaller": "CompiledGRPOTrainer auto, captured calls, 128-row statistics, 4096-token gradient tiles",
    "speed256": "CompiledGRPOTrainer speed, 256-token tiles, uncaptured",
    "speed512": "CompiledGRPOTrainer speed, 512-token tiles, uncaptured",
    "skip-all": "CompiledGRPOTrainer, skip_zero_advantage='all'",
    "skip-backward": "CompiledGRPOTrainer, skip_zero_advantage='backward'",
    "noskip": "CompiledGRPOTrainer, skip_zero_advantage=False",
    "noshare": "CompiledGRPOTrainer, share_prompts=False",
    "graphs": "CompiledGRPOTrainer, compile_backbone='graphs'",
    "stack": "CompiledGRPOTrainer, compile_backbone='stack' (no CUDA graphs)",
    "stack-noshare": "CompiledGRPOTrainer, compile_backbone='stack', share_prompts=False",
    "packed-sdpa": "CompiledGRPOTrainer, packed, SDPA",
    "packed-flex": "CompiledGRPOTrainer, packed, FlexAttention",
    "packed-varlen": "CompiledGRPOTrainer, packed, varlen FlashAttention",
    "backbone": "CompiledGRPOTrainer, compile_backbone=True",
    "trim-backbone": "CompiledGRPOTrainer, trimmed, compile_backbone=True",
    "sdpa-backbone": "CompiledGRPOTrainer, packed, SDPA, compile_backbone=True",
    "flex-backbone": "CompiledGRPOTrainer, packed, FlexAttention, compile_backbone=True",
    "varlen-backbone": "CompiledGRPOTrainer, packed, varlen FlashAttention, compile_backbone=True",
    "grpo-liger": "GRPOTrainer, use_liger_kernel=True",
    "grpo-compiled-layers": "GRPOTrainer, decoder layers compiled",
    "auto-compiled-layers": "CompiledGRPOTrainer, decoder layers compiled",
    "trim": "CompiledGRPOTrainer, padding_free='trim'",
    "padded": "CompiledGRPOTrainer, padding_free=False (TRL's padded forward)",
    "rounded": "CompiledGRPOTrainer auto, round_logits=True",
    "rounded-captured": "CompiledGRPOTrainer auto, round_logits=True, captured calls",
    "grpo-fp32": "GRPOTrainer, cast_lm_head_to_fp32=True",
    "auto-fp32": "CompiledGRPOTrainer auto, cast_lm_head_to_fp32=True",
    "auto-cpp-wrapper": "CompiledGRPOTrainer auto, layers compiled with Inductor's C++ wrapper",
    "auto-cudagraphs": "CompiledGRPOTrainer auto, layers compiled as CUDA graphs",
    "stack-graphs": "CompiledGRPOTrainer, compile_backbone='stack-graphs'",
    "noshare-graphs": "CompiledGRPOTrainer, compile_backbone='stack-graphs', share_prompts=False",
}
BOUND = "floor: backbone alone, trivial loss"  # drawn as the floor line
