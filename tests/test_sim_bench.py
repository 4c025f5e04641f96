"""The simulator benchmark's report: every cell rendered, targets judged from the numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from policy_server.sim.bench import POLICIES, BenchConfig, Cell, main, render


def test_render_marks_targets_from_the_figures() -> None:
    cells = {}
    for policy in POLICIES:
        tput = {"oracle": 100.0, "nightjar": 90.0, "static-1": 95.0}.get(policy, 80.0)
        regret = {"oracle": 0.0, "nightjar": 50.0}.get(policy, 10.0)
        cells[("p", "w", policy)] = [Cell("p", "w", policy, tput, 1.0, 2.0, 10.0, 1000, regret)]
    sweep = {"p": {"nightjar": [(1.0, 90.0, 2.5), (4.0, 300.0, 7.25)]}}
    config = BenchConfig(Path("data"), [1], quick=True)
    text = render(cells, ["p"], ["w"], config, sweep, [Path("docs/img/a.png")], Path("docs"))
    assert "| nightjar | 90 | 0.900 | 1.00 | 2.00 | 10.0 | 5.00 |" in text
    # 0.90 < 0.95 × oracle and below static-1; above ema and table (80).
    assert "| p | w | 0.900 | **no** | **no** | yes | yes | 0.800 |" in text
    assert "| nightjar | 90 (2.5) | 300 (7.2) |" in text
    assert "![a](img/a.png)" in text
    assert "make bench-quick" in text


@pytest.mark.slow
def test_quick_bench_runs_end_to_end(tmp_path: Path) -> None:
    """The CI smoke run of `make bench-quick`: report section and every figure written."""
    report, plots = tmp_path / "BENCHMARKS.md", tmp_path / "img"
    assert main(["--quick", "--out", str(report), "--plots", str(plots)]) == 0
    text = report.read_text()
    for profile in ("llama2-7b-a100", "llama2-70b-h100-tp4"):
        for workload in ("low", "high", "step", "burst", "azure-conv"):
            assert f"### {profile} — {workload}" in text
        assert f"sim_gamma_{profile}.png" in text
    assert "Nightjar against the targets" in text and "Throughput vs offered load" in text
    figures = sorted(plots.glob("*.png"))
    assert len(figures) == 8
    assert all(f.read_bytes().startswith(b"\x89PNG") for f in figures)
