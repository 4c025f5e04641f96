"""The isolation benchmark's summary and report (its figures live in docs/BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.isolation import CASES, CONTROL_SUFFIX, LOADS, render, summary
from benchmarks.report import write_section


def test_summary_counts_round_trips_past_the_deadline() -> None:
    latencies = [0.001] * 98 + [0.003, 0.5]
    row = summary(latencies, calls=7)
    assert row["round_trips"] == 100
    assert row["p50_ms"] == 1.0 and row["max_ms"] == 500.0
    assert row["past_deadline"] == 0.02 and row["load_calls"] == 7


def test_the_section_names_the_host_each_case_and_its_load(tmp_path: Path) -> None:
    assert set(CASES) == set(LOADS)
    results = {
        "host": {"cpus": 2, "loadavg_at_start": ["1.0", "2.0", "3.0"], "python": "3.11.7"},
        "seconds_per_case": 20.0,
        "state_bytes": 44_749_515,
        "cases": {case: summary([0.001, 0.002, 0.004], 3) for case in CASES},
    }
    results["cases"][f"contexts{CONTROL_SUFFIX}"] = summary([0.001], 5)
    results["cases"]["contexts"].update(full_collections=3, full_collection_ms=12.5)
    text = render(results)
    # The probed sidecar's full collections where measured; older results have none.
    assert "| 3 | 3 (12.5) |" in text and "| 3 | not measured |" in text
    assert "2 CPUs" in text and "1.0, 2.0, 3.0" in text and "44,749,515 bytes" in text
    for case in CASES:
        assert f"| {case} | {LOADS[case]} | 3 |" in text
    # The control row says whose load it repeats, and where.
    assert (
        f"| contexts{CONTROL_SUFFIX} | the same load as `contexts`, on a second sidecar "
        "process (the control) | 1 |"
    ) in text
    report = tmp_path / "BENCHMARKS.md"
    write_section(report, "bench-isolation", text)
    assert "<!-- bench-isolation:begin -->" in report.read_text()


def test_the_section_says_other_work_ran_only_when_the_load_average_says_so() -> None:
    def header(cpus: int, load: str) -> str:
        host = {"cpus": cpus, "model": "Xeon", "loadavg_at_start": [load, "0", "0"]}
        results = {"host": {**host, "python": "3.12.3"}, "seconds_per_case": 1.0, "cases": {}}
        return render(results)

    assert "other work was running" in header(2, "1.92")
    quiet = header(16, "0.20")
    assert "other work was running" not in quiet
    assert "16 CPUs (Xeon; load average 0.20, 0, 0 at the start)" in quiet
