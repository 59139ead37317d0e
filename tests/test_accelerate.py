"""TRL's trainers as users launch them: `accelerate launch` with 2 processes (gloo on the CPU, data parallel).
CompiledGRPOTrainer's first steps (loss, gradient norm, entropy) equal GRPOTrainer's from the same model."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


# 2 processes on this machine's CPUs: launched the multi-GPU way (torchrun), each rank then runs on the CPU over gloo
# (accelerate's MULTI_CPU type starts its processes apart, one world each; an FSDP config on CPUs becomes the
# same data-parallel MULTI_CPU run, so FSDP2 itself needs GPUs)
CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: MULTI_GPU
num_processes: 2
num_machines: 1
machine_rank: 0
use_cpu: true
mixed_precision: 'no'
"""


def free_port() -> int:
    """A port no process listens on now: launches running side by side (pytest -n) each get their own rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp_path, *script_args):
    (tmp_path / "accelerate.yaml").write_text(CONFIG)
    paths = [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "accelerate.yaml"),
               "--main_process_port", str(free_port()), str(HERE / "accelerate_run.py"), str(tmp_path),
               *script_args]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_two_ranks_under_accelerate_launch(tmp_path):
    launch(tmp_path)
    grpo, ours = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("grpo", "compiled"))
    assert grpo["ranks"] == ours["ranks"] == 2 and "MULTI_CPU" in ours["distributed_type"]
    assert len(ours["steps"]) == len(grpo["steps"]) == 3
    for step, (a, b) in enumerate(zip(ours["steps"], grpo["steps"], strict=True)):
        for key in ("loss", "grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), f"step {step} {key}: {a[key]} vs {b[key]}"


def test_two_ranks_skip_zero_advantage_sequences_in_step_with_grpo_trainer(tmp_path):
    """One rank's micro-batches wholly at advantage 0 while the other's are partly or not at all, gradient
    accumulation 2: both skipping modes end every step (no collective left waiting) with GRPOTrainer's loss and
    gradient norm, and "backward" with its entropy ("all" logs the metrics of the sequences with a gradient only,
    and none for a step without any)."""
    launch(tmp_path, "zero")
    grpo = json.loads((tmp_path / "grpo.json").read_text())
    for name, logged in (("skip-backward", LOGGED := ("loss", "grad_norm", "entropy")), ("skip-all", LOGGED[:2])):
        ours = json.loads((tmp_path / f"{name}.json").read_text())
        assert len(ours["steps"]) == len(grpo["steps"]) == 3
        for step, (a, b) in enumerate(zip(ours["steps"], grpo["steps"], strict=True)):
            for key in logged:
                assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), f"{name} step {step} {key}"
        ranks = [json.loads((tmp_path / f"{name}-rank{r}-zeros.json").read_text()) for r in (0, 1)]
        one_wholly_other_not = [(a[0] == a[1]) != (b[0] == b[1]) for a, b in zip(*ranks, strict=True)]
        assert any(one_wholly_other_not), ranks  # the case under test occurred: a stand-in row on one rank


@pytest.mark.parametrize("scenario", ["long", "long-shared"])
def test_two_ranks_packed_with_unlike_lengths(tmp_path, scenario):
    """Rank 0's completions up to 24 tokens, rank 1's at most 3, gradient accumulation 2: CompiledGRPOTrainer's
    packed steps (it packs: counted) end every step with GRPOTrainer's loss and gradient norm, and no rank waits;
    with its prompts shared and its rows regrouped by prompt too, and then its entropy, a mean per micro-batch, is
    that of the regrouped micro-batches (so not compared)."""
    launch(tmp_path, scenario)
    grpo, ours = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("grpo", "compiled"))
    assert len(ours["steps"]) == len(grpo["steps"]) == 3 and ours["packed_forwards"] >= 6
    shared = sum(s.get("shared_prompts/saved_tokens") or 0.0 for s in ours["steps"])
    assert (shared > 0) == (scenario == "long-shared"), shared
    for step, (a, b) in enumerate(zip(ours["steps"], grpo["steps"], strict=True)):
        for key in ("loss", "grad_norm") + (("entropy",) if scenario == "long" else ()):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), f"step {step} {key}: {a[key]} vs {b[key]}"
