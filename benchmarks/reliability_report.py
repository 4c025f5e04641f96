"""`make reliability-report`: the "Reliability" section of docs/BENCHMARKS.md.

Every reliability target (fuzz, bounded memory, soak, chaos, durable state, security)
writes its result to ``docs/reliability/<name>.json``: one object, or a list of them, with
the keys of :data:`FIELDS`. This renders all of them, in file-name order, into one table
(test | what was done | figure | pass/fail | date, machine and command of the run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.report import write_section

SECTION = "reliability"
FIELDS = ("test", "what", "figure", "passed", "date", "machine", "command")


class ResultError(ValueError):
    """A result file that is not in the format above."""


@dataclasses.dataclass(frozen=True, slots=True)
class Result:
    test: str
    what: str
    figure: str
    passed: bool
    date: str
    machine: str
    command: str
    source: str  # the file it came from, repository-relative

    def row(self) -> str:
        cells = (
            self.test,
            self.what,
            self.figure,
            "pass" if self.passed else "**FAIL**",
            f"{self.date}, {self.machine}, `{self.command}`",
        )
        return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _cell(text: str) -> str:
    # A table cell is one line, and a pipe would end it.
    return " ".join(text.split()).replace("|", "\\|")


def load(directory: Path) -> list[Result]:
    """Every result under ``directory``; ResultError names the file and what is wrong."""
    results = []
    for path in sorted(directory.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ResultError(f"{path}: not readable JSON ({exc})") from exc
        for item in data if isinstance(data, list) else [data]:
            results.append(_result(item, f"{directory.name}/{path.name}"))
    return results


def _result(item: Any, source: str) -> Result:
    if not isinstance(item, dict):
        raise ResultError(f"{source}: a result must be a JSON object, got {type(item).__name__}")
    missing = [name for name in FIELDS if name not in item]
    if missing:
        raise ResultError(f"{source}: missing {', '.join(missing)}")
    if not isinstance(item["passed"], bool):
        raise ResultError(f"{source}: 'passed' must be true or false")
    text = {name: str(item[name]) for name in FIELDS if name != "passed"}
    return Result(passed=item["passed"], source=source, **text)


def render(results: Sequence[Result]) -> str:
    passed = sum(r.passed for r in results)
    lines = [
        "## Reliability",
        "",
        "Each row is one run of the target named in its last column, which wrote the row's "
        "`docs/reliability/*.json`; `make reliability-report` (`policy_server/"
        "reliability_report.py`) renders them here. "
        f"{passed} of {len(results)} passed.",
        "",
        "| Test | What was done | Figure | Result | Run (date, machine, command) |",
        "|---|---|---|---|---|",
        *(r.row() for r in results),
    ]
    if not results:
        lines.append("| (no results yet) | | | | |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reliability-report", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=Path("docs/reliability"))
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    args = parser.parse_args(argv)
    try:
        results = load(args.results)
    except ResultError as exc:
        parser.exit(1, f"reliability-report: {exc}\n")
    write_section(args.out, SECTION, render(results))
    print(f"{len(results)} results -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
