"""Decision tables emulated in the simulator (TableSource, docs/DECISION_TABLES.md)."""

from __future__ import annotations

import nightjar_data

from policy_server.sim.acceptance import WORKLOADS
from policy_server.sim.engine import DecisionSource, SimConfig, SimResult, Simulator
from policy_server.sim.profile import builtin_profiles
from policy_server.sim.sources import PolicySource, TableSource
from policy_server.sim.workload import RatePhase, read_trace, synthetic

PROFILE = builtin_profiles(nightjar_data.ROOT / "calibration")["llama2-7b-a100"]
TRACE = read_trace(nightjar_data.ROOT / "traces" / "azure_llm_2023_conv.csv")
SPECS = synthetic([RatePhase(20, 6.0)], TRACE, seed=5)
GOODPUT = {"seed": 3, "gamma_max": 4, "warmup_steps": 20}


def simulate(source: DecisionSource) -> SimResult:
    return Simulator(PROFILE, WORKLOADS["chat-sps"], SPECS, source, SimConfig(seed=2)).run()


def test_a_table_of_one_step_decides_as_the_policy_asked_every_step() -> None:
    """Refreshed every step with one batch size, a table is the per-step decision: the same
    γ in every step, so committing an entry leaves the policy as deciding it would."""
    per_step = simulate(PolicySource.named("goodput", GOODPUT))
    tables = TableSource.named("goodput", GOODPUT, refresh_steps=1, half_width=0)
    through_tables = simulate(tables)
    assert [s.gamma for s in through_tables.steps] == [s.gamma for s in per_step.steps]
    assert tables.refreshes == sum(1 for s in per_step.steps if s.batch_size)


def test_tables_serve_several_steps_and_exploring_entries_run_once() -> None:
    tables = TableSource.named("goodput", GOODPUT, refresh_steps=8)
    decided = sum(1 for s in simulate(tables).steps if s.batch_size)
    assert decided / tables.refreshes > 3  # most steps run from a table already held
    # `random` explores in every decision: with one batch size a table, each entry runs
    # once and every step refreshes.
    explorer = TableSource.named(
        "random", {"gamma_max": 4, "seed": 1}, refresh_steps=8, half_width=0
    )
    decided = sum(1 for s in simulate(explorer).steps if s.batch_size)
    assert explorer.refreshes == decided


def test_policies_without_checkpointed_decisions_serve_tables_too() -> None:
    """Their entries are decided on copies and decided again when a step runs one (as
    candidates are): refreshed every step with one size, the per-step decisions."""
    params = {"gamma_max": 4}
    per_step = simulate(PolicySource.named("ucb", params))
    tables = TableSource.named("ucb", params, refresh_steps=1, half_width=0)
    assert [s.gamma for s in simulate(tables).steps] == [s.gamma for s in per_step.steps]
