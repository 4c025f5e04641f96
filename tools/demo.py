"""`make demo`: a real sidecar deciding γ for a simulated engine replaying the Azure trace.

Starts `nightjar-server` on a Unix socket, then replays a slice of the Azure LLM
conversation trace through the serving simulator (`policy_server/sim/`), whose steps take
their γ from the sidecar's decision tables through the real fail-open client, as the
plugin's do, and report every step run and its outcome back. The client runs in replay
mode: each step waits for the table it is due, and tables age on the simulated clock, so
the simulation's pace costs no fallback and the run is reproducible. Live lines show the
simulated clock, the decode batch, the queue and the sidecar's decisions. Afterwards it
replays the same requests under the other policies in process, prints a summary table
(throughput, latency, ratio to the oracle, regret), the learned best γ per batch size read
back over the admin API and the Prometheus decision counter, and writes plots.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import nightjar_data
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc

from nightjar_common.client import NightjarClient
from nightjar_common.types import StepContext, StepOutcome
from policy_server.policies import DEFAULT_POLICY
from policy_server.sim.acceptance import WORKLOADS
from policy_server.sim.engine import Decided, SimConfig, SimResult, Simulator
from policy_server.sim.profile import builtin_profiles
from policy_server.sim.runs import (
    DATA_HELP,
    GAMMA_MAX,
    BenchConfig,
    Cell,
    ProfileAssets,
    simulate,
    summarise,
    summary_table,
)
from policy_server.sim.sources import ClientSource
from policy_server.sim.workload import RequestSpec, read_trace, scale_to_qps, window

ENGINE = "demo-engine"
COMPARED = ("nightjar", "off", "static-1", "static-3", "table", "ema", "dsd", "oracle")
# The sidecar runs its default policy; its row in the summary.
SIDECAR = f"{DEFAULT_POLICY} (sidecar)"


class LiveSource(ClientSource):
    """The gRPC decision source, printing one line per `every_s` simulated seconds."""

    def __init__(self, client: NightjarClient, say: Callable[[str], None], every_s: float) -> None:
        super().__init__(client)
        self.say, self.every_s = say, every_s
        self._next_s, self._now, self._tokens, self._gammas = 0.0, 0.0, 0, [0] * (GAMMA_MAX + 1)

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        self._now = sim.now
        return super().decide(ctx, sim)

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        super().report(ctx, decision_id, outcome)
        self._tokens += outcome.generated_tokens
        self._gammas[outcome.gamma] += 1
        if self._now >= self._next_s:
            self._next_s += self.every_s
            # None: the client fell back.
            kind = self.last.bin_type if self.last else None
            how = f"{kind.value if kind else 'fallback':<11}"
            spread = " ".join(f"{n:>5}" for n in self._gammas)
            rate = self._tokens / max(self._now, 1e-9)
            self.say(
                f"{self._now:>7.1f}s {ctx.batch_size:>4} {ctx.num_waiting:>5} "
                f"{outcome.gamma:>2}  {how} {rate:>8.0f}   {spread}"
            )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    workdir: Path, metrics_port: int, params: Mapping[str, Any]
) -> tuple[subprocess.Popen[bytes], str]:
    sock = Path(tempfile.mkdtemp(prefix="nj-demo-")) / "nightjar.sock"
    command = [
        sys.executable,
        "-m",
        "policy_server.cli",
        "--uds",
        str(sock),
        "--metrics-port",
        str(metrics_port),
        "--state-dir",
        str(workdir / "state"),
        "--log-level",
        "WARNING",
        "--params",
        json.dumps(dict(params)),
    ]
    proc = subprocess.Popen(command, stderr=(workdir / "server.log").open("wb"))
    target = f"unix:{sock}"
    # Serve the replay only once the sidecar answers (as a pod's startup probe would).
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return proc, target
            except grpc.RpcError:
                time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"the sidecar did not start:\n{(workdir / 'server.log').read_text()}")


def run(
    seconds: float = 300.0,
    qps: float = 4.0,
    seed: int = 0,
    profile_name: str = "llama2-7b-a100",
    data: Path = nightjar_data.ROOT,
    out: Path = Path("out/demo"),
    quiet: bool = False,
) -> dict[str, Any]:
    say: Callable[[str], None] = (lambda line: None) if quiet else print
    profile = builtin_profiles(data / "calibration")[profile_name]
    specs = trace_slice(data, seconds, qps)
    say(
        f"replaying {len(specs)} requests of the Azure conv trace at {qps:g} req/s "
        f"on the {profile_name} profile"
    )
    with tempfile.TemporaryDirectory(prefix="nightjar-demo-") as tmp:
        assets = ProfileAssets.build(profile, Path(tmp))
        params = {
            "seed": seed,
            "gamma_max": GAMMA_MAX,
            "prefill_cost_table": assets.prefill_cost_table,
        }
        metrics_port = free_port()
        proc, target = start_server(Path(tmp), metrics_port, params)
        try:
            client = ClientSource.connect(target, ENGINE, connect_timeout_s=15)
            if not client.connected:
                raise RuntimeError("the sidecar did not come up; see its log")
            say(f"sidecar up at {target}; metrics on http://127.0.0.1:{metrics_port}/metrics\n")
            say(
                f"{'sim time':>8} {'B':>4} {'queue':>5} {'γ':>2}  {'bin':<11} {'tok/s':>8}   "
                f"steps so far with γ = 0..{GAMMA_MAX} (tok/s: mean so far)"
            )
            live = LiveSource(client, say, every_s=max(1.0, seconds / 20))
            config = SimConfig(seed=seed, gamma_max=GAMMA_MAX, engine_id=ENGINE, track_regret=True)
            started = time.perf_counter()
            sidecar_run = Simulator(profile, WORKLOADS["chat-sps"], specs, live, config).run()
            wall = time.perf_counter() - started
            client.flush()
            time.sleep(0.2)
            learned = learned_best_gamma(target)
            metrics_line = scrape_decisions(metrics_port)
            client_stats = client.stats
            client.close()
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
        bench = BenchConfig(data, [seed], quick=False, assets={profile_name: assets})
        results = {SIDECAR: sidecar_run}
        for policy in COMPARED:
            results[policy] = simulate(profile, specs, policy, bench, seed)
    cells = {name: summarise(profile_name, "azure-conv", name, r) for name, r in results.items()}
    figures = write_plots(out, profile_name, results)
    if not quiet:
        print_summary(
            cells,
            learned,
            metrics_line,
            client_stats.fallbacks_total,
            wall,
            len(sidecar_run.steps),
            figures,
        )
    return {
        "cells": cells,
        "learned_best_gamma": {b: g for b, (g, _) in learned.items()},
        "sidecar_decisions": client_stats.sidecar_decisions,
        "fallbacks": client_stats.fallbacks_total,
        "steps": len(sidecar_run.steps),
        "decided_steps": sum(1 for step in sidecar_run.steps if step.batch_size > 0),
        "figures": figures,
    }


def trace_slice(data: Path, seconds: float, qps: float) -> list[RequestSpec]:
    """The slice of the Azure conv trace that lasts ``seconds`` once rescaled to ``qps``."""
    trace = read_trace(data / "traces" / "azure_llm_2023_conv.csv")
    native_qps = len(trace) / trace[-1].arrival_s
    return scale_to_qps(window(trace, 0, seconds * qps / native_qps), qps)


def learned_best_gamma(target: str) -> dict[int, tuple[int, float]]:
    """Batch-size context → (best γ, its mean goodput) from the sidecar's learned state."""
    with grpc.insecure_channel(target) as channel:
        reply = admin_pb2_grpc.AdminServiceStub(channel).GetState(
            admin_pb2.GetStateRequest(engine_id=ENGINE), timeout=5
        )
    contexts = json.loads(reply.state_json)["learners"].get(f"engine:{ENGINE}", {})
    if "best_gamma" in contexts:  # the goodput policy: its model's answer per batch size
        summary = contexts["best_gamma"].items()
        return dict(sorted((int(b), (int(g), float(gp))) for b, (g, gp) in summary))
    best = {}
    for key, arms in contexts.items():
        pulled = [g for g, n in enumerate(arms["counts"]) if n]
        if pulled:
            g = max(pulled, key=lambda g: arms["means"][g])
            best[int(key)] = (g, arms["means"][g])
    return dict(sorted(best.items()))


def scrape_decisions(port: int) -> str:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    lines = [ln for ln in body.splitlines() if ln.startswith("nightjar_decisions_total")]
    total = sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)
    return f"nightjar_decisions_total: {len(lines)} series, {total:.0f} decisions"


def write_plots(out: Path, profile: str, results: dict[str, SimResult]) -> list[Path]:
    from policy_server.sim import plots

    # The plots colour policies by name; the sidecar run is Nightjar.
    named = {(DEFAULT_POLICY if k == SIDECAR else k): r for k, r in results.items()}
    return [
        plots.plot_gamma_timeline(
            {k: named[k] for k in (DEFAULT_POLICY, "ema", "oracle")},
            out / "gamma.png",
            f"{profile}: γ chosen and decode batch",
        ),
        plots.plot_throughput_over_time(
            named, out / "throughput.png", f"{profile}: throughput on the Azure conv slice"
        ),
        plots.plot_regret(named, out / "regret.png", f"{profile}: regret against the oracle"),
    ]


def print_summary(
    cells: dict[str, Cell],
    learned: dict[int, tuple[int, float]],
    metrics_line: str,
    fallbacks: int,
    wall: float,
    steps: int,
    figures: list[Path],
) -> None:
    print(
        f"\n{steps} engine steps decided by the sidecar in {wall:.1f} s of wall time "
        f"({1e3 * wall / max(steps, 1):.2f} ms per simulated step, RPC included)\n"
    )
    print("\n".join(summary_table(cells)))
    shown = {b: g for b, (g, _) in learned.items() if b & (b - 1) == 0}  # powers of two
    print(
        f"\nlearned best γ for {len(learned)} batch-size contexts (admin API GetState), "
        "powers of two shown:"
    )
    print("  " + ", ".join(f"B={b}: γ={g}" for b, g in shown.items()))
    print(f"\nclient fallbacks: {fallbacks}   {metrics_line}")
    print("plots: " + ", ".join(str(f) for f in figures))
    print("full policy matrix over workloads and profiles: `make bench` -> docs/BENCHMARKS.md")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nightjar-demo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds",
        type=float,
        default=300.0,
        help="length of the replayed trace slice, in seconds at --qps",
    )
    parser.add_argument("--qps", type=float, default=4.0, help="arrival rate of the replay")
    parser.add_argument(
        "--profile", default="llama2-7b-a100", help="llama2-7b-a100 or llama2-70b-h100-tp4"
    )
    parser.add_argument("--data", type=Path, default=nightjar_data.ROOT, help=DATA_HELP)
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="where plots go")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    args = parser.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    run(args.seconds, args.qps, args.seed, args.profile, args.data, args.out, args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
