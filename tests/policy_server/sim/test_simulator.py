"""Serving simulator: invariants, determinism, the paper's qualitative regime, gRPC parity."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import nightjar_data
import pytest

from nightjar_common.client import TABLE_REFRESH_MS, ClientStats
from nightjar_common.types import StepContext
from policy_server.prefill_cost import PrefillCostTable
from policy_server.sim import plots
from policy_server.sim.acceptance import (
    MIXES,
    WORKLOADS,
    Acceptance,
    AcceptanceModel,
    accepted_run,
    alpha_for_acceptance_length,
    expected_tokens,
)
from policy_server.sim.engine import Decided, SimConfig, SimResult, Simulator
from policy_server.sim.profile import builtin_profiles, calibration_points
from policy_server.sim.runs import summarise
from policy_server.sim.sources import (
    ClientSource,
    OracleSource,
    PolicySource,
    TableSource,
    plans_per_request,
)
from policy_server.sim.workload import (
    SCHEDULES,
    RatePhase,
    RequestSpec,
    TraceError,
    read_trace,
    scale_to_qps,
    synthetic,
)

DATA = nightjar_data.ROOT
PROFILES = builtin_profiles(DATA / "calibration")
TRACE = read_trace(DATA / "traces" / "azure_llm_2023_conv.csv")
SPS = WORKLOADS["chat-sps"]


def run(source, specs, profile="llama2-7b-a100", **config):
    return Simulator(PROFILES[profile], SPS, specs, source, SimConfig(**config)).run()


@pytest.fixture(scope="module")
def busy_specs() -> list[RequestSpec]:
    return synthetic([RatePhase(40, 10.0)], TRACE, seed=3)


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("policy", [("off", None), ("static", {"gamma": 4}), ("nightjar", None)])
def test_invariants_hold_under_pressure(busy_specs, policy, chunked) -> None:
    # A small KV pool forces admission waits and preemptions.
    profile = PROFILES["llama2-7b-a100"]
    small = dataclasses.replace(profile, kv_blocks=1200)
    config = SimConfig(chunked_prefill=chunked)
    result = Simulator(small, SPS, busy_specs, PolicySource.named(*policy), config).run()
    assert len(result.requests) == len(busy_specs)
    assert {r.rid for r in result.requests} == set(range(len(busy_specs)))
    assert all(r.finish_s is not None for r in result.requests)  # nobody lost
    assert all(r.generated == r.spec.output_tokens for r in result.requests)  # tokens conserved
    assert result.max_used_blocks <= result.total_blocks  # KV never over-committed
    assert sum(s.generated for s in result.steps) == result.generated_tokens
    assert result.throughput == pytest.approx(result.generated_tokens / result.makespan_s)
    assert sum(r.preemptions for r in result.requests) > 0, "the test should exercise preemption"
    assert all(r.finish_s >= r.first_token_s >= r.spec.arrival_s for r in result.requests)


def test_a_request_longer_than_the_kv_cache_is_refused_and_the_run_ends() -> None:
    """The Mooncake trace has 100k-token prompts; one that cannot fit the KV cache even
    alone used to wait forever (the run never ended). It is refused at arrival."""
    profile = dataclasses.replace(PROFILES["llama2-7b-a100"], kv_blocks=200, draft_kv_blocks=0)
    capacity = 200 * profile.block_size
    specs = [RequestSpec(0.0, 100, 20), RequestSpec(0.1, capacity, 10), RequestSpec(0.2, 200, 20)]
    result = Simulator(profile, SPS, specs, PolicySource.named("off"), SimConfig()).run()
    assert [r.rejected for r in result.requests] == [False, True, False]
    assert result.rejected == 1 and result.generated_tokens == 40
    assert len(result.latencies()) == 2


def test_identical_results_per_seed(busy_specs) -> None:
    a = run(PolicySource.named("nightjar", {"seed": 4}), busy_specs[:150], seed=9)
    b = run(PolicySource.named("nightjar", {"seed": 4}), busy_specs[:150], seed=9)
    c = run(PolicySource.named("nightjar", {"seed": 4}), busy_specs[:150], seed=10)
    assert a.steps == b.steps and a.makespan_s == b.makespan_s
    assert a.steps != c.steps


def test_speculation_wins_at_low_load_and_loses_at_high_load_on_7b() -> None:
    low = synthetic(SCHEDULES["low"], TRACE, seed=1)
    high = synthetic([RatePhase(60, 30.0)], TRACE, seed=1)
    latency = {}
    for name, specs in (("low", low), ("high", high)):
        off = run(PolicySource.named("off"), specs)
        spec = run(PolicySource.named("static", {"gamma": 3}), specs)
        latency[name] = (off, spec)
    low_off, low_spec = latency["low"]
    assert sum(low_spec.tpots()) < 0.8 * sum(low_off.tpots())  # faster tokens when idle
    high_off, high_spec = latency["high"]
    assert high_spec.throughput < high_off.throughput  # slower when saturated


def test_acceptance_model_matches_leviathan() -> None:
    rng = random.Random(0)
    for alpha, gamma in ((0.6, 3), (0.8, 5)):
        mean = sum(accepted_run(rng, alpha, gamma) + 1 for _ in range(40_000)) / 40_000
        assert mean == pytest.approx(expected_tokens(alpha, gamma), rel=0.02)
    assert expected_tokens(alpha_for_acceptance_length(2.28, 5), 5) == pytest.approx(2.28)
    model = AcceptanceModel("x", 0.7)
    alphas = [model.sample_alpha(rng) for _ in range(5000)]
    assert sum(alphas) / len(alphas) == pytest.approx(0.7, abs=0.01)


class _PrefillWatch(Simulator):
    """Records, after every step's prefill, whether some prompt was left half-prefilled."""

    partial_steps = 0

    def _run_prefill(self, decode_tokens: int) -> int:
        used = super()._run_prefill(decode_tokens)
        self.partial_steps += any(0 < r.prefilled < r.prefill_target for r in self.running)
        return used


@pytest.mark.parametrize("chunked", [True, False])
def test_chunked_prefill_option(busy_specs, chunked) -> None:
    config = SimConfig(chunked_prefill=chunked, max_batch_tokens=512)
    sim = _PrefillWatch(
        PROFILES["llama2-7b-a100"], SPS, busy_specs[:120], PolicySource.named("off"), config
    )
    result = sim.run()
    assert all(r.generated == r.spec.output_tokens for r in result.requests)
    assert (sim.partial_steps > 0) == chunked


def test_regret_is_zero_for_the_oracle_and_positive_for_a_fixed_gamma(busy_specs) -> None:
    oracle = run(OracleSource(), busy_specs[:200], track_regret=True)
    fixed = run(PolicySource.named("static", {"gamma": 4}), busy_specs[:200], track_regret=True)
    untracked = run(PolicySource.named("static", {"gamma": 4}), busy_specs[:200])
    assert oracle.regret_tokens == pytest.approx(0.0, abs=1e-6)
    assert all(step.regret_tokens >= 0 for step in fixed.steps)
    assert fixed.regret_tokens > 0
    assert untracked.regret_tokens == 0.0 and untracked.steps == [
        dataclasses.replace(step, regret_tokens=0.0) for step in fixed.steps
    ]  # scoring decisions does not change them


def test_oracle_is_an_upper_reference(busy_specs) -> None:
    oracle = run(OracleSource(), busy_specs[:200])
    worst = run(PolicySource.named("static", {"gamma": 4}), busy_specs[:200])
    assert oracle.throughput >= worst.throughput


def test_trace_readers_and_time_scaling(tmp_path: Path) -> None:
    assert len(TRACE) == 19366 and TRACE[0].arrival_s == 0.0
    scaled = scale_to_qps(TRACE[:1001], 50.0)
    assert scaled[-1].arrival_s == pytest.approx(1000 / 50.0)
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(
        '{"timestamp": 5.0, "input_tokens": 10, "output_tokens": 3}\n'
        '{"timestamp": 2.0, "input_tokens": 7, "output_tokens": 4}\n'
    )
    assert read_trace(jsonl) == [RequestSpec(0.0, 7, 4), RequestSpec(3.0, 10, 3)]
    bad = tmp_path / "bad.csv"
    bad.write_text("when,input_tokens,output_tokens\n1,2,3\n")
    with pytest.raises(TraceError, match="none of the columns"):
        read_trace(bad)


def replay(
    make_server: Any,
    specs: list[RequestSpec],
    params: dict[str, Any],
    engine_id: str = "replay",
    acceptance: Acceptance = SPS,
) -> tuple[SimResult, ClientStats]:
    """``specs`` replayed through a fresh sidecar serving goodput with ``params``; the
    result and the client's counters."""
    server = make_server("--policy", "goodput", "--params", json.dumps(params))
    client = ClientSource.connect(server.target, engine_id, connect_timeout_s=10)
    try:
        source = ClientSource(client)
        config = SimConfig(engine_id=engine_id)
        result = Simulator(PROFILES["llama2-7b-a100"], acceptance, specs, source, config).run()
    finally:
        client.close()
    return result, client.stats


def test_grpc_path_gives_the_same_decisions_as_in_process(
    make_server: Any, busy_specs: list[RequestSpec]
) -> None:
    """A replay through a sidecar process decides every step as the table protocol does in
    process: the same tables, asked for at the same steps as the plugin's client asks
    (a step ahead, every 32 steps or 200 ms, here of simulated time), with the same reports
    learned from (a replay waits for each refresh)."""
    specs = busy_specs[:60]
    params = {"seed": 2}
    timed = TableSource.named("goodput", params, refresh_ms=TABLE_REFRESH_MS)
    in_process = run(timed, specs, engine_id="parity")
    over_grpc, stats = replay(make_server, specs, params, engine_id="parity")
    assert stats.fallbacks_total == 0 and stats.tables > 1
    assert [s.gamma for s in over_grpc.steps] == [s.gamma for s in in_process.steps]
    assert over_grpc.steps == in_process.steps
    # The simulated clock refreshed tables: by steps alone there are fewer.
    by_steps = TableSource.named("goodput", params)
    run(by_steps, specs, engine_id="parity")
    assert stats.tables == timed.refreshes > by_steps.refreshes


def test_a_replay_through_two_fresh_sidecars_gives_the_same_figures(
    make_server: Any, busy_specs: list[RequestSpec]
) -> None:
    """The same trace, seed, policy and parameters: the same steps and figures to the
    digit, whatever the wall-clock pace of each run (tables age on the simulated clock)."""
    specs = busy_specs[:150]
    first, _ = replay(make_server, specs, {"seed": 4})
    second, _ = replay(make_server, specs, {"seed": 4})
    assert first.steps == second.steps
    assert summarise("p", "w", "g", first) == summarise("p", "w", "g", second)


def test_a_replay_sends_per_request_signals_while_the_policy_reads_them(
    make_server: Any, busy_specs: list[RequestSpec]
) -> None:
    """goodput with per_request=true through the sidecar: once a table says its policy
    reads per-request signals, the steps carry them (and outcomes their requests' accepts),
    and the tables' per-request plans run, step for step as in process."""
    specs = busy_specs[:60]
    params = {"seed": 3, "per_request": True}
    easy_hard = MIXES["easy-hard"]
    timed = PlansSeen("goodput", params, refresh_ms=TABLE_REFRESH_MS)
    in_process = Simulator(
        PROFILES["llama2-7b-a100"], easy_hard, specs, timed, SimConfig(engine_id="pr")
    ).run()
    over_grpc, stats = replay(make_server, specs, params, engine_id="pr", acceptance=easy_hard)
    assert stats.fallbacks_total == 0
    assert over_grpc.steps == in_process.steps
    assert timed.per_request and timed.planned > 0


class PlansSeen(TableSource):
    """Counts the steps whose table planned a request below the step's γ."""

    planned = 0

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        decided = super().decide(ctx, sim)
        self.planned += plans_per_request(decided)
        return decided


def test_profile_writes_a_prefill_cost_table_the_policy_reads(tmp_path: Path) -> None:
    profile = PROFILES["llama2-70b-h100-tp4"]
    table = PrefillCostTable.from_csv(profile.write_prefill_cost_table(tmp_path / "c.csv"))
    for lag, batch in ((16, 4), (1024, 64), (4096, 256)):
        assert table.seconds_at(lag, batch) == pytest.approx(
            profile.catch_up_ms(lag, batch) / 1000, rel=1e-3
        )


def test_plots_are_written_as_png(tmp_path: Path, busy_specs) -> None:
    result = run(OracleSource(), busy_specs[:80], track_regret=True)
    figures = [
        plots.plot_gamma_timeline({"oracle": result}, tmp_path / "g.png", "γ"),
        plots.plot_throughput_over_time({"oracle": result}, tmp_path / "t.png", "tok/s"),
        plots.plot_regret({"oracle": result}, tmp_path / "r.png", "regret"),
        plots.plot_qps_sweep(
            {"p": {"oracle": [(1.0, 10.0, 1.0), (2.0, 20.0, 2.0)]}}, tmp_path / "q.png"
        ),
        plots.plot_profiles(PROFILES, calibration_points(DATA / "calibration"), tmp_path / "p.png"),
    ]
    for figure in figures:
        data = figure.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000
