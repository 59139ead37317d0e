"""CompiledGRPOTrainer, the TRL head swap and the async trainer's loss under the engines users scale on.

DeepSpeed ZeRO-2 and ZeRO-3 run here on the CPU (gloo), launched by `accelerate launch` as users launch them: one
process, and two with one rank's micro-batches wholly at advantage 0 in turn and completions of other lengths per
rank. Each CompiledGRPOTrainer mode (default, both skip modes, the memory schedule, packed, packed on decoder layers
compiled by region after the engine wrapped the model, `cast_lm_head_to_fp32`, tied embeddings) trains 3 optimizer
steps with the loss, gradient norm and entropy of GRPOTrainer under the same configuration (relative 1e-5; "all"
logs the entropy of the sequences with a gradient only), and the head swap (`compiled_fused_head` under TRL's fused
forward, as SFT runs it) and CompiledAsyncGRPOTrainer's loss give every parameter the gradient of the same model
without the engine. ZeRO-3 shards every parameter here (persistence threshold 0), the lm_head included.

FSDP2's `fully_shard` runs on a gloo CPU mesh with torch's own API: the fused loss on an lm_head sharded in a unit
of its own, over 2 processes, gives the gradients of one process on the whole batch; the weight read after the
model's forward (a DTensor gathered outside the unit's hooks) does not.

With CUDA (`python -m pytest tests/test_engines.py` on a GPU machine), the same trainers run compiled on the GPU
under ZeRO-2, ZeRO-3 and FSDP2 (reshard after forward on and off; the lm_head in a unit of its own, in the root unit
beside the decoder layers' units as accelerate's TRANSFORMER_BASED_WRAP puts it, and in the only unit), one process
each, TF32 off, with gradient checkpointing as `train()` turns it on and a packed run among the trainers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_accelerate import free_port
from test_distributed import init, spawn

from compiled_grpo import FusedLinearGRPOLoss
from compiled_grpo.integrations.trl.sharded_head import within_head

HERE = Path(__file__).parent
LOGGED = ("loss", "grad_norm", "entropy")
# each CompiledGRPOTrainer run and the GRPOTrainer run it is held to (tests/engine_run.py)
REFERENCE = {"compiled": "grpo", "skip-backward": "grpo", "skip-all": "grpo", "memory": "grpo", "packed": "grpo",
             "backbone": "grpo", "fp32-head": "grpo-fp32-head", "tied": "grpo-tied"}  # fmt: skip

ZERO = {"gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto"}  # fmt: skip


def deepspeed_config(tmp_path: Path, stage: int, world: int, gpu: bool) -> Path:
    zero = {"stage": stage}
    if stage == 3:  # every parameter partitioned, however small (DeepSpeed keeps small ones whole by default)
        zero["stage3_param_persistence_threshold"] = 0
    (tmp_path / "deepspeed.json").write_text(json.dumps({**ZERO, "zero_optimization": zero}))
    config = tmp_path / "accelerate.yaml"
    config.write_text(f"""compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  deepspeed_config_file: {tmp_path / "deepspeed.json"}
  zero3_init_flag: false
num_processes: {world}
num_machines: 1
machine_rank: 0
use_cpu: {str(not gpu).lower()}
""")
    return config


def fsdp2_config(tmp_path: Path, reshard: bool, wrap: str) -> Path:
    """FSDP2, one GPU, the lm_head in: a unit of its own ("own-unit": every Linear wrapped, the lm_head among them),
    the root unit with each decoder layer a unit of its own ("layers": accelerate's usual TRANSFORMER_BASED_WRAP, the
    classes from the model's `_no_split_modules`), or the root unit, the only one ("root": NO_WRAP)."""
    wrap = {
        "own-unit": "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_transformer_layer_cls_to_wrap: Linear\n",
        "layers": "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n",
        "root": "  fsdp_auto_wrap_policy: NO_WRAP\n",
    }[wrap]
    config = tmp_path / "accelerate.yaml"
    config.write_text(f"""compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
{wrap}  fsdp_reshard_after_forward: {str(reshard).lower()}
  fsdp_cpu_ram_efficient_loading: false
  fsdp_offload_params: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
num_processes: 1
num_machines: 1
machine_rank: 0
mixed_precision: 'no'
""")
    return config


def launch(config: Path, out: Path, part: str) -> None:
    out.mkdir(exist_ok=True)
    paths = [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1", "NVIDIA_TF32_OVERRIDE": "0"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--main_process_port", str(free_port()), str(HERE / "engine_run.py"), str(out), part]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]


def check_trainers(out: Path, engine: str, world: int, generation_compiles: bool = True) -> None:
    """Each run's steps against its GRPOTrainer's; the compiled-generation run compiled once (or, where
    `generation_compiles` is False, compiled once or fell back to eager generation with a reason)."""
    runs = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json") if p.stem != "heads"}
    assert {runs[n]["engine"] for n in runs} == {engine} and {runs[n]["ranks"] for n in runs} == {world}
    for name, reference in REFERENCE.items():
        ours, theirs = runs[name]["steps"], runs[reference]["steps"]
        assert len(ours) == len(theirs) == 3, name
        assert any(s["grad_norm"] > 0 for s in theirs), "no step with a gradient: nothing compared"
        assert name != "packed" or runs[name]["packed"] > 0, "the packed run did not pack"
        assert name != "packed" or runs[name]["shared_tokens"] > 0, "the packed run shared no prompt"
        generation = runs[name]["generation"]
        if name == "generation" and (generation_compiles or generation["compiled"]):
            assert generation["compiled"] and generation["compiles"] == 1, generation
        elif name == "generation":  # a GPU engine whose gathered parameters the decode step could not compile with
            assert generation["fallback"], generation
        # "all" logs the metrics of the sequences with a gradient; the packed runs' rows are regrouped by prompt, their
        # per-micro-batch means (entropy) those of their own micro-batches
        logged = LOGGED[:2] if name in ("skip-all", "packed", "backbone") else LOGGED
        for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            for key in logged:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), f"{name} step {step} {key}"


def check_heads(out: Path, engine: str) -> None:
    heads = json.loads((out / "heads.json").read_text())
    assert heads["engine"] == engine
    for name in ("sft", "async"):
        assert heads[name]["missing"] == [], name
        assert heads[name]["max_relative_error"] <= 1e-5, (name, heads[name])


def needs_deepspeed():
    pytest.importorskip("deepspeed", reason='DeepSpeed is not installed: `pip install -e ".[deepspeed]"` (.ci/run '
                        "installs it)")  # fmt: skip


ZERO_CASES = [(2, 1), (3, 1), (3, 2)]


@pytest.mark.parametrize("stage, world", ZERO_CASES, ids=[f"zero{s}-{w}proc" for s, w in ZERO_CASES])
def test_deepspeed_zero_on_cpu(tmp_path, stage, world):
    needs_deepspeed()
    config = deepspeed_config(tmp_path, stage, world, gpu=False)
    launch(config, tmp_path / "out", "trainers")
    check_trainers(tmp_path / "out", f"zero{stage}", world)
    if stage == 3:  # ZeRO-2 keeps every parameter whole: the heads read it as without an engine
        launch(config, tmp_path / "out", "heads")
        check_heads(tmp_path / "out", "zero3")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU engine runs need CUDA (run on a GPU)")
GPU_OPTIONS = {"zero2": ("zero", 2), "zero3": ("zero", 3)}
GPU_OPTIONS.update({f"fsdp2-{wrap}-{'reshard' if reshard else 'keep'}": ("fsdp", reshard, wrap)
                    for wrap in ("own-unit", "layers", "root") for reshard in (True, False)})  # fmt: skip
GPU_CASES = list(GPU_OPTIONS)


@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES)
def test_engines_on_one_gpu(tmp_path, case):
    kind, *options = GPU_OPTIONS[case]
    if kind == "zero":
        needs_deepspeed()
        config, engine = deepspeed_config(tmp_path, options[0], 1, gpu=True), f"zero{options[0]}"
    else:
        config, engine = fsdp2_config(tmp_path, *options), "fsdp2"
    launch(config, tmp_path / "out", "trainers")
    check_trainers(tmp_path / "out", engine, 1, generation_compiles=False)  # it may fall back, said, on a GPU
    if engine != "zero2":  # ZeRO-2 keeps every parameter whole: the heads read it as without an engine
        launch(config, tmp_path / "out", "heads")
        check_heads(tmp_path / "out", engine)


B, T, H, V = 3, 7, 8, 37


class Backbone(torch.nn.Module):
    """A body and an lm_head that its forward calls for the last position only, as CompiledGRPOTrainer runs a model."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(H, H)
        self.lm_head = torch.nn.Linear(H, V, bias=False)

    def forward(self, x):
        hidden = self.body(x)
        self.lm_head(hidden[:, -1:])
        return hidden


def fsdp2_worker(rank, world, reshard, read_after_forward, result):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    init(rank, world)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(world * B, T, H, generator=g)
        ids = torch.randint(0, V, (world * B, T), generator=g)
        mask = (torch.rand(world * B, T, generator=g) > 0.3).long()
        advantages = torch.randn(world * B, generator=g)
        loss_fn = FusedLinearGRPOLoss(compiled=False, loss_type="dapo")
        tokens = mask.sum()

        def loss_of(model, rows, processes):
            hidden = model(x[rows])

            def call(weight, bias, hidden):
                out = loss_fn(hidden, weight, ids[rows], mask[rows], advantages[rows], num_items_in_batch=tokens,
                              num_processes=processes)  # fmt: skip
                return (out.loss,)

            if read_after_forward:  # the weight as the model's forward left it (a DTensor shard when resharded)
                return call(model.lm_head.weight, None, hidden)[0]
            return within_head(model.lm_head, call, hidden)[0]

        torch.manual_seed(1)
        one = Backbone()
        loss_of(one, slice(None), 1).backward()
        torch.manual_seed(1)
        sharded = Backbone()
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(sharded.lm_head, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(sharded, mesh=mesh, reshard_after_forward=reshard)
        loss_of(sharded, slice(rank * B, (rank + 1) * B), world).backward()
        errors = []
        for name, param in one.named_parameters():
            got = dict(sharded.named_parameters())[name].grad.full_tensor()
            errors.append(float((got - param.grad).abs().max() / param.grad.abs().max()))
        if rank == 0:
            torch.save(max(errors), result)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_sharded_lm_head_two_ranks_match_one_process(tmp_path, reshard):
    spawn(fsdp2_worker, 2, reshard, False, tmp_path / "error.pt")
    assert torch.load(tmp_path / "error.pt") <= 1e-5


def test_fsdp2_weight_read_after_the_forward_gets_the_whole_batchs_gradient(tmp_path):
    """Read outside the lm_head unit's hooks, the weight is a resharded DTensor: the loss gathers it, and its gradient
    is reduce-scattered (averaged as FSDP2's own), not each rank's own batch's alone."""
    spawn(fsdp2_worker, 2, True, True, tmp_path / "error.pt")
    assert torch.load(tmp_path / "error.pt") <= 1e-5


def shard_as(model, wrap: str, mesh, reshard: bool) -> None:
    """FSDP2 units on `model`: each decoder layer, then "root": the rest in the root unit (the lm_head, the final
    norm, the embeddings); "accelerate": as accelerate's TRANSFORMER_BASED_WRAP (1.15) does, the embeddings a unit,
    the final norm and the lm_head one together that does not reshard after the forward, the root the rest."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    if wrap == "accelerate":
        fully_shard(model.model.embed_tokens, mesh=mesh, reshard_after_forward=reshard)
        fully_shard([model.model.norm, model.lm_head], mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh)
    else:
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def root_unit_worker(rank, world, reshard, wrap, result, compiled=False):
    """A tiny Qwen2 wrapped as `shard_as` says: CompiledGRPOTrainer's forward and fused loss
    (`completion_hidden_states`, `loss_within_head` given the model), two micro-batches accumulated, against one
    process on the whole batch."""
    from test_skip_zero_advantage import tiny_qwen2

    from compiled_grpo.integrations.trl.hidden_states import completion_hidden_states
    from compiled_grpo.integrations.trl.sharded_head import loss_within_head

    init(rank, world)
    try:
        prompt, completion = 3, 6
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 23, (world * B, prompt + completion), generator=g)
        mask = (torch.rand(world * B, completion, generator=g) > 0.3).long()
        advantages = torch.randn(world * B, generator=g)
        loss_fn = FusedLinearGRPOLoss(compiled=False, loss_type="dapo")

        def loss_of(model, rows, processes):
            lm_head = model.get_output_embeddings()
            hidden, _ = completion_hidden_states(model, lm_head, {"input_ids": ids[rows]}, completion)

            def compute(weight, bias, hidden):
                return loss_fn(hidden, weight, ids[rows, prompt:], mask[rows], advantages[rows],
                               num_items_in_batch=mask.sum(), num_processes=processes)  # fmt: skip

            return loss_within_head(lm_head, compute, hidden, model).loss

        sharded_against_one(lambda: tiny_qwen2(tie=False), loss_of, (rank, world), (wrap, reshard), result, compiled)
    finally:
        torch.distributed.destroy_process_group()


def sharded_against_one(make, loss_of, ranks: tuple, sharding: tuple, result, compiled: bool = False) -> None:
    """Two micro-batches accumulated on `make()` in one process on the whole batch and on `make()` sharded as
    `shard_as(*sharding)` over the ranks (its decoder layers then compiled by region where `compiled`, as the
    trainer's `compile_backbone` compiles them after accelerate wrapped the model), each rank on its slice; rank 0
    saves each parameter's relative error."""
    from torch.distributed.device_mesh import init_device_mesh

    from compiled_grpo.integrations.trl import regional_compile

    rank, world = ranks
    one = make()
    for _ in range(2):
        loss_of(one, slice(None), 1).backward()
    sharded = make()
    shard_as(sharded, sharding[0], init_device_mesh("cpu", (world,)), sharding[1])
    if compiled:
        assert len(regional_compile.compile_layers(sharded)) == len(sharded.model.layers)
    for _ in range(2):
        loss_of(sharded, slice(rank * B, (rank + 1) * B), world).backward()
    if compiled:  # the compiled layers ran: dynamo made their graphs
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0
    theirs = dict(sharded.named_parameters())
    errors = {name: float((theirs[name].grad.full_tensor() - p.grad).abs().max() / p.grad.abs().max())
              for name, p in one.named_parameters()}  # fmt: skip
    if rank == 0:
        torch.save(errors, result)


@pytest.mark.parametrize("wrap", ["root", "accelerate"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_lm_head_in_a_shared_unit_two_ranks_match_one_process(tmp_path, reshard, wrap):
    """The loss run as a call of the unit that gathers the lm_head, without arguments: read after the model's call
    instead, the resharded root's final norm was read freed in the backward (a segmentation fault here, an illegal
    memory access on a GPU); run as a call of the lm_head given the hidden states, its unit was resharded once their
    gradient was made, and the final norm in it read freed alike."""
    spawn(root_unit_worker, 2, reshard, wrap, tmp_path / "errors.pt")
    errors = torch.load(tmp_path / "errors.pt")
    assert {"lm_head.weight", "model.norm.weight", "model.embed_tokens.weight"} <= errors.keys()
    assert max(errors.values()) <= 1e-5, errors


def head_swap_worker(rank, world, reshard, result):
    """The head swap (`compiled_fused_head` under TRL's fused forward, as its SFT trainer runs it) on a tiny Qwen2 with
    each decoder layer an FSDP2 unit and the lm_head in the root unit, two micro-batches accumulated, against one
    process on the whole batch."""
    from test_skip_zero_advantage import tiny_qwen2
    from trl.trainer.utils import add_fused_lm_head

    from compiled_grpo.integrations.trl import compiled_fused_head

    init(rank, world)
    try:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 23, (world * B, 9), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100  # the prompt
        tokens = (labels[:, 1:] != -100).sum()

        def loss_of(model, rows, processes):
            with compiled_fused_head(compiled=False):
                return model(input_ids=ids[rows], labels=labels[rows], fused_lm_head=True,
                             num_items_in_batch=tokens / processes).loss  # fmt: skip

        def make():
            model = tiny_qwen2(tie=False)
            add_fused_lm_head(model)
            return model

        sharded_against_one(make, loss_of, (rank, world), ("root", reshard), result)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_fsdp2_head_swap_in_the_root_unit_reduces_the_lm_head_gradient(tmp_path, reshard):
    spawn(head_swap_worker, 2, reshard, tmp_path / "errors.pt")
    errors = torch.load(tmp_path / "errors.pt")
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.compiled
def test_fsdp2_units_on_compiled_layers_two_ranks_match_one_process(tmp_path):
    """accelerate's TRANSFORMER_BASED_WRAP layout, the decoder layers (each an FSDP2 unit) compiled by region after
    wrapping (Inductor on the CPU): the gradients of one eager process on the whole batch."""
    spawn(root_unit_worker, 2, True, "accelerate", tmp_path / "errors.pt", True)
    errors = torch.load(tmp_path / "errors.pt")
    assert max(errors.values()) <= 1e-5, errors
