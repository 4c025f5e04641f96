"""`make bench-load` / `make soak` in small: real sidecar and engine processes, short runs.

The figures themselves go to docs/BENCHMARKS.md; these tests check that the tool runs end
to end (the CI smoke of its --quick mode), that what it reports is consistent, and that its
verdicts and its cost figure say what the figures are (results built here, no processes).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks import load as bench_load
from benchmarks.load import shown_command
from benchmarks.load_engines import PRESETS, EngineModel, LoadConfig
from benchmarks.load_report import (
    FALLBACKS_VERDICT,
    NODE_FAST_VERDICT,
    NODE_VERDICT,
    STRESS_VERDICT,
    TARGET_DECISIONS_PER_CORE,
    TWO_CORE_VERDICT,
    LoadResult,
    load_verdicts,
    merge_records,
    reliability_record,
    render_load,
    render_soak,
    soak_verdicts,
    write_load_section,
)
from benchmarks.load_sidecar import check_snapshot, sample_process
from benchmarks.report import markers


def run_main(tmp_path: Path, *args: str) -> dict[str, Any]:
    raw = tmp_path / "raw.json"
    out, reliability = tmp_path / "BENCHMARKS.md", tmp_path / "reliability"
    outputs = ["--out", str(out), "--reliability-dir", str(reliability), "--json", str(raw)]
    assert bench_load.main([*args, *outputs, "--no-progress"]) == 0
    result: dict[str, Any] = json.loads(raw.read_text())
    return result


def assert_run_sane(run: dict[str, Any], engines: int, rate: float, seconds: float) -> None:
    # Paced engines hold most of the asked rate even on two busy cores.
    assert 0.5 * engines * rate * seconds <= run["steps"] <= engines * rate * seconds + engines
    assert run["decisions"] == run["steps"]  # one decision taken per step, by the client too
    assert run["errors"] == 0, run["error_texts"]
    # Every answer an engine took was served by the sidecar (a table step it committed); a
    # step the held table could not answer asked and waited, most steps did not.
    assert run["sidecar_decisions"] <= run["server_decisions"] <= run["decisions"]
    assert 0 < run["table_misses"] < run["decisions"] / 2
    assert run["sidecar_decisions"] + sum(run["fallbacks"].values()) == run["decisions"]
    lat = run["latency_us"]
    assert 0 < lat["p50"] <= lat["p99"] <= lat["p999"] <= lat["max"]
    assert run["server_cpu_s"] > 0
    assert run["server_cpu_us_per_step"] == pytest.approx(1e6 * run["server_cpu_s"] / run["steps"])
    assert run["host_cores"] == os.cpu_count()
    assert 0 < run["server_cpu_percent"] < 100 * (os.cpu_count() or 1)
    assert 10 * 2**20 < run["rss_start_bytes"] <= run["rss_max_bytes"] < 2**30
    assert 0 < run["load_average_mean"] <= run["load_average_max"]


def test_soak_quick_swaps_snapshots_and_reports(tmp_path: Path) -> None:
    raw = run_main(
        tmp_path,
        "--soak",
        "--quick",
        "--engines",
        "2",
        "--rate",
        "200",
        "--duration",
        "13",
        "--swap-every",
        "4",
        "--snapshot-every",
        "4",
        "--baseline",
        "4",
    )
    soak = raw["soak"]
    assert_run_sane(soak, engines=2, rate=200, seconds=13)
    events = soak["admin_events"]
    swaps = [e for e in events if e["action"].startswith("swap")]
    snapshots = [e for e in events if e["action"] == "snapshot"]
    assert len(swaps) == 3 and len(snapshots) == 3 and all(e["ok"] for e in events), events
    # The plan crosses state schemas (fresh state) and keeps state within one.
    assert [e["detail"].split()[0] for e in swaps] == ["nightjar", "nightjar", "ema"]
    assert [e["action"].endswith("keep-state") for e in swaps] == [
        soak["starting_policy"] == "nightjar",
        True,
        False,
    ]
    assert soak["verdicts"]["every snapshot readable and loadable"]
    assert FALLBACKS_VERDICT in soak["verdicts"]
    # The bare stream server ran the same engines and rate, with no swaps or snapshots.
    baseline = raw["baseline"]
    assert baseline["config"]["server"] == "bare" and baseline["admin_events"] == []
    assert (baseline["config"]["engines"], baseline["config"]["rate"]) == (2, 200)

    record = json.loads((tmp_path / "reliability" / "soak.json").read_text())
    assert set(record) == {"test", "what", "figure", "passed", "date", "machine", "command"}
    assert record["test"] == "soak" and record["passed"] is all(soak["verdicts"].values())
    assert "3/3 snapshots readable" in record["figure"]
    assert str(tmp_path) not in json.dumps(record)  # no machine paths in what is published
    text = (tmp_path / "BENCHMARKS.md").read_text()
    begin, end = markers("soak")
    assert begin in text and end in text and str(tmp_path) not in text
    assert "| snapshots readable and loadable | 3 / 3 |" in text
    assert "| server CPU per engine step |" in text and "sidecar ÷ bare" in text


def test_bench_load_quick_paced_and_max_rate(tmp_path: Path) -> None:
    raw = run_main(
        tmp_path,
        "--quick",
        "--engines",
        "2",
        "--rate",
        "200",
        "--duration",
        "8",
        "--max-rate",
        "5",
        "--max-rate-engines",
        "2",
        "--transport",
        "tcp",
        "--baseline",
        "0",
    )
    assert_run_sane(raw["load"], engines=2, rate=200, seconds=8)
    assert "baseline" not in raw and "max_rate_baseline" not in raw
    peak = raw["max_rate"]
    # Unpaced engines go faster than the paced run asked for.
    assert peak["decisions_per_s"] > 400 and peak["errors"] == 0
    assert peak["steps_per_server_cpu_s"] > 0
    verdicts = raw["load"]["verdicts"]
    # Not the stress shape: its 10-minute target is not claimed either way.
    assert STRESS_VERDICT not in verdicts and "rate held (≥ 99 % of 2 × 200 steps/s)" in verdicts
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "engine steps per second of sidecar CPU" in text
    assert "No bare-server run to compare with" in text
    assert markers("bench-load/2x200")[0] in text
    # Whether this host meets the targets varies; the report and the record must agree with
    # the verdicts, whichever way they went.
    record = json.loads((tmp_path / "reliability" / "load.json").read_text())
    passed = all(verdicts.values())
    assert record["test"] == "load (2x200)" and record["passed"] is passed
    per_core_met = peak["steps_per_server_cpu_s"] >= TARGET_DECISIONS_PER_CORE
    assert ("**not met**" in text) is not (passed and per_core_met)


def test_bench_load_measures_the_bare_stream_baseline_the_same_way(tmp_path: Path) -> None:
    # The 2-core shape, over TCP: the bare server runs it the same way, as long.
    raw = run_main(
        tmp_path,
        "--preset",
        "node",
        "--engines",
        "2",
        "--duration",
        "6",
        "--transport",
        "tcp",
    )
    assert_run_sane(raw["load"], engines=2, rate=125, seconds=6)
    baseline = raw["baseline"]
    assert_run_sane(baseline, engines=2, rate=125, seconds=6)
    assert baseline["starting_policy"] == "bare" and raw["load"]["starting_policy"] != "bare"
    assert baseline["config"] == {**raw["load"]["config"], "server": "bare"}
    assert TWO_CORE_VERDICT in raw["load"]["verdicts"]
    # The bare server's tables are as wide and as long-lived as the sidecar's: its engines
    # leave them about as often.
    assert baseline["table_misses"] <= 2 * raw["load"]["table_misses"] + 10
    ratio = raw["load"]["server_cpu_us_per_step"] / baseline["server_cpu_us_per_step"]
    assert raw["load"]["verdicts"][TWO_CORE_VERDICT] is (
        ratio <= 1.5 and raw["load"]["fallback_fraction"] <= 0.001
    )
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "#### The bare stream server:" in text
    assert f"| {ratio:.2f} |" in text
    fallback_percent = 100 * sum(baseline["fallbacks"].values()) / baseline["steps"]
    assert f"| {fallback_percent:.3f} % |" in text


def test_snapshot_check_finds_a_damaged_file(tmp_path: Path) -> None:
    good = tmp_path / "snapshot.json"
    bad_state = tmp_path / "bad-state.json"
    from policy_server.service import DecisionService

    service = DecisionService("nightjar", {"seed": 1}, state_dir=tmp_path)
    assert service.write_snapshot() == good
    assert check_snapshot(good) is None
    document = json.loads(good.read_text())
    document["policy"]["state"] = {"schema": "ema/1"}
    bad_state.write_text(json.dumps(document))
    assert check_snapshot(bad_state) is not None
    truncated = tmp_path / "truncated.json"
    truncated.write_bytes(good.read_bytes()[:-10])
    assert "not valid JSON" in (check_snapshot(truncated) or "")


def test_engine_model_outcomes_follow_gamma_and_batches_move() -> None:
    model = EngineModel("e", seed=3)
    sizes = set()
    for step in range(6000):
        ctx = model.context(previous_gamma=None)
        assert 1 <= ctx.batch_size <= EngineModel.MAX_BATCH
        assert 0 <= ctx.free_kv_blocks <= ctx.total_kv_blocks and ctx.step_index == step
        gamma = step % 5
        outcome = model.run_step(ctx, gamma, "d")
        assert outcome.drafted_tokens == ctx.batch_size * gamma
        assert 0 <= outcome.accepted_tokens <= outcome.drafted_tokens
        assert outcome.generated_tokens == ctx.batch_size + outcome.accepted_tokens
        assert outcome.step_seconds > 0
        sizes.add(ctx.batch_size)
    assert len(sizes) >= 20  # requests join and finish: batch sizes change


def test_process_sample_and_shown_command() -> None:
    sample = sample_process(os.getpid(), 0.0)
    assert sample.cpu_s > 0 and sample.rss_bytes > 2**20
    assert shown_command(["--out", "x.md", "--json=r.json"]) == "python -m benchmarks.load"
    assert shown_command(["--soak", "--no-progress", "--note", "busy"]) == "make soak"
    assert shown_command(["--quick", "--out", "x"]) == "python -m benchmarks.load --quick"
    with pytest.raises(SystemExit):
        bench_load.parse_args(["--transport", "carrier-pigeon"])


# -- verdicts and figures on results built here ------------------------------------------------

HEADER = {
    "date": "2026-11-25",
    "machine": "a test machine",
    "command": "python -m benchmarks.load",
    "note": "",
    "revision": "abc1234",
}


def built_result(
    config: LoadConfig | None = None,
    steps: int = 100_000,
    fallbacks: int = 0,
    server_cpu_s: float = 10.0,
    server_decisions: int | None = None,
    host_cores: int = 2,
    admin_events: list[dict[str, Any]] | None = None,
) -> LoadResult:
    """A run's result as `benchmarks.load` builds it: every step answered but `fallbacks`."""
    config = config or LoadConfig(engines=2, rate=200.0, duration_s=100.0)
    elapsed = config.duration_s
    return LoadResult(
        config=dataclasses.asdict(config),
        started="2026-11-25T00:00:00+00:00",
        steps=steps,
        decisions=steps,
        sidecar_decisions=steps - fallbacks,
        server_decisions=steps - fallbacks if server_decisions is None else server_decisions,
        decisions_per_s=steps / elapsed,
        elapsed_s=elapsed,
        latency_us={"p50": 150.0, "p99": 900.0, "p999": 1800.0, "max": 2500.0},
        fallbacks={"deadline": fallbacks} if fallbacks else {},
        late_replies=fallbacks,
        skipped_behind=0,
        errors=0,
        error_texts=[],
        server_cpu_s=server_cpu_s,
        server_cpu_percent=100 * server_cpu_s / elapsed,
        rss_start_bytes=50 * 2**20,
        rss_warm_bytes=60 * 2**20,
        rss_end_bytes=61 * 2**20,
        rss_max_bytes=62 * 2**20,
        load_average_mean=1.0,
        load_average_max=1.5,
        admin_events=admin_events or [],
        starting_policy="goodput",
        host_cores=host_cores,
    )


def verdict_line(text: str, name: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"- {name}:"))


@pytest.mark.parametrize(("fallbacks", "passed"), [(99, True), (100, True), (101, False)])
def test_load_verdict_fails_above_a_tenth_of_a_percent_of_fallbacks(
    fallbacks: int, passed: bool
) -> None:
    run = built_result(steps=100_000, fallbacks=fallbacks)
    verdicts = load_verdicts(run)
    assert verdicts[FALLBACKS_VERDICT] is passed
    assert all(ok for name, ok in verdicts.items() if name != FALLBACKS_VERDICT)
    text = render_load(run, None, HEADER)
    assert verdict_line(text, FALLBACKS_VERDICT).endswith("met" if passed else "**not met**")
    assert "**not met**" not in text if passed else "**not met**" in text
    record = reliability_record("load", "what", "figure", verdicts, HEADER)
    assert record["passed"] is passed


def test_soak_verdict_fails_when_nearly_every_decision_fell_back() -> None:
    # The soak of 2026-11-23 passed with 99.999 % of its decisions falling back.
    snapshot = {"at_s": 60.0, "action": "snapshot", "ok": True, "detail": "readable"}
    bad = built_result(steps=1_637_063, fallbacks=1_637_040, admin_events=[snapshot])
    verdicts = soak_verdicts(bad)
    assert verdicts[FALLBACKS_VERDICT] is False and not all(verdicts.values())
    assert verdicts["every snapshot readable and loadable"] and verdicts["0 errors"]
    text = render_soak(bad, HEADER, None)
    assert verdict_line(text, FALLBACKS_VERDICT).endswith("**not met**")
    assert "99.999 %" in text
    good = built_result(steps=1_637_063, fallbacks=16, admin_events=[snapshot])
    assert all(soak_verdicts(good).values())
    assert verdict_line(render_soak(good, HEADER, None), FALLBACKS_VERDICT).endswith(" met")


def test_cpu_per_step_comes_from_the_engines_step_counts() -> None:
    # Pipelined: the sidecar's own counter saw almost none of the decisions it answered.
    run = built_result(steps=30_000, server_cpu_s=3.0, server_decisions=3)
    assert run.cpu_per_step_us == pytest.approx(100.0)
    assert run.steps_per_cpu_s == pytest.approx(10_000.0)
    figures = run.figures()
    assert figures["server_cpu_us_per_step"] == pytest.approx(100.0)
    assert figures["steps_per_server_cpu_s"] == pytest.approx(10_000.0)
    text = render_load(run, None, HEADER)
    assert "| server CPU per engine step | 100 µs (10,000 steps per CPU-second) |" in text
    # Fallen-back steps are steps too: the cost is per step the engines ran.
    fallen = built_result(steps=30_000, fallbacks=29_000, server_cpu_s=3.0, server_decisions=1)
    assert fallen.cpu_per_step_us == pytest.approx(100.0)


def test_two_core_target_compares_with_the_bare_server_of_the_same_run() -> None:
    shape = LoadConfig(engines=2, rate=125.0, duration_s=100.0)
    bare = built_result(dataclasses.replace(shape, server="bare"), steps=25_000, server_cpu_s=2.0)
    near = built_result(shape, steps=25_000, server_cpu_s=2.9)  # 1.45 × the bare server's
    far = built_result(shape, steps=25_000, server_cpu_s=3.1)  # 1.55 ×
    assert load_verdicts(near, bare)[TWO_CORE_VERDICT] is True
    assert load_verdicts(far, bare)[TWO_CORE_VERDICT] is False
    falling_back = built_result(shape, steps=25_000, fallbacks=100, server_cpu_s=2.0)
    assert load_verdicts(falling_back, bare)[TWO_CORE_VERDICT] is False
    alone = load_verdicts(near, None)
    assert [ok for name, ok in alone.items() if name.startswith(TWO_CORE_VERDICT)] == [False]
    text = render_load(near, None, HEADER, bare)
    assert "| server CPU per engine step | 116 µs | 80 µs | 1.45 |" in text
    assert "| time to get γ, p50 / p99 | 0.150 / 0.900 ms | 0.150 / 0.900 ms | |" in text
    assert verdict_line(text, TWO_CORE_VERDICT).endswith(" met")
    # Another shape: the 2-core target is not claimed either way.
    assert TWO_CORE_VERDICT not in load_verdicts(built_result(), bare)


def test_node_target_and_a_host_with_fewer_cores_than_engines() -> None:
    node = LoadConfig(engines=8, rate=125.0, duration_s=100.0)
    assert node.shape == "node" and LoadConfig(engines=1, rate=200.0).shape == "pod"
    light = built_result(node, steps=100_000, server_cpu_s=20.0, host_cores=2)  # 20 % of a core
    heavy = built_result(node, steps=100_000, server_cpu_s=30.0, host_cores=16)  # 30 %
    assert load_verdicts(light)[NODE_VERDICT] is True
    assert load_verdicts(heavy)[NODE_VERDICT] is False
    text = render_load(light, None, HEADER)
    assert "2 logical CPUs for 8 engine processes" in text
    assert "only meaningful on ≥ 8 cores; here they are not" in text
    assert "logical CPUs for" not in render_load(heavy, None, HEADER)
    stress = LoadConfig(engines=8, rate=1000.0, duration_s=60.0)
    assert load_verdicts(built_result(stress, steps=480_000))[STRESS_VERDICT] is False


def test_node_at_two_ms_steps_allows_one_percent_of_fallbacks() -> None:
    fast = LoadConfig(engines=8, rate=500.0, duration_s=100.0)
    assert fast.shape == "node-fast"
    within = built_result(fast, steps=400_000, fallbacks=3_900, host_cores=16)
    beyond = built_result(fast, steps=400_000, fallbacks=4_100, host_cores=16)
    assert load_verdicts(within)[NODE_FAST_VERDICT] is True
    assert load_verdicts(within)[FALLBACKS_VERDICT] is False  # the general 0.1 % still applies
    assert load_verdicts(beyond)[NODE_FAST_VERDICT] is False
    slower = built_result(dataclasses.replace(fast, rate=125.0))
    assert NODE_FAST_VERDICT not in load_verdicts(slower)


def test_each_shape_keeps_its_own_subsection_and_record(tmp_path: Path) -> None:
    report = tmp_path / "BENCHMARKS.md"
    report.write_text("# Benchmarks\n\n<!-- soak:begin -->\nsoak figures\n<!-- soak:end -->\n")
    write_load_section(report, "stress", "### stress\n\nold stress")
    write_load_section(report, "pod", "### pod\n\npod figures")
    write_load_section(report, "2x125", "### two\n\nfirst")
    write_load_section(report, "2x125", "### two\n\nsecond")
    text = report.read_text()
    assert "soak figures" in text and text.count("## Many engines on one sidecar") == 1
    assert "first" not in text and "second" in text and "old stress" in text
    begins = [text.index(markers(f"bench-load/{n}")[0]) for n in ("pod", "2x125")]
    assert begins[0] < begins[1] < text.index(markers("bench-load/stress")[0])
    assert text.index(markers("bench-load")[0]) < begins[0]
    assert text.index(markers("bench-load/stress")[1]) < text.index(markers("bench-load")[1])

    path = tmp_path / "load.json"
    old = reliability_record("load", "stress", "old", {"x": False}, HEADER)
    path.write_text(json.dumps(old))
    new = reliability_record("load (pod)", "pod", "new", {"x": True}, HEADER)
    assert [r["test"] for r in merge_records(path, new)] == ["load", "load (pod)"]
    path.write_text(json.dumps(merge_records(path, new)))
    again = reliability_record("load", "stress", "newer", {"x": True}, HEADER)
    assert [r["figure"] for r in merge_records(path, again)] == ["newer", "new"]


def test_presets_and_the_flags_that_override_them() -> None:
    node = bench_load.parse_args(["--preset", "node"])
    assert (node.engines, node.rate, node.max_rate) == (8, 125.0, 0.0)
    assert node.baseline == node.duration == 600.0  # the bare server runs as long
    pod = bench_load.parse_args(["--preset", "pod", "--quick"])
    assert (pod.engines, pod.rate, pod.duration, pod.baseline) == (1, 200.0, 60.0, 60.0)
    stress = bench_load.parse_args([])
    assert (stress.engines, stress.rate, stress.max_rate) == (8, 1000.0, 60.0)
    two = bench_load.parse_args(["--preset", "node", "--engines", "2", "--max-rate", "5"])
    assert (two.engines, two.rate, two.max_rate) == (2, 125.0, 5.0)
    # The 2-core shape from flags alone: not the stress case, so no unpaced phase.
    flags = bench_load.parse_args(["--engines", "2", "--rate", "125"])
    assert (flags.engines, flags.rate, flags.max_rate) == (2, 125.0, 0.0)
    no_baseline = bench_load.parse_args(["--preset", "pod", "--baseline", "0"])
    assert no_baseline.baseline == 0.0
    fast = bench_load.parse_args(["--preset", "node-fast"])
    assert (fast.engines, fast.rate, fast.max_rate) == (8, 500.0, 0.0)
    assert set(PRESETS) == {"stress", "node", "node-fast", "pod"}
