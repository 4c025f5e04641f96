"""The Reliability section: rendered from the result files, in place in the report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.reliability_report import ResultError, load, main

RESULT = {
    "test": "Protocol fuzzing",
    "what": "every RPC | raw bytes",
    "figure": "100,000 requests",
    "passed": True,
    "date": "2026-11-23",
    "machine": "AMD EPYC, 2 cores",
    "command": "make fuzz",
}


def test_every_result_file_becomes_a_row_and_other_sections_stay(tmp_path: Path) -> None:
    results = tmp_path / "reliability"
    results.mkdir()
    (results / "fuzz.json").write_text(json.dumps({**RESULT, "details": {"requests": 1}}))
    soak = [
        {**RESULT, "test": "Soak", "figure": "RSS +3 %\nover 10 min", "command": "make soak"},
        {**RESULT, "test": "Soak swaps", "passed": False, "command": "make soak"},
    ]
    (results / "soak.json").write_text(json.dumps(soak))
    report = tmp_path / "BENCHMARKS.md"
    report.write_text(
        "# Benchmarks\n\n<!-- bench-rpc:begin -->\nrpc figures\n<!-- bench-rpc:end -->\n"
    )
    assert main(["--results", str(results), "--out", str(report)]) == 0
    text = report.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0] for row in rows[1:]] == [
        "| Protocol fuzzing",
        "| Soak",
        "| Soak swaps",
    ]
    assert "every RPC \\| raw bytes" in rows[1]  # a pipe in a cell is escaped
    assert "RSS +3 % over 10 min" in rows[2]  # one line per row
    assert rows[3].count("**FAIL**") == 1 and "2 of 3 passed" in text
    assert "2026-11-23, AMD EPYC, 2 cores, `make soak`" in rows[2]
    assert "rpc figures" in text  # another target's section is untouched
    # Re-rendering after a result changed replaces the section in place.
    (results / "soak.json").unlink()
    main(["--results", str(results), "--out", str(report)])
    again = report.read_text()
    assert again.count("## Reliability") == 1 and "Soak" not in again and "1 of 1 passed" in again


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "not readable JSON"),
        (json.dumps({"test": "x"}), "missing what"),
        (json.dumps({**RESULT, "passed": "yes"}), "'passed' must be"),
        ("[1]", "JSON object"),
    ],
)
def test_a_malformed_result_file_is_named(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "bad.json").write_text(content)
    with pytest.raises(ResultError, match=message) as info:
        load(tmp_path)
    assert "bad.json" in str(info.value)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.reliability_report",
            "--results",
            str(tmp_path),
            "--out",
            str(tmp_path / "B.md"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and "bad.json" in run.stderr and not (tmp_path / "B.md").exists()
