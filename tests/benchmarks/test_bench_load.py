"""`make bench-load` / `make soak` in small: real sidecar and engine processes, short runs.

The figures themselves go to docs/BENCHMARKS.md; these tests check that the tool runs end
to end (the CI smoke of its --quick mode) and that what it reports is consistent.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks import load as bench_load
from benchmarks.load import shown_command
from benchmarks.load_engines import EngineModel
from benchmarks.load_sidecar import check_snapshot, sample_process
from benchmarks.report import markers


def run_main(tmp_path: Path, *args: str) -> dict[str, Any]:
    raw = tmp_path / "raw.json"
    out, reliability = tmp_path / "BENCHMARKS.md", tmp_path / "reliability"
    outputs = ["--out", str(out), "--reliability-dir", str(reliability), "--json", str(raw)]
    assert bench_load.main([*args, *outputs, "--no-progress"]) == 0
    result: dict[str, Any] = json.loads(raw.read_text())
    return result


def assert_run_sane(
    run: dict[str, Any], engines: int, rate: float, seconds: float, pipelined: bool = False
) -> None:
    # Paced engines hold most of the asked rate even on two busy cores.
    assert 0.5 * engines * rate * seconds <= run["decisions"] <= engines * rate * seconds + engines
    assert run["errors"] == 0, run["error_texts"]
    # Every answer an engine took was served by the sidecar; a deadline fallback's request
    # may be answered late or (at the end of the run) not at all. Pipelined engines also
    # ask again when the batch left the prefetched window.
    assert run["sidecar_decisions"] <= run["server_decisions"]
    if pipelined:
        assert 0 <= run["prefetch_misses"] < run["decisions"]
    else:
        assert run["server_decisions"] <= run["decisions"] and run["prefetch_misses"] == 0
    assert run["sidecar_decisions"] + sum(run["fallbacks"].values()) == run["decisions"]
    lat = run["latency_us"]
    assert 0 < lat["p50"] <= lat["p99"] <= lat["p999"] <= lat["max"]
    assert run["server_cpu_s"] > 0
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

    record = json.loads((tmp_path / "reliability" / "soak.json").read_text())
    assert set(record) == {"test", "what", "figure", "passed", "date", "machine", "command"}
    assert record["test"] == "soak" and record["passed"] is all(soak["verdicts"].values())
    assert "3/3 snapshots readable" in record["figure"]
    assert str(tmp_path) not in json.dumps(record)  # no machine paths in what is published
    text = (tmp_path / "BENCHMARKS.md").read_text()
    begin, end = markers("soak")
    assert begin in text and end in text and str(tmp_path) not in text
    assert "| snapshots readable and loadable | 3 / 3 |" in text


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
        "--pipelined",
    )
    assert_run_sane(raw["load"], engines=2, rate=200, seconds=8, pipelined=True)
    peak = raw["max_rate"]
    # Unpaced engines go faster than the paced run asked for.
    assert peak["decisions_per_s"] > 400 and peak["errors"] == 0
    assert peak["server_decisions_per_cpu_s"] > 0
    verdicts = raw["load"]["verdicts"]
    # A short run is never reported as the 10-minute target met.
    assert verdicts["8 engines × 1,000 decisions/s for 10 min, rate held (≥ 99 %)"] is False
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "**not met**" in text and "decisions per second of sidecar CPU" in text
    record = json.loads((tmp_path / "reliability" / "load.json").read_text())
    assert record["test"] == "load" and record["passed"] is False


def test_bench_load_measures_the_bare_stream_baseline_the_same_way(tmp_path: Path) -> None:
    raw = run_main(
        tmp_path,
        "--engines",
        "2",
        "--rate",
        "200",
        "--duration",
        "6",
        "--max-rate",
        "0",
        "--baseline",
        "6",
    )
    assert_run_sane(raw["load"], engines=2, rate=200, seconds=6)
    baseline = raw["baseline"]
    assert_run_sane(baseline, engines=2, rate=200, seconds=6)
    assert baseline["starting_policy"] == "bare" and raw["load"]["starting_policy"] != "bare"
    assert baseline["config"]["server"] == "bare" and baseline["config"]["rate"] == 200
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "Stock gRPC baseline, measured the same way" in text
    fallback_percent = 100 * sum(baseline["fallbacks"].values()) / baseline["decisions"]
    assert f"bare server {fallback_percent:.3f} %" in text


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
    assert shown_command(["--out", "x.md", "--json=r.json"]) == "make bench-load"
    assert shown_command(["--soak", "--no-progress", "--note", "busy"]) == "make soak"
    assert shown_command(["--quick", "--out", "x"]) == "python -m benchmarks.load --quick"
    with pytest.raises(SystemExit):
        bench_load.parse_args(["--transport", "carrier-pigeon"])
