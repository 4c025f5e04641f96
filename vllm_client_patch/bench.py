"""`make bench-vllm`: Nightjar and fixed γ side by side on a real vLLM OpenAI server.

Starts a sidecar and one `python -m vllm.entrypoints.openai.api_server` (draft_model
speculation, Γmax 3, the plugin enabled by environment) on the CPU-rig model pair
(tiny_models `truncated`), then for each request rate and each policy hot-swaps the
sidecar's policy over the admin API and drives the server with a Poisson load of
Spec-Bench questions (greedy, streamed). The engine is never restarted, so the
policies share one process, one model load and one machine state. Writes its section
of docs/BENCHMARKS.md: throughput and latency per rate × policy, vLLM's acceptance
counters, and the plugin's time inside the hook against the engine's step time.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from nightjar.v1 import admin_pb2, admin_pb2_grpc

from policy_server.bench_rpc import machine
from policy_server.report import write_section
from vllm_client_patch.tiny_models import Recipe, build

SECTION = "bench-vllm"
GAMMA_MAX = 3
POLICIES: dict[str, dict[str, Any]] = {
    "nightjar": {"gamma_max": GAMMA_MAX},
    "off": {},
    "static-1": {"gamma": 1},
    "static-3": {"gamma": 3},
}
# Also the engine's dynamic-SD schedule, hence the plugin's fail-open table.
FALLBACK_TABLE = [[1, 8, 3], [9, 24, 1], [25, 4096, 0]]
TOKEN = "bench-vllm-admin-token"


@dataclasses.dataclass(frozen=True)
class RequestResult:
    ok: bool
    e2e_s: float
    ttft_s: float
    tokens: int


@dataclasses.dataclass(frozen=True)
class Run:
    rate: float
    policy: str
    seconds: float
    results: list[RequestResult]
    drafted: float
    accepted: float
    # Steps decided by the fail-open table in this run (sidecar late or unreachable).
    fallbacks: int

    @property
    def done(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    def row(self) -> str:
        done = self.done
        if not done:
            empty = " – |" * 7
            return f"| {self.rate:g} | {self.policy} | 0/{len(self.results)} |{empty}"
        e2e = sorted(r.e2e_s for r in done)
        tpot = [(r.e2e_s - r.ttft_s) / (r.tokens - 1) for r in done if r.tokens > 1]
        acceptance = f"{self.accepted / self.drafted:.2f}" if self.drafted else "–"
        drafts = f"{self.accepted:.0f} / {self.drafted:.0f} ({acceptance})"
        return (
            f"| {self.rate:g} | {self.policy} | {len(done)}/{len(self.results)} | "
            f"{sum(r.tokens for r in done) / self.seconds:.1f} | {statistics.fmean(e2e):.2f} | "
            f"{e2e[min(len(e2e) - 1, int(0.99 * len(e2e)))]:.2f} | "
            f"{1000 * statistics.fmean(r.ttft_s for r in done):.0f} | "
            f"{1000 * statistics.fmean(tpot):.0f} | {drafts} | {self.fallbacks} |"
        )


def prompts(path: Path, limit_chars: int) -> list[str]:
    questions = [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line]
    return [q[:limit_chars] for q in questions]


def stream_completion(base: str, prompt: str, max_tokens: int) -> RequestResult:
    body = json.dumps({
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }).encode()  # fmt: skip
    request = urllib.request.Request(
        f"{base}/v1/completions", body, {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    ttft, tokens = 0.0, 0
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") and not ttft:
                    ttft = time.perf_counter() - started
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except (OSError, ValueError):
        return RequestResult(False, time.perf_counter() - started, 0.0, 0)
    return RequestResult(tokens > 0, time.perf_counter() - started, ttft, tokens)


def spec_counters(base: str) -> tuple[float, float]:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("num_draft_tokens_total", "num_accepted_tokens_total"):
            if line.startswith(f"vllm:spec_decode_{name}"):
                values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return values.get("num_draft_tokens_total", 0.0), values.get("num_accepted_tokens_total", 0.0)


def drive(base: str, questions: list[str], rate: float, seconds: float, seed: int,
          max_tokens: int) -> tuple[list[RequestResult], float]:  # fmt: skip
    """Poisson arrivals for `seconds`; returns every request's result and the makespan."""
    rng = random.Random(seed)
    started = time.perf_counter()
    futures = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=256) as pool:
        at = rng.expovariate(rate)
        while at < seconds:
            time.sleep(max(0.0, started + at - time.perf_counter()))
            prompt = questions[rng.randrange(len(questions))]
            futures.append(pool.submit(stream_completion, base, prompt, max_tokens))
            at += rng.expovariate(rate)
        results = [f.result() for f in futures]
    return results, time.perf_counter() - started


def swap(target: str, policy: str) -> None:
    name = policy.split("-")[0]
    with grpc.insecure_channel(target) as channel:
        admin_pb2_grpc.AdminServiceStub(channel).SwapPolicy(
            admin_pb2.SwapPolicyRequest(name=name, params_json=json.dumps(POLICIES[policy])),
            metadata=[("authorization", f"Bearer {TOKEN}")], timeout=10,
        )  # fmt: skip


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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-vllm", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument("--data", type=Path, default=Path("../shared/data"))
    parser.add_argument("--models", type=Path, default=Path("out/models/cpu-rig"))
    parser.add_argument("--rates", default="0.4,2", help="request rates, req/s")
    parser.add_argument("--seconds", type=float, default=60.0, help="arrival window per run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--quick", action="store_true", help="smoke run: 15 s windows")
    args = parser.parse_args(argv)
    seconds = 15.0 if args.quick else args.seconds
    rates = [float(r) for r in args.rates.split(",")]
    recipe = Recipe.for_kind("truncated")
    pair = build(args.models, recipe)
    questions = prompts(args.data / "prompts" / "specbench_question.jsonl", 300)
    work = Path(tempfile.mkdtemp(prefix="nightjar-bench-vllm-"))
    (work / "token").write_text(TOKEN)
    sock, stats_file = work / "nightjar.sock", work / "plugin-stats.json"
    base = f"http://127.0.0.1:{args.port}"
    env = {
        **os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "TOKENIZERS_PARALLELISM": "false",
        "NIGHTJAR_SIDECAR": f"unix:{sock}", "NIGHTJAR_ENGINE_ID": "bench",
        "NIGHTJAR_STATS_FILE": str(stats_file),
    }  # fmt: skip
    spec = {"method": "draft_model", "model": str(pair.draft), "num_speculative_tokens": GAMMA_MAX,
            "num_speculative_tokens_per_batch_size": FALLBACK_TABLE}  # fmt: skip
    sidecar = [sys.executable, "-m", "policy_server.cli", "--uds", str(sock),
               "--admin-token-file", str(work / "token"), "--state-dir", str(work / "state"),
               "--log-level", "WARNING"]  # fmt: skip
    server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
              "--model", str(pair.target), "--served-model-name", "tiny", "--host", "127.0.0.1",
              "--port", str(args.port), "--dtype", "float32", "--max-model-len", "1024",
              "--enforce-eager", "--max-num-seqs", "64", "--seed", "0",
              "--speculative-config", json.dumps(spec)]  # fmt: skip
    runs: list[Run] = []
    with (
        process(sidecar, work / "sidecar.log", env),
        process(server, work / "vllm.log", env) as vllm,
    ):
        startup = wait_healthy(base, vllm, 600)
        print(f"server healthy after {startup:.0f} s", file=sys.stderr)
        stream_completion(base, questions[0], 8)  # warm-up
        for rate in rates:
            for policy in POLICIES:
                swap(f"unix:{sock}", policy)
                time.sleep(STATS_WAIT_S)
                fallbacks = plugin_stats(stats_file).get("fallbacks_total", 0)
                drafted, accepted = spec_counters(base)
                results, makespan = drive(base, questions, rate, seconds, seed=int(rate * 100),
                                          max_tokens=args.max_tokens)  # fmt: skip
                d2, a2 = spec_counters(base)
                time.sleep(STATS_WAIT_S)
                fallbacks = plugin_stats(stats_file).get("fallbacks_total", 0) - fallbacks
                run = Run(rate, policy, makespan, results, d2 - drafted, a2 - accepted, fallbacks)
                runs.append(run)
                print(run.row(), file=sys.stderr)
        time.sleep(STATS_WAIT_S)
    plugin = plugin_stats(stats_file)
    write_section(args.out, SECTION, render(runs, plugin, startup, seconds, args))
    return 0


STATS_WAIT_S = 1.5  # the plugin rewrites its stats file every second


def plugin_stats(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def render(runs: list[Run], plugin: dict[str, Any], startup: float, seconds: float,
           args: argparse.Namespace) -> str:  # fmt: skip
    hook, step = plugin.get("hook_us", {}), plugin.get("step_ms", {})
    lines = [
        "## vLLM plugin on a real engine (`make bench-vllm`)",
        "",
        f"Measured {datetime.date.today().isoformat()} on {machine()}, by `make bench-vllm"
        f"{' --quick' if args.quick else ''}` (`vllm_client_patch/bench.py`): one vllm-cpu "
        f"OpenAI server (multi-process engine, float32, eager, `--max-num-seqs 64`, healthy "
        f"after {startup:.0f} s) with `draft_model` speculation, Γmax = {GAMMA_MAX}, on the "
        "CPU-rig pair (`tiny_models --kind truncated`: 8-layer 1024-wide target whose upper "
        "6 layers are damped, draft = its first 2 layers), and the sidecar on a Unix socket. "
        f"Per rate and policy: Poisson arrivals for {seconds:g} s of Spec-Bench questions "
        f"(first 300 characters), greedy, {args.max_tokens} output tokens, streamed; the "
        "policy is hot-swapped between runs (learned state starts empty each time), the "
        "engine never restarts. One run each on two shared vCPUs: expect ±5–10 % noise. "
        "`fallback steps` were decided by the plugin's fail-open table (the engine's "
        "dynamic-SD schedule: γ = 3 up to batch 8) because the sidecar's answer missed the "
        "2 ms deadline — they are why `off` can show drafted tokens.",
        "",
        "| req/s | policy | done | output tok/s | mean e2e s | p99 e2e s | mean TTFT ms "
        "| mean TPOT ms | accepted / drafted | fallback steps |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        *(run.row() for run in runs),
        "",
        "Plugin overhead over the whole benchmark, from the plugin's stats file (time inside "
        "the hook per engine step: building the step context, taking the decision, queuing "
        "the outcome, prefetching the next decision):",
        "",
        "| | p50 | p99 | samples |",
        "|---|---:|---:|---:|",
        f"| time in the hook per step | {hook.get('p50', 0):.0f} µs | {hook.get('p99', 0):.0f} µs "
        f"| {hook.get('n', 0)} |",
        f"| engine step (schedule → update) | {step.get('p50', 0):.1f} ms | "
        f"{step.get('p99', 0):.1f} ms | {step.get('n', 0)} |",
        "",
        f"Decisions from the sidecar: {plugin.get('sidecar_decisions', 0)}; fallbacks: "
        f"{plugin.get('fallbacks', {})}; prefetch hits / misses: "
        f"{plugin.get('prefetch_hits', 0)} / {plugin.get('prefetch_misses', 0)}.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
