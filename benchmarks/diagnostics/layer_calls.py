"""The host's cost of one decoder-layer call: a stack of Qwen2 decoder layers at a tiny width (hidden 64, so that the
device's work is negligible and the wall clock is the host's), forward and backward as a checkpointed training
step runs them, per way of running the layers. Each row runs in its own process (dynamo keeps one cache per code
object, which every row would share otherwise).

Rows:
  eager: the layers as transformers runs them;
  compiled: `compile_backbone`'s regional compile (`regional_compile.compile_layers`: dynamic shapes, dynamo
    picking among a code's graphs in compile order);
  compiled-lru: the same with dynamo's own order (the most recently used graph first);
  compiled-no-module-guards: the same as `compiled` with dynamo's guards on nn.Module attributes dropped
    (`torch.compiler.skip_guard_on_all_nn_modules_unsafe`), what those guards cost per call;
  graphs: `compile_backbone="graphs"`: each layer's call replayed as a CUDA graph (GPU only);
  stack: the whole stack as one compiled region, each layer checkpointed inside it (the loop unrolled: one graph of
    every layer, whose compile time grows with the depth);
  stack-nested: the same with the layer's forward a `torch.compiler.nested_compile_region` (compiled once, called
    per layer);
  stack-nested-static: the same on static shapes (a graph per length, as packed rows padded to a few capacities
    would meet them);
  compiled-stack: `compile_backbone="stack"`'s own stack (`compiled_stack.Stack`: the layers' calls nested regions,
    checkpointed inside the compiled function where the layers checkpoint; groups of layers as it sizes them).

    python -m benchmarks.diagnostics.layer_calls [--rows eager,compiled,...] [--layers 28] [--repeats 30]
        [--no-checkpointing] [--out DIR] [--suffix=-run2]

Per row: the median wall clock per layer call of a forward alone and of a forward + backward (synchronized), in
microseconds, over sequence lengths taking turns (16, 17, 18: dynamic shapes, one graph); the warm-up's seconds
(compiling), dynamo's graph breaks and the reasons it ran code eagerly (a region that failed to compile); on a GPU
also the device's busy time of one forward + backward per layer call. Writes `layer-calls-<device>.json`.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.timing import busy_ms, wall_median_ms

ROWS = ("eager", "compiled", "compiled-lru", "compiled-no-module-guards", "graphs")
ROWS += ("stack", "stack-nested", "stack-nested-static", "compiled-stack")
LENGTHS = (16, 17, 18)


def stack(layers: int):
    """(decoder layers, rotary embedding) of a tiny Qwen2 with `layers` layers, SDPA attention."""
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=layers, attn_implementation="sdpa")  # fmt: skip
    blocks = torch.nn.ModuleList([Qwen2DecoderLayer(config, i) for i in range(layers)])
    return blocks, Qwen2RotaryEmbedding(config)


def prepare(row: str, blocks: torch.nn.ModuleList):
    """The layers set up as `row` says; the forward through them, `forward(blocks, h, embeddings, positions, ckpt)`."""
    from compiled_grpo.integrations.trl import regional_compile

    if row == "compiled-stack":
        return library_stack(blocks)
    if row.startswith("stack"):
        if row.startswith("stack-nested"):
            kind = type(blocks[0])
            kind.forward = torch.compiler.nested_compile_region(kind.forward)
        return torch.compile(through_layers, dynamic=not row.endswith("static"))
    if row == "compiled-no-module-guards":
        guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        for block in blocks:
            block.compile(dynamic=True, options=guards)
        regional_compile.pick_graphs_in_compile_order()
    elif row != "eager":
        regional_compile.compile_layers(torch.nn.Sequential(blocks), graphs=row == "graphs")
    if row == "compiled-lru":
        torch._C._dynamo.eval_frame._set_lru_cache(True)
    return through_layers


def library_stack(blocks: torch.nn.ModuleList):
    """The forward through `compiled_stack.Stack` (the layers checkpointed as transformers checkpoints them)."""
    from compiled_grpo.integrations.trl.compiled_stack import Stack

    stack = Stack(list(blocks))
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)

    def forward(blocks, h, embeddings, positions, ckpt: bool):
        for block in blocks:
            block.gradient_checkpointing, block._gradient_checkpointing_func = ckpt, checkpoint
        with stack.running():
            return through_layers(blocks, h, embeddings, positions, False)

    return forward


def through_layers(blocks, h, embeddings, positions, ckpt: bool):
    """`h` through every layer, each one's call checkpointed (non-reentrant) if `ckpt`."""
    for block in blocks:
        call = lambda h, block=block: block(h, position_embeddings=embeddings, position_ids=positions)  # noqa: E731
        h = torch.utils.checkpoint.checkpoint(call, h, use_reentrant=False) if ckpt else call(h)
        h = h[0] if isinstance(h, tuple) else h
    return h


def step(forward, blocks, rope, length: int, backward: bool, checkpointing: bool, device: str) -> None:
    """One forward through every layer (checkpointed if `checkpointing` and `backward`), and its backward if
    `backward`."""
    x = torch.randn(1, length, 64, device=device, requires_grad=backward)
    positions = torch.arange(length, device=device)[None]
    h = forward(blocks, x, rope(x, positions), positions, checkpointing and backward)
    if backward:
        h.sum().backward()


def measure_row(row: str, layers: int, repeats: int, checkpointing: bool) -> dict:
    """{row, forward_us, step_us, warmup_s, graph_breaks, not_compiled[, busy_us]}: per layer call, medians over
    `repeats` calls after a warm-up; `not_compiled`, why dynamo ran parts eagerly."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    blocks, rope = stack(layers)
    blocks, rope = blocks.to(device), rope.to(device)
    forward = prepare(row, blocks)
    result = {"row": row, "warmup_s": 0.0}
    for backward, key in ((False, "forward_us"), (True, "step_us")):
        runs = [lambda n=n, b=backward: step(forward, blocks, rope, n, b, checkpointing, device) for n in LENGTHS]
        start = time.perf_counter()
        for run in runs * 3:  # compiles, records graphs, warms caches
            run()
        result["warmup_s"] += time.perf_counter() - start
        result[key] = median_us(runs, repeats, device) / layers
    counters = torch._dynamo.utils.counters
    result["graph_breaks"] = sum(counters["graph_break"].values())
    result["not_compiled"] = [reason.split("\n")[0] for reason in counters["unimplemented"]]  # ran eagerly instead
    if device == "cuda":
        one = lambda: step(forward, blocks, rope, LENGTHS[0], True, checkpointing, device)  # noqa: E731
        result["busy_us"] = busy_ms(one) * 1e3 / layers
    return result


def median_us(runs: list, repeats: int, device: str) -> float:
    """Median synchronized wall clock (us) of the runs taking turns, `repeats` calls in all."""
    turns = itertools.cycle(runs)

    def one() -> None:
        next(turns)()
        if device == "cuda":
            torch.cuda.synchronize()

    return wall_median_ms(one, repeats) * 1e3


def run_in_child(row: str, args) -> dict:
    """`row` measured in a fresh process; its result, or {row, failed} with the end of its error."""
    command = [sys.executable, "-m", "benchmarks.diagnostics.layer_calls", "--child", row, "--layers",
               str(args.layers), "--repeats", str(args.repeats)]  # fmt: skip
    command += [] if args.checkpointing else ["--no-checkpointing"]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return {"row": row, "failed": done.stderr.strip().splitlines()[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    parser.add_argument("--out", default="benchmark-results")
    parser.add_argument("--suffix", default="", help="added to the file's name (a second run beside the first)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure_row(args.child, args.layers, args.repeats, args.checkpointing)))
        return
    rows = args.rows.split(",")
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {list(ROWS)}")
    if "graphs" in rows and not torch.cuda.is_available():
        rows.remove("graphs")
        print("graphs: skipped, CUDA graphs need a GPU", flush=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    results = []
    for row in rows:
        results.append(run_in_child(row, args))
        print(json.dumps(results[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    from benchmarks.timing import run_date

    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "date": run_date(),
            "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "layers": args.layers,
            "checkpointing": args.checkpointing, "repeats": args.repeats}  # fmt: skip
    name = f"layer-calls-{device}{args.suffix}.json"
    (out / name).write_text(json.dumps({**meta, "rows": results}, indent=1))


if __name__ == "__main__":
    main()
