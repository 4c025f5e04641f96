"""`make bench-vllm`: γ policies side by side on a real vLLM OpenAI server, under vLLM's own
serving benchmark.

Starts a sidecar and one `python -m vllm.entrypoints.openai.api_server` (draft_model
speculation, Γmax 3, the plugin enabled by environment) on a local model pair
(tiny_models, `truncated` by default). For each repetition and policy — in pairs of
repetitions, forward then backward, each pair starting one policy further on, so that
drift of the machine falls evenly (`plan`) — it hot-swaps the
sidecar's policy over the admin API (learned state starts empty) and runs the load
schedule: consecutive `vllm bench serve` phases (low → high → low request rate) of
Spec-Bench questions (serve_load.py). A policy named in `--warm` then runs the schedule once
more, keeping what it learned. The engine never restarts, so the policies share one
process, one model load and one machine state. Writes its section of docs/BENCHMARKS.md
from vLLM's result files, the plugin's stats file and the sidecar's /metrics (its stalls:
a late decision loop, full garbage collections), and leaves the first two, with a
`runs.json` index, in the result directory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import nightjar_data
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc
from tqdm import tqdm

from benchmarks.host import free_port, scrape
from benchmarks.report import shown_command, write_section
from benchmarks.serve_load import (
    Load,
    Phase,
    RandomTokens,
    ServeResult,
    bench_serve_argv,
    parse_schedule,
    run_clients,
    run_phase,
    split_phase,
    write_prompts,
)
from benchmarks.vllm_serve_report import Pass, PassResult, PluginCounts, SidecarStalls, render
from policy_server.policies import REGISTRY, PolicyError, create_policy
from tests.rigs.tiny_models import Recipe, build
from tests.rigs.vllm_engine import api_server_command

SECTION = "bench-vllm"
GAMMA_MAX = 3
# Also the engine's dynamic-SD schedule, hence the plugin's fail-open table.
FALLBACK_TABLE = [[1, 8, 3], [9, 24, 1], [25, 4096, 0]]
TOKEN = "bench-vllm-admin-token"
MODEL_NAME = "tiny"
# `--quick` (the CI smoke run): every option it sets can still be given explicitly.
QUICK = {
    "schedule": "2x4,8x12,2x4",
    "policies": "goodput,off",
    "warm": "",
    "repetitions": 1,
    "output_len": 16,
    "engine_warmup": 0,
}
# Where results go: not part of the measured conditions a report states.
OUTPUT_OPTIONS = {"--out": 1, "--result-dir": 1, "--section": 1, "--port": 1}
# The make targets' options (Makefile), named as the target in a report.
MAKE_TARGETS = {
    (): "make bench-vllm",
    ("--dataset", "random"): "make bench-vllm (--dataset random)",
    (
        "--temperatures",
        "0,1",
        "--policies",
        "goodput,goodput:per_request=false,goodput:per_request=true,dsde",
        "--warm",
        "",
    ): "make bench-vllm-mixed",
}
# Runs the unreported engine warm-up phase: a mix of γ as the engine's dynamic-SD table.
# Its default size: the batch reaches --max-num-seqs (64), so the first pass does not pay
# for the CPU kernels' first runs at large batch shapes (16 requests left the first pass of
# the 2026-11-23 run 17 % below the same policy's second).
WARMUP_POLICY = "table"


def policy_request(policy: str) -> tuple[str, dict[str, Any]]:
    """A policy of `--policies` → (registered name, params): `static-K` is static with
    γ = K; learning policies get Γmax; `table` gets the engine's own schedule. A variant
    sets one parameter more, `NAME:KEY=JSON` (e.g. `goodput:local_correction=false`), so
    that an A/B of a parameter shares the run."""
    base, _, variant = policy.partition(":")
    name, _, arg = base.partition("-")
    params: dict[str, Any]
    if base not in REGISTRY and name == "static" and arg.isdigit():
        name, params = "static", {"gamma": int(arg)}
    elif base not in REGISTRY:
        raise ValueError(f"unknown policy {base!r}: static-K or one of {', '.join(REGISTRY)}")
    elif base == "table":
        name, params = base, {"schedule": FALLBACK_TABLE}
    else:
        defaults = REGISTRY[base].default_params()
        name, params = base, {"gamma_max": GAMMA_MAX} if "gamma_max" in defaults else {}
    if variant:
        key, _, value = variant.partition("=")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{policy!r}: the value of {key!r} is not JSON ({exc})") from None
    return name, params


def section_of(args: argparse.Namespace) -> str:
    """The docs/BENCHMARKS.md section a run writes."""
    if args.section:
        return str(args.section)
    section = SECTION if len(args.temperatures) == 1 else f"{SECTION}-mixed"
    return section + "-random" if args.dataset == "random" else section


def plan(policies: Sequence[str], warm: Sequence[str], repetitions: int) -> list[Pass]:
    """The passes in run order: repetitions in pairs, forward then backward, so that a
    drift of the machine linear in time falls evenly within each pair; pair k starts at
    the k-th policy, so that over 2 × len(policies) repetitions every policy takes every
    place of a pair once and a drift curved over the run (an engine slower at the start
    and at the end than between) falls evenly too. With fewer repetitions the policies
    that run first and last in a pair take the ends (the report's pass order says so)."""
    passes = []
    for repetition in range(repetitions):
        start = (repetition // 2) % len(policies)
        rotated = [*policies[start:], *policies[:start]]
        order = rotated if repetition % 2 == 0 else rotated[::-1]
        for policy in order:
            passes.append(Pass(repetition, policy))
            if policy in warm:
                passes.append(Pass(repetition, policy, warm=True))
    return passes


def swap(target: str, policy: str) -> None:
    name, params = policy_request(policy)
    with grpc.insecure_channel(target) as channel:
        admin_pb2_grpc.AdminServiceStub(channel).SwapPolicy(
            admin_pb2.SwapPolicyRequest(name=name, params_json=json.dumps(params)),
            metadata=[("authorization", f"Bearer {TOKEN}")],
            timeout=10,
        )


def sidecar_stalls(port: int) -> SidecarStalls:
    """The sidecar's stalls so far, read from its /metrics on the loopback ``port``."""
    return SidecarStalls.read(scrape(port))


def stats_after(path: Path, moment: float, timeout: float = 15.0) -> dict[str, Any]:
    """The plugin's stats file as first written after `moment` (wall clock): the plugin
    rewrites it every second, atomically."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mtime > moment:
                stats: dict[str, Any] = json.loads(path.read_text())
                return stats
        time.sleep(0.1)
    raise RuntimeError(f"the plugin did not write {path.name} (is the plugin loaded?)")


@contextlib.contextmanager
def process(
    command: list[str], log: Path, env: dict[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_healthy(base: str, proc: subprocess.Popen[bytes], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise RuntimeError("the vLLM server exited during start-up; see its log")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"{base}/health", timeout=2)
            return time.monotonic() - started
        time.sleep(1)
    raise RuntimeError("the vLLM server did not become healthy")


def _schedule(text: str) -> tuple[Phase, ...]:
    try:
        return parse_schedule(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(t) for t in text.split(","))
    except ValueError:
        values = ()
    if not values or not all(0 <= t <= 2 for t in values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected sampling temperatures in 0..2, comma-separated, e.g. 0,1"
        )
    return values


def run_schedule_phase(
    load: Load,
    phase: Phase,
    seed: int,
    result: Path,
    log: Path,
    args: argparse.Namespace,
    warmup: bool,
) -> tuple[ServeResult, list[str]]:
    """One phase of the schedule: one client, or with several --temperatures one client per
    temperature at once, each with its share of the rate and the prompts; the result and
    the names of vLLM's result files."""
    temperatures: tuple[float, ...] = args.temperatures
    if len(temperatures) == 1:
        argv = bench_serve_argv(load, phase, seed, result, warmup, temperatures[0])
        return run_phase(argv, log), [result.name]
    share = split_phase(phase, len(temperatures))
    files = [result.with_name(f"{result.stem}-t{t:g}{result.suffix}") for t in temperatures]
    argvs = [
        bench_serve_argv(load, share, seed * len(temperatures) + i, file, warmup, t)
        for i, (t, file) in enumerate(zip(temperatures, files, strict=True))
    ]
    return ServeResult.together(run_clients(argvs, files, log)), [f.name for f in files]


def _policies(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    try:
        for name in names:
            create_policy(*policy_request(name))  # checked before the engine starts
    except (ValueError, PolicyError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(prog="bench-vllm", description=doc.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument(
        "--prompts",
        type=Path,
        default=nightjar_data.SPEC_BENCH_PROMPTS,
        help="Spec-Bench question.jsonl (default: the copy shipped as nightjar_data)",
    )
    parser.add_argument(
        "--prompt-chars", type=int, default=300, help="cut each question to this many characters"
    )
    parser.add_argument(
        "--models",
        type=Path,
        default=Path("out/models/cpu-rig"),
        help="where the model pair is built (reused when it exists)",
    )
    parser.add_argument(
        "--kind", default="truncated", choices=("truncated", "perturbed"), help="tiny_models pair"
    )
    parser.add_argument(
        "--schedule",
        type=_schedule,
        default="0.5x16,8x160,0.5x16",
        help="load phases RATExPROMPTS,... (req/s x prompts)",
    )
    parser.add_argument(
        "--policies",
        type=_policies,
        default="goodput,nightjar,off,static-1,static-2,static-3,table,ema",
    )
    parser.add_argument(
        "--warm",
        type=_policies,
        default="goodput,nightjar,ema",
        help="those of --policies that run the schedule again right after, "
        "keeping their learned state",
    )
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument(
        "--engine-warmup",
        type=int,
        default=64,
        metavar="PROMPTS",
        help="an unreported phase of this many requests at the schedule's "
        "highest rate before the first pass, under `table` (0 = none); "
        "without it the first pass pays the engine's warm-up",
    )
    parser.add_argument(
        "--dataset",
        choices=("spec-bench", "random"),
        default="spec-bench",
        help="prompts: the Spec-Bench questions (--prompts, cut to --prompt-chars) or vLLM's "
        "`random` dataset (random token ids, --input-len tokens each); each writes its own "
        "section",
    )
    parser.add_argument(
        "--input-len", type=int, default=32, help="prompt tokens with --dataset random"
    )
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    parser.add_argument(
        "--temperatures",
        type=_temperatures,
        default=(0.0,),
        help="sampling temperatures, one benchmark client each, running each phase together "
        "with its share of the rate and the prompts (e.g. 0,1: half greedy, half sampled); "
        "more than one writes the bench-vllm-mixed section",
    )
    parser.add_argument("--seed", type=int, default=0, help="phase i uses seed + i")
    parser.add_argument(
        "--section",
        help="the docs/BENCHMARKS.md section to write (default: bench-vllm, with -mixed for "
        "several temperatures and -random for the random dataset), e.g. for a run of other "
        "policies than the default's, kept beside it",
    )
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--result-dir", type=Path, help="where vLLM writes its result files (default: temp)"
    )
    quick = ", ".join(f"{key}={value}" for key, value in QUICK.items())
    parser.add_argument("--quick", action="store_true", help=f"smoke run: {quick}")
    args = parser.parse_args(argv)
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    if args.repetitions < 1 or args.output_len < 2 or args.prompt_chars < 1 or args.input_len < 1:
        parser.error(
            "--repetitions, --prompt-chars and --input-len must be >= 1, --output-len >= 2"
        )
    given = list(argv if argv is not None else sys.argv[1:])
    args.command = shown_command("benchmarks.vllm_serve", given, OUTPUT_OPTIONS, MAKE_TARGETS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    pair = build(args.models, Recipe.for_kind(args.kind))
    work = Path(tempfile.mkdtemp(prefix="nightjar-bench-vllm-"))
    results = args.result_dir or work / "results"
    results.mkdir(parents=True, exist_ok=True)
    (work / "token").write_text(TOKEN)
    sock, stats_file = work / "nightjar.sock", work / "plugin-stats.json"
    metrics_port = free_port()  # the sidecar's /metrics: its stalls, pass by pass
    base = f"http://127.0.0.1:{args.port}"
    load = Load(
        base,
        pair.target,
        MODEL_NAME,
        RandomTokens(args.input_len)
        if args.dataset == "random"
        else write_prompts(args.prompts, work / "prompts.jsonl", args.prompt_chars),
        args.output_len,
    )
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "TOKENIZERS_PARALLELISM": "false",
        "NIGHTJAR_SIDECAR": f"unix:{sock}",
        "NIGHTJAR_ENGINE_ID": "bench",
        "NIGHTJAR_STATS_FILE": str(stats_file),
    }
    spec = {
        "method": "draft_model",
        "model": str(pair.draft),
        "num_speculative_tokens": GAMMA_MAX,
        "num_speculative_tokens_per_batch_size": FALLBACK_TABLE,
    }
    sidecar = [
        sys.executable,
        "-m",
        "policy_server.cli",
        "--uds",
        str(sock),
        "--admin-token-file",
        str(work / "token"),
        "--state-dir",
        str(work / "state"),
        "--decision-log",
        str(work / "decisions.jsonl"),
        "--metrics-port",
        str(metrics_port),
        "--log-level",
        "WARNING",
    ]
    # No prefix caching: every pass sends the same prompts, so with it each pass after the
    # first to see a phase's prompts skips part of their prefill (a third of all prompt
    # tokens by the end of a run), and the order of the passes decided the ranking.
    server = api_server_command(
        pair.target,
        args.port,
        spec,
        served_model_name=MODEL_NAME,
        max_model_len=1024,
        max_num_seqs=64,
        extra_flags=["--no-enable-prefix-caching"],
    )
    passes = plan(args.policies, args.warm, args.repetitions)
    runs: list[PassResult] = []
    print(f"bench-vllm: logs and results in {work}", file=sys.stderr)
    started = time.monotonic()
    with (
        process(sidecar, work / "sidecar.log", env),
        process(server, work / "vllm.log", env) as vllm,
    ):
        startup = wait_healthy(base, vllm, 600)
        if args.engine_warmup > 0:
            swap(f"unix:{sock}", WARMUP_POLICY)
            warmup = Phase(max(p.rate for p in args.schedule), args.engine_warmup)
            unused_seed = args.seed + len(args.schedule)
            run_phase(
                bench_serve_argv(
                    load, warmup, unused_seed, results / "engine-warmup.json", warmup=True
                ),
                work / "bench-serve.log",
            )
        stats = stats_after(stats_file, time.time() + 0.2)
        stalls = sidecar_stalls(metrics_port)
        bar = tqdm(total=len(passes) * len(args.schedule), unit="phase", desc="bench-vllm")
        for run in passes:
            if not run.warm:
                swap(f"unix:{sock}", run.policy)
            phases: list[ServeResult] = []
            files: list[str] = []
            for index, phase in enumerate(args.schedule):
                label = run.label.replace(" (warm)", "-warm").replace(":", "-").replace("=", "-")
                name = f"r{run.repetition}-{label}-p{index}.json"
                served, names = run_schedule_phase(
                    load,
                    phase,
                    args.seed + index,
                    results / name,
                    work / "bench-serve.log",
                    args,
                    warmup=not runs and not phases,
                )
                phases.append(served)
                files.extend(names)
                bar.set_postfix_str(
                    f"{run.label} {phase.label}: {phases[-1].output_throughput:.1f} tok/s"
                )
                bar.update()
            # Let the step that finished the last request reach the stats file.
            after = stats_after(stats_file, time.time() + 0.2)
            stalls_after = sidecar_stalls(metrics_port)
            runs.append(
                PassResult(
                    run,
                    tuple(phases),
                    tuple(files),
                    PluginCounts.between(stats, after),
                    stalls_after - stalls,
                )
            )
            stats, stalls = after, stalls_after
        bar.close()
    manifest = [
        {
            **dataclasses.asdict(r.run),
            "label": r.run.label,
            "results": list(r.result_files),
            "plugin": dataclasses.asdict(r.plugin),
            "sidecar": dataclasses.asdict(r.sidecar),
        }
        for r in runs
    ]
    (results / "runs.json").write_text(json.dumps(manifest, indent=1))
    elapsed = time.monotonic() - started
    report = render(runs, stats, startup, elapsed, GAMMA_MAX, args)
    write_section(args.out, section_of(args), report)
    print(f"bench-vllm: {len(runs)} passes in {elapsed / 60:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
