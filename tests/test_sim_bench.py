"""The simulator benchmark's report: every cell rendered, targets judged from the numbers."""

from __future__ import annotations

from policy_server.sim.bench import POLICIES, Cell, render


def test_render_marks_targets_from_the_figures() -> None:
    cells = {}
    for policy in POLICIES:
        tput = {"oracle": 100.0, "nightjar": 90.0, "static-1": 95.0}.get(policy, 80.0)
        cells[("p", "w", policy)] = [Cell("p", "w", policy, tput, 1.0, 2.0, 10.0)]
    text = render(cells, ["p"], ["w"], [1], quick=True)
    assert "| nightjar | 90 | 0.900 |" in text
    # 0.90 < 0.95 × oracle and below static-1; above ema and table (80).
    assert "| p | w | 0.900 | **no** | **no** | yes | yes |" in text
