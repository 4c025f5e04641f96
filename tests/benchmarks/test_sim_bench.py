"""The simulator benchmark's report: every cell rendered, targets judged from the numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import sim_mixed
from benchmarks import sim_traces as bench_traces
from benchmarks.sim_matrix import main, render
from policy_server.sim.runs import MIXED, MIXED_POLICIES, BenchConfig, Cell


def test_render_marks_targets_from_the_figures() -> None:
    config = BenchConfig(Path("data"), [1], quick=True)
    cells = {}
    for policy in config.policies:
        tput = {"oracle": 100.0, "goodput": 99.0, "static-1": 99.5, "ema": 99.5}.get(policy, 80.0)
        regret = {"oracle": 0.0, "goodput": 50.0}.get(policy, 10.0)
        latency = {"goodput": 1.5, "table": 1.2}.get(policy, 3.0)
        cells[("p", "w", policy)] = [Cell("p", "w", policy, tput, latency, 2.0, 10.0, 1000, regret)]
    sweep = {"p": {"goodput": [(1.0, 90.0, 2.5), (4.0, 300.0, 7.25)]}}
    text = render(cells, ["p"], ["w"], config, sweep, [Path("docs/img/a.png")], Path("docs"))
    assert "| goodput | 99 | 0.990 | 1.50 | 2.00 | 10.0 | 5.00 |" in text
    # ≥ 0.98 oracle, ≥ 0.99 × static-1, ≥ 0.99 × off; below ema (99.5); above table (80);
    # the table policy's 1.2 s mean latency beats goodput's 1.5 s.
    assert "| p | w | 0.990 | yes | yes | yes | **no** | yes | 1.50 | 1.20 (table) **lower** |" in (
        text
    )
    assert "| goodput | 90 (2.5) | 300 (7.2) |" in text
    assert "![a](img/a.png)" in text
    assert "make bench-quick" in text


def test_mixed_section_puts_both_populations_side_by_side_and_dsde_against_the_batch() -> None:
    config = BenchConfig(Path("data"), [1, 2], quick=True)
    tpot = {"dsde": 9.0, "static-2": 10.0, "goodput": 12.0}
    regret = {"oracle-per-request": -20.0}  # 2 % more tokens per step time than the oracle
    cells = {
        ("p", workload, policy): [
            Cell(
                "p",
                workload,
                policy,
                100.0 + s,
                1.0,
                2.0,
                tpot.get(policy, 20.0) + s,
                1000,
                regret.get(policy, 5.0),
            )
            for s in (0, 2)  # two seeds
        ]
        for mixed, (base, _) in MIXED.items()
        for workload in (base, mixed)
        for policy in MIXED_POLICIES
    }
    text = sim_mixed.render(cells, ["p"], config, "the command")
    assert "by `the command`" in text
    assert "### p — `step` arrivals: `chat-sps` beside `code-writing`" in text
    # Homogeneous means, then the mixed ones with the seeds' range.
    row = "| dsde | 101 | 1.00 | 10.0 | 0.50 | 101 (100–102) | 1.000 | 1.00 | 10.0 (9.0–11.0) |"
    assert row in text
    # TPOT 10 against goodput's 13 and the best batch policy's (static-2) 11.
    assert "| p | `step-mix` | 1.000 | 0.769 | static-2 (11.0) | 1.000 | 0.909 |" in text
    # The per-sequence mode against the default seed by seed, with the default's spread:
    # no gain at all meets the homogeneous target and misses the mixed one.
    assert "### `goodput-per-request` against `goodput`: the targets" in text
    paired = "| 1.000 (1.000–1.000) | 1.98% | 1.000 (1.000–1.000) | 0.00% | 1.615 (1.571–1.667)"
    # Once, however many mixes replay the homogeneous workload's arrivals.
    assert text.count(f"| p | `step` {paired} | met |") == 1
    assert f"| p | `step-mix` {paired} | missed |" in text
    # The ceiling: the per-request oracle's goodput gain over the batch oracle (from the
    # regret), judged by the same targets; level on e2e, it misses the mixed one.
    assert "### The ceiling: `oracle-per-request` against `oracle`" in text
    level = "1.000 (1.000–1.000) | 1.98% | 1.000 (1.000–1.000) | 0.00% | 1.000 (1.000–1.000)"
    assert f"| p | `step-mix` | +2.00 % (+2.00–+2.00) | {level} | missed |" in text
    assert f"| p | `step` | +2.00 % (+2.00–+2.00) | {level} | met |" in text


def test_mixed_jobs_skip_the_homogeneous_cells_the_matrix_ran() -> None:
    jobs = sim_mixed.jobs(("goodput",))
    assert ("step", "nightjar") in jobs and ("step", "goodput") not in jobs
    assert all((mixed, p) in jobs for mixed in MIXED for p in MIXED_POLICIES)
    # The homogeneous cells once each, however many mixes replay their arrivals.
    everything = sim_mixed.jobs(())
    bases = {base for base, _ in MIXED.values()}
    assert len(bases) < len(MIXED) and len(set(everything)) == len(everything)
    assert len(everything) == (len(MIXED) + len(bases)) * len(MIXED_POLICIES)


@pytest.mark.slow
def test_quick_bench_runs_end_to_end(tmp_path: Path) -> None:
    """The CI smoke run of `make bench-quick`: report section and every figure written."""
    report, plots = tmp_path / "BENCHMARKS.md", tmp_path / "img"
    assert main(["--quick", "--out", str(report), "--plots", str(plots)]) == 0
    text = report.read_text()
    for profile in ("llama2-7b-a100", "llama2-70b-h100-tp4"):
        for workload in ("low", "high", "step", "burst", "azure-conv", "drift"):
            assert f"### {profile} — {workload}" in text
        assert f"{profile} — step, SLO" in text
        assert f"sim_gamma_{profile}.png" in text
    assert "against the targets" in text and "Throughput vs offered load" in text
    assert "mixed populations and per-sequence γ" in text and "| dsde | " in text
    figures = sorted(plots.glob("*.png"))
    assert len(figures) == 8
    assert all(f.read_bytes().startswith(b"\x89PNG") for f in figures)


@pytest.mark.slow
def test_unseen_traces_bench_runs_end_to_end(tmp_path: Path) -> None:
    """`make bench-traces` on the first 20 s of each trace: both traces are read from the
    shipped data, every policy runs on both profiles, and the targets are judged."""
    report = tmp_path / "BENCHMARKS.md"
    assert bench_traces.main(["--out", str(report), "--seeds", "1", "--seconds", "20"]) == 0
    text = report.read_text()
    for profile in ("llama2-7b-a100", "llama2-70b-h100-tp4"):
        for workload in ("azure-code", "mooncake-conv"):
            assert f"### {profile} — {workload}" in text
            assert f"| {profile} | {workload} | " in text
    assert text.count("| oracle | ") == 4 and "| dsd | " in text
