"""`make bench-fleet`: a small fleet run, pooled and alone, through to its report section."""

from __future__ import annotations

from pathlib import Path

import nightjar_data

from benchmarks.sim_fleet import LEARNER, Setup, main, run_fleet
from policy_server.sim.profile import builtin_profiles
from policy_server.sim.runs import ProfileAssets
from policy_server.sim.workload import read_trace


def test_late_joiners_pool_the_evidence_of_those_before_them(tmp_path: Path) -> None:
    profile = builtin_profiles(nightjar_data.ROOT / "calibration")["llama2-7b-a100"]
    assets = ProfileAssets.build(profile, tmp_path)
    trace = read_trace(nightjar_data.ROOT / "traces" / "azure_llm_2023_conv.csv")
    setup = Setup(
        engines=3, join_gap_s=10.0, seconds=20.0, qps=4.0, interval_s=2.0, ttl_s=60.0, seed=1
    )
    alone, lone = run_fleet(profile, assets, trace, setup, pooled=False)
    pooled, sources = run_fleet(profile, assets, trace, setup, pooled=True)
    assert [j.index for j in pooled] == [0, 1, 2]
    assert not any(s.round_cpu_s for s in lone)
    # The last joiner saw both earlier members; each learner holds its own steps once.
    assert max(sources[-1].members_seen) == 3
    for source in sources:
        local, fleet = source.goodput.evidence(LEARNER)
        steps = source.goodput._book.learners[LEARNER].steps
        assert local["steps"] + fleet["steps"] == steps
    first_local = sources[0].goodput.evidence(LEARNER)[0]["steps"]
    assert sources[-1].goodput.evidence(LEARNER)[1]["steps"] >= first_local * 0.5
    assert alone[0] == pooled[0]  # the first member has no one to pool with


def test_the_report_section_is_written(tmp_path: Path) -> None:
    out = tmp_path / "BENCHMARKS.md"
    argv = ["--out", str(out), "--engines", "2", "--seconds", "15", "--join-gap", "5"]
    assert main([*argv, "--profiles", "llama2-7b-a100"]) == 0
    text = out.read_text()
    assert "<!-- bench-fleet:begin -->" in text
    assert text.count("| llama2-7b-a100 |") == 2  # the comparison and the cost rows
