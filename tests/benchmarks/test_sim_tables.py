"""`make bench-tables`: one cell of the per-step against decision-tables comparison."""

from __future__ import annotations

from pathlib import Path

import nightjar_data

from benchmarks.sim_tables import REFRESHES, compare, main, render
from policy_server.sim.profile import builtin_profiles
from policy_server.sim.runs import BenchConfig, ProfileAssets, workloads


def test_a_cell_compares_per_step_with_each_refresh_period(tmp_path: Path) -> None:
    profile = builtin_profiles(nightjar_data.ROOT / "calibration")["llama2-7b-a100"]
    config = BenchConfig(
        nightjar_data.ROOT, [1], True, assets={profile.name: ProfileAssets.build(profile, tmp_path)}
    )
    specs = {1: workloads(nightjar_data.ROOT, 1, True)["low"]}
    row = compare(profile, "low", specs, config)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[:2] == ["llama2-7b-a100", "`low`"]
    assert len(cells) == 5 + 4 * len(REFRESHES)
    per_table = [float(cells[5 + 4 * i + 3]) for i in range(len(REFRESHES))]
    assert 1.0 < per_table[0] < per_table[1]  # a longer period serves more steps a table
    report = render([row], config)
    assert report.count("\n|---|") == 1 and report.endswith(row)


def test_bad_seed_count_is_a_usage_error(tmp_path: Path) -> None:
    try:
        main(["--seeds", "0", "--out", str(tmp_path / "B.md")])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--seeds 0 accepted")
    assert not (tmp_path / "B.md").exists()
