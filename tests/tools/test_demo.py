"""`make demo` end to end, on a short slice of the trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from nightjar_common.types import BinType
from tools.demo import COMPARED, SIDECAR, run


def test_demo_replays_the_trace_through_a_real_sidecar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = run(seconds=20, seed=1, out=tmp_path)  # the shipped data
    assert summary["sidecar_decisions"] > 0
    # Every simulated step with a decode batch was decided by the sidecar or the fallback.
    assert summary["sidecar_decisions"] + summary["fallbacks"] == summary["decided_steps"]
    # The live lines name how the sidecar chose each γ (from its decision tables, the
    # client's default), "fallback" only where the client fell back: most steps were the
    # sidecar's, so most lines name a bin.
    live = capsys.readouterr().out.split("sim time", 1)[1].split("\n\n", 1)[0]
    bins = [line.split()[4] for line in live.splitlines()[1:]]  # after the header
    named = [b for b in bins if b in {kind.value for kind in BinType}]
    assert bins and len(named) > len(bins) / 2, bins
    assert summary["learned_best_gamma"]  # read back over the admin API
    cells = summary["cells"]
    assert set(cells) == {SIDECAR, *COMPARED}
    assert all(c.generated_tokens > 0 for c in cells.values())
    assert cells["oracle"].regret_tokens == 0.0
    for figure in summary["figures"]:
        assert figure.parent == tmp_path and figure.read_bytes().startswith(b"\x89PNG")
