"""`make demo` end to end, on a short run."""

from __future__ import annotations

from policy_server.demo import run


def test_demo_drives_a_real_sidecar_and_learns_per_batch_size() -> None:
    summary = run(steps_scale=0.1, seed=1, quiet=True)
    assert summary["sidecar_decisions"] > 0
    learned = summary["learned_best_gamma"]
    assert isinstance(learned, dict) and learned  # read back over the admin API
    assert set(summary["phases"]) == {"low load", "high load", "low again"}  # type: ignore[arg-type]
