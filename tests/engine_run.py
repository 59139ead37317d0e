"""A script for `accelerate launch` under a sharding engine (tests/test_engines.py): DeepSpeed ZeRO-2/3 (CPU over
gloo, or GPU) and FSDP2 (GPU). Writes OUT/<name>.json on rank 0.

`python engine_run.py OUT trainers`: GRPOTrainer and CompiledGRPOTrainer in every mode, each trained 3 optimizer
steps (gradient accumulation 2, gradient checkpointing on as GRPOConfig's default) from the same tiny random Llama
in float32, with some groups at advantage 0 (on
2 ranks: one rank's micro-batches wholly, in turn, and completions of other lengths per rank); each step's loss,
gradient norm and entropy. `python engine_run.py OUT heads`: on a model the engine prepared, the gradients of
every parameter from `compiled_fused_head` under TRL's fused forward (the SFT/primitive head swap) and from
CompiledAsyncGRPOTrainer's loss, against the same model without the engine in this process."""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import torch
from accelerate_run import ZeroOnOneRank, end_launch
from datasets import Dataset
from test_integration_trl import tiny_model, tokenizer
from test_skip_zero_advantage import zero_reward_for_some_prompts
from trl import GRPOConfig, GRPOTrainer

from compiled_grpo.integrations.trl import CompiledGRPOTrainer, compiled_fused_head

LOGGED = ("loss", "grad_norm", "entropy")
# name: (trainer, its options, GRPOConfig settings, tied embeddings); each is compared with the GRPOTrainer of the
# same settings and embeddings
RUNS = {
    "grpo": (GRPOTrainer, {}, {}, False),
    "compiled": (CompiledGRPOTrainer, {}, {}, False),
    "skip-backward": (CompiledGRPOTrainer, {"skip_zero_advantage": "backward"}, {}, False),
    "skip-all": (CompiledGRPOTrainer, {"skip_zero_advantage": "all"}, {}, False),
    "memory": (CompiledGRPOTrainer, {"schedule": "memory"}, {}, False),
    # packed forwards on another attention than the model's (dispatched per call), under gradient checkpointing
    "packed": (CompiledGRPOTrainer, {"padding_free": "pack", "packed_attention": "eager"}, {}, False),
    # the decoder layers compiled by region after the engine wrapped the model (Inductor on a CPU), packed
    "backbone": (
        CompiledGRPOTrainer,
        {"compile_backbone": True, "padding_free": "pack", "packed_attention": "eager"},
        {},
        False,
    ),  # fmt: skip
    # generation on the compiled decode step (Inductor on a CPU) while the engine gathers the parameters for it
    "generation": (CompiledGRPOTrainer, {"compile_generation": True}, {}, False),
    "grpo-fp32-head": (GRPOTrainer, {}, {"cast_lm_head_to_fp32": True}, False),
    "fp32-head": (CompiledGRPOTrainer, {"skip_zero_advantage": "backward"}, {"cast_lm_head_to_fp32": True}, False),
    "grpo-tied": (GRPOTrainer, {}, {}, True),
    "tied": (CompiledGRPOTrainer, {"skip_zero_advantage": "backward", "schedule": "memory"}, {}, True),
}
REFERENCE = {"compiled": "grpo", "skip-backward": "grpo", "skip-all": "grpo", "memory": "grpo", "packed": "grpo",
             "backbone": "grpo", "generation": "grpo", "fp32-head": "grpo-fp32-head", "tied": "grpo-tied"}  # fmt: skip


def on_gpu() -> bool:
    return torch.cuda.is_available()


def train(name: str, out: Path) -> None:
    cls, options, settings, tie = RUNS[name]
    model = tiny_model(dtype=torch.float32, tie=tie)
    args = GRPOConfig(output_dir=str(out / name), per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=8, max_steps=3, learning_rate=5e-2, logging_steps=1, report_to=[],
                      use_cpu=not on_gpu(), save_strategy="no", bf16=False, seed=0, gradient_accumulation_steps=2,
                      optim="sgd", **settings)  # fmt: skip
    # prompts of several lengths: left padding in every micro-batch, which the packed run removes
    data = Dataset.from_dict({"prompt": ["a b", "d e f g h i", "1 2 a", "g"] * 8})
    # compiled on a GPU (captured calls where the trainer captures), eager on a CPU (compile time). On a GPU "auto"
    # decodes on the trainer's loop where no engine shards the parameters, which samples from another random stream
    # than GRPOTrainer's; these runs compare steps, so there they decode on transformers' compiled step, whose tokens
    # are TRL's (tried under every engine, as the "generation" run is)
    on_step = {"compile_generation": True} if on_gpu() else {}
    extra = {"compiled": on_gpu(), **on_step, **options} if cls is CompiledGRPOTrainer else {}
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1  # one rank at 0 in turn, the other half
    reward = ZeroOnOneRank() if several else zero_reward_for_some_prompts
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=data,
                  processing_class=tokenizer(), **extra)  # fmt: skip
    trainer.train()
    if trainer.accelerator.is_main_process:
        steps = [{k: h.get(k) for k in LOGGED} for h in trainer.state.log_history if "loss" in h]
        packed = [h["padding_free/packed_fraction"] for h in trainer.state.log_history if "padding_free/packed_"
                  "fraction" in h]  # fmt: skip
        compiles = getattr(trainer, "generation_compiles", None)
        generation = compiles and {"compiled": trainer.compile_generation, "calls": compiles.calls,
                                   "compiles": len(compiles.compiles), "fallback": compiles.fallback}  # fmt: skip
        shared = sum(h.get("shared_prompts/saved_tokens", 0.0) for h in trainer.state.log_history)
        write(out, name, {"ranks": trainer.accelerator.num_processes, "engine": engine(trainer.accelerator),
                          "steps": steps, "packed": sum(packed) / max(len(packed), 1), "shared_tokens": shared,
                          "generation": generation})  # fmt: skip


def engine(accelerator) -> str:
    state = accelerator.state
    if state.deepspeed_plugin is not None:
        return f"zero{state.deepspeed_plugin.zero_stage}"
    if getattr(state, "fsdp_plugin", None) is not None:
        return f"fsdp{state.fsdp_plugin.fsdp_version}"
    return str(state.distributed_type)


def write(out: Path, name: str, record: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(record))


def full_gradients(model) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient, however the engine holds it (ZeRO partitions, FSDP2 DTensor shards)."""
    grads = {}
    for name, param in model.named_parameters():
        if hasattr(param, "ds_id") or getattr(param, "_z3_optimizer", None) is not None:
            from deepspeed.utils import safe_get_full_grad

            grad = safe_get_full_grad(param)
        else:
            grad = param.grad
            grad = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
        if grad is not None:
            grads[name] = grad.detach().float().cpu().clone()
    return grads


def sft_loss(model, batch):
    """TRL's fused forward (`add_fused_lm_head`, as its SFT trainer runs it) inside `compiled_fused_head`."""
    with compiled_fused_head(compiled=False):
        return model(**batch, fused_lm_head=True).loss


def async_loss(model, batch):
    """CompiledAsyncGRPOTrainer's loss (`packed_row_loss`) on TRL's packed row."""
    from test_trl_async import stand_in

    from compiled_grpo import FusedLinearGRPOLoss
    from compiled_grpo.integrations.trl.async_grpo import async_loss_settings, packed_row_loss

    trainer = stand_in(model, accelerator=Unwrapping())
    trainer.fused_loss = FusedLinearGRPOLoss(compiled=False, schedule="memory", **async_loss_settings(trainer))
    return packed_row_loss(trainer, model, batch)


class Unwrapping:
    """The one-process accelerator of TRL's loss (every rank holds the same batch here), unwrapping an engine."""

    num_processes = 1

    def reduce(self, x, reduction="sum"):
        return x

    def unwrap_model(self, model):
        return getattr(model, "module", model)


def head_batches(device) -> dict:
    """The batch of each head check: token ids and labels (SFT), and TRL's packed row (async)."""
    from test_trl_async import packed_batch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 20, (4, 9), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    sft = {"input_ids": ids, "labels": labels}
    move = lambda b: {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}  # noqa: E731
    return {"sft": move(sft), "async": move(packed_batch(seed=5))}


HEADS = {"sft": (sft_loss, lambda: tiny_model(dtype=torch.float32)), "async": (async_loss, None)}


def head_model(name: str, device):
    from test_trl_async import tiny_model as tiny_qwen2
    from trl.trainer.utils import add_fused_lm_head

    model = (tiny_qwen2() if name == "async" else tiny_model(dtype=torch.float32)).to(device)
    if name == "async":
        model.set_attn_implementation("eager")  # TRL's tree attention needs a FlashAttention-3 kernel from the Hub
    add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    return model


def prepared(accelerator, model):
    """The model under the launch's engine: DeepSpeed's engine made from the launch's configuration with this
    check's batch (no dataloader here to size it), or FSDP2's as accelerate applies it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return accelerator.prepare(model, optimizer)[0]
    import deepspeed

    config = {"zero_optimization": plugin.deepspeed_config["zero_optimization"], "train_micro_batch_size_per_gpu": 1,
              "gradient_accumulation_steps": 1, "train_batch_size": torch.distributed.get_world_size(),
              "zero_allow_untested_optimizer": True}  # fmt: skip
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def heads(out: Path) -> None:
    """Each head's gradients on the engine's model against the same model without it (this process's batch,
    computed before the engine is set up: its global configuration would reach the plain model too)."""
    from accelerate import Accelerator

    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if on_gpu() else torch.device("cpu")
    batches = head_batches(device)
    expected = {}
    for name, (loss_of, _) in HEADS.items():
        plain = head_model(name, device)
        loss_of(plain, copy.deepcopy(batches[name])).backward()
        expected[name] = full_gradients(plain)
    accelerator = Accelerator()  # the launch's configuration (its engine, and the CPU where it says so)
    report = {"engine": engine(accelerator), "ranks": torch.distributed.get_world_size()}
    fsdp = getattr(accelerator.state, "fsdp_plugin", None)
    layer_classes = getattr(fsdp, "transformer_cls_names_to_wrap", None)
    for name, (loss_of, _) in HEADS.items():
        if fsdp is not None:  # the launch's classes, not the last model's that accelerate kept (Llama's, not Qwen2's)
            fsdp.transformer_cls_names_to_wrap = layer_classes
        model = prepared(accelerator, head_model(name, device))
        loss = loss_of(model, copy.deepcopy(batches[name]))
        if hasattr(model, "backward"):  # DeepSpeed's engine: its backward unscaled by accumulation, no step
            model.backward(loss, scale_wrt_gas=False)
        else:
            loss.backward()
        got = full_gradients(accelerator.unwrap_model(model))
        errors = {n: float((got[n] - g).abs().max() / g.abs().max().clamp(min=1e-12))
                  for n, g in expected[name].items() if n in got}  # fmt: skip
        report[name] = {"missing": sorted(set(expected[name]) - set(got)), "max_relative_error": max(errors.values()),
                        "worst": max(errors, key=errors.get)}  # fmt: skip
        accelerator.free_memory()
    if accelerator.is_main_process:
        write(out, "heads", report)


if __name__ == "__main__":
    folder, part = Path(sys.argv[1]), sys.argv[2]
    if part == "heads":
        heads(folder)
    else:
        for run_name in sys.argv[3:] or RUNS:
            train(run_name, folder)
    end_launch()
