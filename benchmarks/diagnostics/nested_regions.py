"""When `torch.compiler.nested_compile_region` gives wrong gradients: a stack of small residual blocks (LayerNorm,
Linear, ReLU; float32), the block's call a nested region inside one compiled function over the loop, against the
same loop run eagerly, per case:

  baseline: the input requires grad, every block trained;
  input-without-grad: the first block's input does not require grad (as frozen embeddings give);
  frozen-block: one block in the middle frozen, the others trained;
  op-after: an op (LayerNorm) after the last region, inside the compiled function.

Each case runs in its own process (dynamo's caches are per process), on the GPU where there is one. Per case: the
largest error of the output and of any parameter's gradient relative to that gradient's largest entry, and the
blocks whose gradients are off (error above 1e-3 of it).

    python -m benchmarks.diagnostics.nested_regions [--cases baseline,...] [--blocks 4] [--backend inductor]
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys

import torch

CASES = ("baseline", "input-without-grad", "frozen-block", "op-after")


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.linear = torch.nn.LayerNorm(width), torch.nn.Linear(width, width)

    def forward(self, h):
        return h + self.linear(self.norm(h)).relu()


def call(block, h):
    return block(h)


def loop(blocks, final, h, region):
    for block in blocks:
        h = region(block, h)
    return final(h) if final is not None else h


def run_case(case: str, blocks_count: int, backend: str) -> dict:
    """{case, output_error, worst_gradient_error, blocks_off}."""
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    blocks = torch.nn.ModuleList(Block(16) for _ in range(blocks_count)).to(device)
    final = torch.nn.LayerNorm(16, device=device) if case == "op-after" else None
    if case == "frozen-block":
        blocks[blocks_count // 2].requires_grad_(False)
    eager_blocks, eager_final = copy.deepcopy(blocks), copy.deepcopy(final)
    x = torch.randn(2, 8, 16, device=device, requires_grad=case != "input-without-grad")
    region = torch.compiler.nested_compile_region(call)
    compiled = torch.compile(loop, dynamic=False, backend=backend)
    out = compiled(blocks, final, x, region)
    (out**2).sum().backward()
    expected = loop(eager_blocks, eager_final, x, call)
    (expected**2).sum().backward()
    errors, off = [], set()
    for (name, p), q in zip(blocks.named_parameters(), eager_blocks.parameters(), strict=True):
        if q.grad is None:
            continue
        error = float((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp(min=1e-30))
        errors.append(error)
        if error > 1e-3:
            off.add(int(name.split(".")[0]))
    return {"case": case, "output_error": float((out - expected).abs().max()), "worst_gradient_error": max(errors),
            "blocks_off": sorted(off)}  # fmt: skip


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_case(args.child, args.blocks, args.backend)))
        return
    cases = args.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"torch {torch.__version__}, {device}, backend {args.backend}, {args.blocks} blocks", flush=True)
    for case in cases:
        command = [sys.executable, "-m", "benchmarks.diagnostics.nested_regions", "--child", case, "--blocks",
                   str(args.blocks), "--backend", args.backend]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        lines = done.stdout.strip().splitlines()
        print(lines[-1] if done.returncode == 0 and lines else json.dumps({"case": case, "failed": done.stderr[-300:]}),
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
