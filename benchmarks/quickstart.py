"""README's quick-start times, from the `.ci/run` log that measured them.

`.ci/run` prints `[ci] <seconds> s: <command>` after each command, the audit its `PASS: n/n` line and pytest its
summary line. This reads such a log into `docs/ci/quickstart.json` (the stored run; its commands, times and
summary lines are kept in `docs/ci/ci-run.log`) and writes README's table
between its markers from it (nothing, where no run is stored); `--check` fails when README's table and the stored
run disagree (a test runs it).

    bash .ci/run 2>&1 | tee ci.log     # in a fresh clone, Inductor's cache emptied first
    python -m benchmarks.quickstart --log ci.log --note "..."
    python -m benchmarks.quickstart --check
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "docs" / "ci" / "quickstart.json"
START, END = "<!-- quick-start times: written by `python -m benchmarks.quickstart` from docs/ci -->", "<!-- end -->"
ROWS = {  # README's rows: the commands as .ci/run prints them
    'pip install -e ".[audit,test]" && python -m audits': 'pip install -e ".[audit,test]" && python -m audits',
    "python -m pytest -n 2": "python -m pytest -n 2",
    "python examples/train_tiny_grpo.py": "python examples/train_tiny_grpo.py",
}


def read_log(text: str) -> dict:
    """The quick-start commands' seconds (the first time each ran: the quick start's environment), the audit's
    summary and the first pytest summary after it, and the whole run's seconds."""
    seconds = {}
    for found in re.finditer(r"^\[ci\] (\d+) s: (.+)$", text, flags=re.M):
        seconds.setdefault(found.group(2).strip(), int(found.group(1)))
    audit = re.search(r"^(PASS|FAIL)[^\n]*", text, flags=re.M)
    tests = re.search(r"^=* ?(\d+ passed[^\n]*?) in [\d.]+s", text, flags=re.M)
    total = re.search(r"^\[ci\] total (\d+) s", text, flags=re.M)
    missing = [command for command in ROWS if command not in seconds]
    if missing or audit is None or tests is None:
        raise ValueError(f"not a complete .ci/run log: missing {missing or ''} {'' if audit else 'the audit line'} "
                         f"{'' if tests else 'the pytest summary'}".strip())  # fmt: skip
    return {"seconds": {command: seconds[command] for command in ROWS}, "audit": audit.group(0).strip(),
            "tests": tests.group(1).strip(), "total_s": int(total.group(1)) if total else None}  # fmt: skip


def table(run: dict) -> str:
    cells = {
        'pip install -e ".[audit,test]" && python -m audits': f"the install included; {run['audit']}",
        "python -m pytest -n 2": run["tests"],
        "python examples/train_tiny_grpo.py": "after the tests, which left compiled tiles in Inductor's cache",
    }
    lines = [
        f"How long they take on a 2-core CPU, measured by `.ci/run` in a fresh clone ({run['note']}; run "
        f"{run['date']}; the whole `.ci/run` took {run['total_s']} s):",
        "",
        "| command | seconds | what ran |",
        "|---|---|---|",
    ]
    lines += [f"| `{command}` | {run['seconds'][command]} | {cells[command]} |" for command in ROWS]
    return "\n".join(lines)


def readme_with(readme: str, run: dict | None) -> str:
    """README with the stored run's table between the markers; with no stored run, nothing between them."""
    if START not in readme or END not in readme[readme.index(START) :]:
        raise ValueError(f"README.md has no quick-start times markers ({START})")
    before, rest = readme.split(START, 1)
    body = "" if run is None else table(run) + "\n"
    return before + START + "\n" + body + END + rest.split(END, 1)[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log", help="a .ci/run log to store")
    parser.add_argument("--note", default="", help="how the run was made (caches, torch)")
    parser.add_argument("--date", help="the run's date (YYYY-MM-DD)")
    parser.add_argument("--check", action="store_true", help="fail where README.md's table is not the stored run's")
    args = parser.parse_args(argv)
    readme_path = ROOT / "README.md"
    if args.log:
        from benchmarks.timing import run_date

        run = {**read_log(Path(args.log).read_text()), "note": args.note, "date": args.date or run_date()}
        STORED.parent.mkdir(parents=True, exist_ok=True)
        STORED.write_text(json.dumps(run, indent=1) + "\n")
        kept = [
            line
            for line in Path(args.log).read_text().splitlines()
            if re.match(r"\[ci\]|\+ |PASS|FAIL|=* ?\d+ passed", line)
        ]
        STORED.with_name("ci-run.log").write_text("\n".join(kept) + "\n")  # the log's commands, times and summaries
    run = json.loads(STORED.read_text()) if STORED.exists() else None
    wanted = readme_with(readme_path.read_text(), run)
    if args.check:
        if wanted != readme_path.read_text():
            print(
                "README.md's quick-start times are not docs/ci/quickstart.json's: run python -m benchmarks.quickstart"
            )
            return 1
        return 0
    readme_path.write_text(wanted)
    print(table(run) if run else "no stored run: README shows no quick-start times")
    return 0


if __name__ == "__main__":
    sys.exit(main())
