"""`make demo` end to end, on a short slice of the trace."""

from __future__ import annotations

from pathlib import Path

from tools.demo import COMPARED, SIDECAR, run


def test_demo_replays_the_trace_through_a_real_sidecar(tmp_path: Path) -> None:
    summary = run(seconds=20, seed=1, out=tmp_path, quiet=True)  # the shipped data
    assert summary["sidecar_decisions"] > 0
    # Every simulated step with a decode batch was decided by the sidecar or the fallback.
    assert summary["sidecar_decisions"] + summary["fallbacks"] == summary["decided_steps"]
    assert summary["learned_best_gamma"]  # read back over the admin API
    cells = summary["cells"]
    assert set(cells) == {SIDECAR, *COMPARED}
    assert all(c.generated_tokens > 0 for c in cells.values())
    assert cells["oracle"].regret_tokens == 0.0
    for figure in summary["figures"]:
        assert figure.parent == tmp_path and figure.read_bytes().startswith(b"\x89PNG")
