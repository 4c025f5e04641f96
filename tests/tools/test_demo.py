"""`make demo` end to end, on a short slice of the trace."""

from __future__ import annotations

from pathlib import Path

import nightjar_data
import pytest

from nightjar_common.client import TABLE_REFRESH_MS
from nightjar_common.types import BinType
from policy_server.policies import DEFAULT_POLICY
from policy_server.sim.acceptance import WORKLOADS
from policy_server.sim.engine import SimConfig, Simulator
from policy_server.sim.profile import builtin_profiles
from policy_server.sim.runs import GAMMA_MAX, Cell, ProfileAssets, summarise
from policy_server.sim.sources import TableSource
from tools.demo import COMPARED, ENGINE, SIDECAR, run, trace_slice

PROFILE = "llama2-7b-a100"


def test_demo_replays_the_trace_through_a_real_sidecar(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    summary = run(seconds=20, seed=1, out=tmp_path / "out")  # the shipped data
    assert summary["sidecar_decisions"] > 0
    # The simulation's pace costs no fallback, and its row is the product's table
    # protocol as the plugin runs it, with tables aging on the simulated clock.
    assert summary["fallbacks"] == 0
    assert summary["cells"][SIDECAR] == in_process_tables(tmp_path, seconds=20, seed=1)
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
        assert figure.parent == tmp_path / "out" and figure.read_bytes().startswith(b"\x89PNG")


def in_process_tables(tmp_path: Path, seconds: float, seed: int) -> Cell:
    """The demo's sidecar run decided in process: the sidecar's service and the client's
    table cache, refreshed every 32 steps or 200 simulated ms, as the plugin's client."""
    data = nightjar_data.ROOT
    profile = builtin_profiles(data / "calibration")[PROFILE]
    assets = ProfileAssets.build(profile, tmp_path)
    params = {"seed": seed, "gamma_max": GAMMA_MAX, "prefill_cost_table": assets.prefill_cost_table}
    source = TableSource.named(DEFAULT_POLICY, params, refresh_ms=TABLE_REFRESH_MS)
    config = SimConfig(seed=seed, gamma_max=GAMMA_MAX, engine_id=ENGINE, track_regret=True)
    specs = trace_slice(data, seconds, qps=4.0)
    result = Simulator(profile, WORKLOADS["chat-sps"], specs, source, config).run()
    return summarise(PROFILE, "azure-conv", SIDECAR, result)
