"""TRL's trainers as users launch them: `accelerate launch` with 2 processes (gloo on the CPU, data parallel).
CompiledGRPOTrainer's first steps (loss, gradient norm, entropy) equal GRPOTrainer's from the same model."""

from __future__ import annotations

import json
import os
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


def test_two_ranks_under_accelerate_launch(tmp_path):
    (tmp_path / "accelerate.yaml").write_text(CONFIG)
    paths = [str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "accelerate.yaml"),
               str(HERE / "accelerate_run.py"), str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    grpo, ours = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("grpo", "compiled"))
    assert grpo["ranks"] == ours["ranks"] == 2 and "MULTI_CPU" in ours["distributed_type"]
    assert len(ours["steps"]) == len(grpo["steps"]) == 3
    for step, (a, b) in enumerate(zip(ours["steps"], grpo["steps"], strict=True)):
        for key in ("loss", "grad_norm", "entropy"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), f"step {step} {key}: {a[key]} vs {b[key]}"
