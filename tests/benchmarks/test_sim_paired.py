"""`make bench-sim-paired`'s statistics and report (the runs are the matrix's `simulate`,
tested with `make bench`'s)."""

from __future__ import annotations

import pytest

from benchmarks.sim_mixed import DEFAULT, MODE, comparison_rows
from benchmarks.sim_paired import (
    BATCH,
    COMPARISONS,
    Comparison,
    PairedRatio,
    paired_jobs,
    render,
    sign_test,
    t_quantile,
)
from policy_server.sim.runs import MIXED, Cell


@pytest.mark.parametrize(
    ("df", "quantile"),
    # Student's t, 97.5 % (any table of the distribution, to the digits printed).
    [(1, 12.706), (2, 4.303), (4, 2.776), (9, 2.262), (29, 2.045), (120, 1.980)],
)
def test_t_quantiles_are_the_tables(df: int, quantile: float) -> None:
    assert t_quantile(0.975, df) == pytest.approx(quantile, abs=0.001)


@pytest.mark.parametrize(
    ("lower", "higher", "p"),
    [(10, 0, 2 / 1024), (9, 1, 22 / 1024), (1, 9, 22 / 1024), (5, 5, 1.0), (0, 0, 1.0)],
)
def test_the_sign_test_is_the_binomial_tail(lower: int, higher: int, p: float) -> None:
    assert sign_test(lower, higher) == pytest.approx(p)


def cells_of(policy: str, figures: list[float]) -> list[Cell]:
    return [Cell("p", "w", policy, 100.0, value, 1.0, 30.0) for value in figures]


def test_a_figure_lower_in_every_seed_is_separated_and_one_that_straddles_is_not() -> None:
    default = cells_of(DEFAULT, [10.0, 20.0, 15.0, 12.0])
    lower = PairedRatio.of(cells_of(MODE, [9.8, 19.7, 14.8, 11.9]), default, "mean_latency")
    assert lower.lower == 4 and lower.high < 1 and lower.separation == "lower"
    assert lower.low < lower.centre < lower.high
    mixed = PairedRatio.of(cells_of(MODE, [9.0, 21.0, 14.0, 13.0]), default, "mean_latency")
    assert (mixed.lower, mixed.higher) == (2, 2) and mixed.separation == "not separated"
    higher = PairedRatio.of(cells_of(MODE, [10.5, 21.0, 15.6, 12.5]), default, "mean_latency")
    assert higher.separation == "higher"


def test_the_report_has_a_table_per_comparison_with_a_row_per_cell() -> None:
    cells = {}
    for profile, workload, _ in comparison_rows(["p"]):
        for comparison in COMPARISONS:
            # Every seed of the first policy 1 % lower on e2e than the second's, level on TPOT
            # and tok/s; the ceiling's pair 2 % higher.
            scale = 0.99 if comparison.mine == MODE else 1.02
            for policy, factor in ((comparison.theirs, 1.0), (comparison.mine, scale)):
                cells[(profile, workload, policy)] = [
                    Cell(profile, workload, policy, 100.0, factor * (10 + seed), 1.0, 30.0)
                    for seed in range(3)
                ]
    text = render(cells, ["p"], [1, 2, 3], "make bench-sim-paired")
    tables = text.split("\n### ")[1:]
    assert len(tables) == len(COMPARISONS)
    bases = {base for base, _ in MIXED.values()}
    for table, comparison in zip(tables, COMPARISONS, strict=True):
        assert f"`{comparison.mine}` against `{comparison.theirs}`" in table
        rows = [line for line in table.splitlines() if line.startswith("| p |")]
        assert len(rows) == len(MIXED) + len(bases)
        if comparison.mine == MODE:
            assert all("0.990 [0.990, 0.990] | 3/3, p 0.25" in row for row in rows)
            assert all(row.endswith("| lower |") for row in rows)
        else:
            assert all("1.020 [1.020, 1.020] | 0/3, p 0.25" in row for row in rows)
            assert all(row.endswith("| higher |") for row in rows)
    assert "seeds 1–3" in text


def test_a_policy_in_two_comparisons_runs_once_per_cell_and_seed() -> None:
    comparisons = [Comparison("a", "base", "", ""), Comparison("b", "base", "", "")]
    jobs = paired_jobs(["p", "q"], [1, 2], comparisons)
    assert len(jobs) == len(set(jobs))
    cells = len(list(comparison_rows(["p", "q"])))
    assert len(jobs) == cells * 3 * 2
    assert {policy for _, _, policy, _ in jobs} == {"a", "b", "base"}


def test_the_first_table_sets_the_default_against_the_batch_gamma() -> None:
    """Issue 57's yardstick: the default as it ships against its per-request mode forced
    off, both the simulator's named runs."""
    from policy_server.sim.runs import PER_REQUEST_MODE, POLICIES, ProfileAssets

    first = COMPARISONS[0]
    assert (first.mine, first.theirs) == (DEFAULT, BATCH)
    assets = ProfileAssets()
    default = POLICIES[DEFAULT](1, assets).policy  # type: ignore[attr-defined]
    batch = PER_REQUEST_MODE[BATCH](1, assets).policy  # type: ignore[attr-defined]
    assert default.params()["per_request"] == "auto"
    assert batch.params()["per_request"] is False


def test_only_the_default_runs_two_policies_and_renders_one_table() -> None:
    only = COMPARISONS[:1]
    jobs = paired_jobs(["p"], [1, 2], only)
    assert {policy for _, _, policy, _ in jobs} == {DEFAULT, BATCH}
    cells = {
        (profile, workload, policy): [Cell(profile, workload, policy, 100.0, 10.0, 1.0, 30.0)] * 2
        for profile, workload, _ in comparison_rows(["p"])
        for policy in (DEFAULT, BATCH)
    }
    text = render(cells, ["p"], [1, 2], "python -m benchmarks.sim_paired --only-default", only)
    assert text.count("\n### ") == 1 and f"`{DEFAULT}` against `{BATCH}`" in text
