"""The numerics audit of the fused GRPO loss and of the per-token primitive under it, with a verdict and the
evidence (`python -m audits` in a checkout, `compiled-grpo-audit` after an install; it needs the `audit` extra:
numpy, scipy, matplotlib and rich).

Exit status 0 when every cell passes, 1 when any fails, 2 on a selection that checks nothing or missing extras.
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import time
import warnings
from pathlib import Path

import torch

from compiled_grpo import LOSS_TYPES

# What the audit imports beyond torch (the `audit` extra); checked before any of it is imported, so that a plain
# install says what to install instead of failing on the first import.
EXTRAS = ("numpy", "scipy", "matplotlib", "rich")
DESCRIPTION = """The numerics audit of the fused GRPO loss and of the per-token primitive under it, against the float64
reference, numpy and scipy: a table, audit.md with plots, and the exit status (0 when every cell passes, 1 when
any fails, 2 on a selection that checks nothing or missing packages). It needs numpy, scipy, matplotlib and rich:
pip install 'compiled-grpo[audit]'."""

AUDITS = ("loss", "logprobs", "quantile", "entropy")
DTYPE_CHOICES = ("float32", "bfloat16", "fp32-head")  # fp32-head: bf16 hidden states, a float32 lm_head
MODES = ("eager", "compiled", "captured")  # captured: compiled, the work as CUDA graph replays (GPU only)


def program_name() -> str:
    """How the audit was started: `compiled-grpo-audit` (the installed script), `python -m compiled_grpo.audits`
    (the installed package) or `python -m audits` (a checkout)."""
    started = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    if started.name.startswith("compiled-grpo-audit"):
        return started.name
    return "python -m compiled_grpo.audits" if started.parent.parent.name == "compiled_grpo" else "python -m audits"


def comma_list(ap, flag: str, text: str, valid: tuple[str, ...]) -> tuple[str, ...]:
    """A comma-separated subset of `valid`, in the given order; an error naming the valid values otherwise."""
    values = tuple(dict.fromkeys(v.strip() for v in text.split(",") if v.strip()))
    unknown = [v for v in values if v not in valid]
    if unknown or not values:
        why = f"unknown value(s) {unknown}" if unknown else "selects nothing"
        ap.error(f"{flag} {text!r}: {why}; valid values: {', '.join(valid)}")
    return values


def usage_examples(prog: str) -> str:
    return (
        f"{prog}                        # --quick: every loss type x IS level x quantile x dtype x mode\n"
        f"{prog} --full                 # larger sizes, two seeds, more vocabulary sizes, 2**24+ ties\n"
        f"{prog} --device cuda --out audit-report"
    )


def missing_extras() -> list[str]:
    return [name for name in EXTRAS if not installed(name)]


def installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


def parse(argv):
    prog = program_name()
    ap = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=usage_examples(prog),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the default: small sizes, one seed")
    size.add_argument("--full", action="store_true", help="larger sizes, two seeds, more vocabularies")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--dtype", choices=(*DTYPE_CHOICES, "both", "all"), default="all",
                    help="all (the default): float32, bfloat16 and fp32-head (bf16 hidden states, float32 lm_head); "
                    "both: float32 and bfloat16")  # fmt: skip
    ap.add_argument("--modes", default=None, help=f"comma-separated subset of: {', '.join(MODES)} (default: every "
                    "mode the device has; captured needs --device cuda)")  # fmt: skip
    ap.add_argument("--loss-types", default=",".join(LOSS_TYPES),
                    help=f"comma-separated subset of: {', '.join(LOSS_TYPES)}")  # fmt: skip
    ap.add_argument("--only", default=",".join(AUDITS), help=f"comma-separated subset of: {', '.join(AUDITS)}")
    ap.add_argument(
        "--out",
        default="audit-report",
        help="folder for audit.md and the PNG plots (a run replaces the report and plots there)",
    )
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available")
    on_device = MODES if args.device == "cuda" else tuple(m for m in MODES if m != "captured")
    args.modes = comma_list(ap, "--modes", ",".join(on_device) if args.modes is None else args.modes, MODES)
    if "captured" in args.modes and args.device != "cuda":
        ap.error("--modes captured: captured calls are CUDA graphs; add --device cuda")
    args.loss_types = comma_list(ap, "--loss-types", args.loss_types, LOSS_TYPES)
    args.only = set(comma_list(ap, "--only", args.only, AUDITS))
    return args


def main(argv=None) -> int:
    args = parse(argv)
    missing = missing_extras()
    if missing:
        print(f"{program_name()}: the audit needs {', '.join(EXTRAS)}; missing: {', '.join(missing)}. Install them "
              f"with: pip install 'compiled-grpo[audit]'", file=sys.stderr)  # fmt: skip
        return 2
    return run(args)


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from . import entropy_audit, logprobs_audit, loss_audit, quantile_audit, report

    console = Console() if sys.stdout.isatty() else Console(width=150)  # logs and CI: do not squeeze the table
    warnings.filterwarnings("ignore", message=".* is meant for importance_sampling_level")
    dtypes = {"both": DTYPE_CHOICES[:2], "all": DTYPE_CHOICES}.get(args.dtype, (args.dtype,))
    size, seeds = (loss_audit.FULL, (0, 1)) if args.full else (loss_audit.QUICK, (0,))
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 checks mean fp32 GEMMs
    cells = loss_audit.loss_cells(args.loss_types, dtypes, args.modes) if "loss" in args.only else []
    primitive = logprobs_audit.cells(dtypes, args.modes) if "logprobs" in args.only else []
    total = len(cells) * len(seeds) + len(primitive)
    total += quantile_audit.steps(args.full) if "quantile" in args.only else 0
    total += entropy_audit.steps(args.full) if "entropy" in args.only else 0
    started = time.time()
    results = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    lines = ProgressLines(total, every_s=10.0) if not sys.stdout.isatty() else None
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("auditing", total=total)

        def advance():
            progress.advance(task)
            if lines is not None:  # a log or CI: the bar is not drawn, so say how far it is now and then
                lines.advance()

        if cells:
            progress.update(task, description="loss cells (the first compiled cells compile the tiles)")
            results += loss_audit.run(cells, size, args.device, seeds, advance)
        if primitive:
            progress.update(task, description="fused_linear_logprobs against the float64 primitive")
            results += logprobs_audit.run(primitive, size, args.device, advance)
        if "quantile" in args.only:
            progress.update(task, description="entropy threshold vs numpy / scipy")
            results += quantile_audit.run(args.full, advance)
        if "entropy" in args.only:
            progress.update(task, description="streaming entropy vs scipy")
            results += entropy_audit.run(args.full, advance)
    report.print_table(results, console)
    if not results:  # every selection above is non-empty, so this would be a bug: never a PASS on nothing
        console.print("[bold red]no audit cell ran: nothing was checked[/]")
        return 2
    out = report.clean_folder(Path(args.out))
    header = [
        f"- sweep: {'full' if args.full else 'quick'}; device {args.device}; dtypes {', '.join(dtypes)}; "
        f"modes {', '.join(args.modes)}; loss types {', '.join(args.loss_types)}",
        f"- loss batch: B={size.B}, T={size.T}, H={size.H}, V={size.V}, seeds {list(seeds)}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}; "
        f"{time.time() - started:.0f} s",
    ]
    plots = report.write_plots(results, out)
    path = report.write_markdown(results, out, header, plots)
    line = report.summary(results)
    console.print(f"[bold {'green' if line.startswith('PASS') else 'red'}]{line}[/]")
    console.print(f"report: {path} ({len(plots)} plots)")
    return 0 if all(r.passed for r in results) else 1


class ProgressLines:
    """Plain progress lines for output that is not a terminal: `[audit] done/total cells, elapsed`, at most one per
    `every_s` seconds, and the last one."""

    def __init__(self, total: int, every_s: float):
        self.total, self.every_s, self.done = total, every_s, 0
        self.started = self.last = time.monotonic()

    def advance(self) -> None:
        self.done += 1
        now = time.monotonic()
        if now - self.last >= self.every_s or self.done == self.total:
            self.last = now
            print(f"[audit] {self.done}/{self.total} done, {now - self.started:.0f} s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
