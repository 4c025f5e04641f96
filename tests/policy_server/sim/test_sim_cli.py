"""`nightjar-sim`: a user's own trace against candidate policies, and a live sidecar."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nightjar_data
import pytest

from policy_server.sim.cli import main

DATA = nightjar_data.ROOT


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "mine.jsonl"
    rows = [
        {"timestamp": 0.25 * i, "input_tokens": 100 + 37 * (i % 9), "output_tokens": 40 + i % 13}
        for i in range(120)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_replays_a_user_trace_against_policies_and_a_sidecar(
    trace: Path, tmp_path: Path, make_server, capsys
) -> None:
    server = make_server()
    out = tmp_path / "figures.json"
    code = main(
        [
            str(trace),
            "--qps",
            "8",
            "--policies",
            "off,static-1,oracle",
            "--data",
            str(DATA),
            "--sidecar",
            server.target,
            "--json",
            str(out),
        ]
    )
    assert code == 0
    figures = json.loads(out.read_text())
    assert set(figures) == {"off", "static-1", "oracle", "sidecar"}
    assert all(
        f["generated_tokens"] == sum(40 + i % 13 for i in range(120)) for f in figures.values()
    )
    assert "vs oracle" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.csv"], "cannot read trace"),
        (["TRACE", "--policies", "nightjar,bogus"], "unknown policy"),
        (["TRACE", "--start", "1000"], "no requests"),
    ],
)
def test_bad_input_is_reported_with_exit_code_2(trace: Path, capsys, args, message) -> None:
    argv = [str(trace) if a == "TRACE" else a for a in args] + ["--data", str(DATA)]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_sidecar_planning_per_request_gets_the_signals_it_reads(make_server, capsys) -> None:
    """`nightjar-sim TRACE --acceptance easy-hard --sidecar ...` against goodput with
    per_request=true: the steps send per-request signals once a table says the policy reads
    them, and the sidecar's per-request plans run."""
    server = make_server("--policy", "goodput", "--params", json.dumps({"per_request": True}))
    trace = DATA / "traces" / "azure_llm_2023_conv.csv"
    argv = [str(trace), "--seconds", "20", "--qps", "8", "--policies", "oracle"]
    argv += ["--acceptance", "easy-hard"]
    assert main([*argv, "--data", str(DATA), "--sidecar", server.target]) == 0
    shown = re.search(
        r"sidecar: (\d+) steps decided, (\d+) sent per-request signals, (\d+) ran per-request γ;"
        r" \d+ tables, 0 fallbacks",
        capsys.readouterr().err,
    )
    assert shown is not None
    steps, signalled, planned = map(int, shown.groups())
    assert steps - 1 <= signalled < steps  # all but the first: no table had said so yet
    assert planned > 0


def test_a_mixed_population_is_selectable_and_dsde_runs_on_it(trace: Path, tmp_path: Path) -> None:
    figures = {}
    for population in ("chat-sps", "code-writing"):
        out = tmp_path / f"{population}.json"
        argv = [str(trace), "--qps", "8", "--policies", "static-2,dsde", "--json", str(out)]
        assert main([*argv, "--acceptance", population, "--data", str(DATA)]) == 0
        figures[population] = json.loads(out.read_text())
    total = sum(40 + i % 13 for i in range(120))
    for cells in figures.values():
        assert {name: c["generated_tokens"] for name, c in cells.items()} == {
            "static-2": total,
            "dsde": total,
        }
    # The mix accepts more than chat-sps: the same γ yields its tokens sooner.
    sps, mix = (figures[p]["static-2"]["mean_tpot_ms"] for p in ("chat-sps", "code-writing"))
    assert mix < sps
