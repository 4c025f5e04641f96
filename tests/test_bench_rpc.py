"""The benchmark's measuring and reporting code (figures themselves live in docs/BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

from policy_server.bench_rpc import BEGIN, END, Measurement, measure_in_process, write_section


def test_in_process_measurement_is_sane() -> None:
    results = measure_in_process(samples=300)
    assert [m.case for m in results] == [
        "NightjarPolicy.decide",
        "DecisionService.decide",
        "DecisionService.decide + report",
    ]
    for m in results:
        assert isinstance(m, Measurement) and m.samples > 0
        assert 0 < m.p50_us <= m.p99_us


def test_report_section_is_replaced_in_place(tmp_path: Path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    write_section(path, f"{BEGIN}\nfirst\n{END}\n")
    path.write_text(path.read_text() + "\n## Simulator\nkept\n")
    write_section(path, f"{BEGIN}\nsecond\n{END}\n")
    text = path.read_text()
    assert "second" in text and "first" not in text and "## Simulator\nkept" in text
    assert text.count(BEGIN) == 1
