"""The simulator benchmark's report: every cell rendered, targets judged from the numbers."""

from __future__ import annotations

from pathlib import Path

from policy_server.sim.bench import POLICIES, BenchConfig, Cell, render


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
