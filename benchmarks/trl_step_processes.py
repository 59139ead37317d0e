"""`benchmarks.trl_step` with each batch kind and trainer in a process of its own (`--processes each`, the default
on a GPU).

`compile_backbone` compiles the shared model's decoder layers in place, and every trainer that does so adds its
graphs to the same code: in one process a later row runs its layers behind the earlier rows' graphs and guards. On
an H100 (torch 2.11, Qwen2.5-1.5B's shapes) the default's `tail-half0` step took 701 ms after `tail` had run in the
same process and 370 ms alone. A child process per (size, batch kind, trainer) times each row on a model of its
own; the first child of each shape also times the bound (the report shows one bound per shape). With `--resume` a
run too long for one sitting goes on where its file stops.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.trl_step_rows import BOUND


def child_command(args, size: int, kind: str, trainer: str, out: str, bound: bool) -> list[str]:
    """The command line of the child that times `trainer` on one batch kind and size."""
    command = [sys.executable, "-m", "benchmarks.trl_step", "--model", args.model, "--batches", kind,
               "--sizes", str(size), "--trainers", trainer, "--repeats", str(args.repeats),
               "--generation", str(args.generation), "--processes", "one", "--out", out]  # fmt: skip
    if not args.gradient_checkpointing:
        command.append("--no-gradient-checkpointing")
    if not bound:
        command.append("--no-bound")
    return command


def child_rows(out: Path, name: str, which: dict, returncode: int) -> tuple[list[dict], dict | None]:
    """(the child's rows, its file's versions and date): where the row of `which` (its shape, model, batch, size and
    method) is missing (the child died before writing it), a row that says so."""
    path = out / name
    data = json.loads(path.read_text()) if path.exists() else {"rows": []}
    rows = data["rows"]
    if not any(row["method"] == which["method"] for row in rows):
        rows.append({**which, "status": f"its process exited with code {returncode} before the row was written"})
    return rows, ({"versions": data["versions"], "date": data["date"]} if "versions" in data else None)


def earlier_rows(path: Path, resume: bool) -> tuple[list[dict], dict]:
    """With `--resume`, the rows `path` holds that were measured (a failed row is measured again) and its versions
    and date; else none."""
    meta = {"versions": {"gpu": None}, "date": None}
    if not (resume and path.exists()):
        return [], meta
    data = json.loads(path.read_text())
    return [row for row in data["rows"] if "ms" in row], {"versions": data["versions"], "date": data["date"]}


def sweep_in_processes(args, path: Path, shape_of) -> None:
    """Every (size, batch kind, trainer) of `args` timed in a child process, in order; `path` rewritten with the
    rows gathered so far after each child. With `--resume`, the rows `path` already holds are kept and not timed
    again (a run longer than one sitting, in parts). `shape_of(kind, size)` is a row's shape label."""
    rows, meta = earlier_rows(path, args.resume)
    for size in map(int, args.sizes.split(",")):
        for kind in args.batches.split(","):
            shape = shape_of(kind, size)
            for trainer in args.trainers.split(","):
                if any(row["shape"] == shape and row["method"] == trainer for row in rows):
                    continue
                bound = not any(row["shape"] == shape and row["method"] == BOUND for row in rows)
                started = time.perf_counter()
                with tempfile.TemporaryDirectory(prefix="trl-step-child-") as out:
                    done = subprocess.run(child_command(args, size, kind, trainer, out, bound), check=False)
                    which = {"shape": shape, "model": args.model, "batch": kind, "size": size, "method": trainer}
                    more, found = child_rows(Path(out), path.name, which, done.returncode)
                rows += more
                meta = found or meta
                path.write_text(json.dumps({**meta, "rows": rows}, indent=1))
                print(f"[trl-step] {shape} {trainer}: its process took "
                      f"{time.perf_counter() - started:.0f} s", flush=True)  # fmt: skip
