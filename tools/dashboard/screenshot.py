"""A short driven run of a real sidecar, scraped by a real Prometheus, for the dashboard.

An engine loop asks the sidecar for γ through the real fail-open client
(`nightjar_common/client.py`) and reports every outcome, with the batch size sweeping
1 … 256 and back so every batch bucket sees traffic. The step model is synthetic and
seeded (tokens cost little until the batch is compute bound; drafting costs per token)
so speculation pays at small batches and hurts at large ones. Along the way it does
what an operator would see happen in production: the KV cache runs short at large
batches and the sidecar's memory controller offloads the draft and later reloads it
(the loop carries the orders out), a policy swap to `static` and back, a swap that fails,
a snapshot on demand besides the periodic ones, and a step context the sidecar rejects.

`python tools/dashboard/screenshot.py --out docs/img/dashboard.png` (`make dashboard-screenshot`)
runs it longer, beside a real `vllm serve` of the tiny test models with the plugin steered
by the same sidecar (under completion requests, so the engine-side panels have data; the
sidecar is restarted once, so the engine falls back meanwhile), and draws the dashboard
from the Prometheus with tools.dashboard.render.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if __name__ == "__main__":  # run as a script: the repository's tests/ helpers import as tests.*
    sys.path.insert(0, str(ROOT))

from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc  # noqa: E402

from nightjar_common.client import ClientConfig, NightjarClient  # noqa: E402
from nightjar_common.types import StepContext, StepOutcome  # noqa: E402
from policy_server.memory import OFFLOAD, RELOAD  # noqa: E402

ENGINE = "dash-engine-0"
SIDECAR_JOB = "nightjar-sidecar"
ENGINE_JOB = "vllm"
GAMMA_MAX = 4
TOTAL_KV_BLOCKS = 4096
BLOCKS_PER_REQUEST = 16
DRAFT_BLOCKS = 512
# The sidecar's flags for the run: fast snapshots and a memory controller that reacts
# within a few seconds (production keeps the defaults: 30 s, T_persist = 32 steps). The
# young learner explores about half of its steps at the batch peaks, and an explored γ > 0
# restarts the γ = 0 streak: 3 steps make the offload sure at every peak, 8 did not on a
# busy machine.
SIDECAR_ARGS = (
    "--policy",
    "nightjar",
    "--params",
    json.dumps({"gamma_max": GAMMA_MAX, "batch_bucketing": "pow2", "seed": 0}),
    "--snapshot-interval",
    "2",
    "--memory",
    json.dumps(
        {
            "enabled": True,
            "tau_low": 0.3,
            "t_persist": 3,
            "draft_blocks": DRAFT_BLOCKS,
            "cooldown_steps": 150,
            "order_timeout_steps": 200,
        }
    ),
)


@dataclass
class StepModel:
    """Synthetic engine: step time and accepted drafts for a batch of B at draft length γ."""

    acceptance: float = 0.75
    base_s: float = 0.010
    # Verification is memory bound until the step processes this many tokens.
    knee_tokens: int = 64
    per_token_s: float = 1e-4
    draft_per_gamma_s: float = 0.0015
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def run(self, batch: int, gamma: int) -> tuple[float, int, int]:
        """(step seconds, generated tokens, accepted tokens)."""
        tokens = batch * (gamma + 1)
        seconds = self.base_s + self.per_token_s * max(0, tokens - self.knee_tokens)
        seconds = (seconds + self.draft_per_gamma_s * gamma) * self.rng.uniform(0.95, 1.05)
        accepted = 0
        if gamma:
            # Each request keeps its drafts up to the first rejection.
            hits = self.rng.random((batch, gamma)) < self.acceptance
            accepted = int(np.cumprod(hits, axis=1).sum())
        return seconds, batch + accepted, accepted


@dataclass
class EngineMemory:
    """The engine's side of the memory orders: the draft's residency and the pool size."""

    draft_resident: bool = True
    total_blocks: int = TOTAL_KV_BLOCKS
    orders: list[str] = field(default_factory=list)

    def carry_out(self, action: str) -> None:
        self.orders.append(action)
        if action == OFFLOAD and self.draft_resident:
            self.draft_resident, self.total_blocks = False, TOTAL_KV_BLOCKS + DRAFT_BLOCKS
        elif action == RELOAD and not self.draft_resident:
            self.draft_resident, self.total_blocks = True, TOTAL_KV_BLOCKS


@dataclass
class RunSummary:
    steps: int = 0
    sidecar_decisions: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    bin_types: dict[str, int] = field(default_factory=dict)
    memory_orders: list[str] = field(default_factory=list)
    swaps: list[str] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0


def batch_at(progress: float, cycles: float, rng: np.random.Generator) -> int:
    """Decode batch at `progress` ∈ [0, 1]: log2 B sweeps 0 … 8 `cycles` times, with noise."""
    level = 4 - 4 * math.cos(2 * math.pi * cycles * progress) + rng.normal(0, 0.25)
    return int(min(256, max(1, round(2 ** min(8.0, max(0.0, level))))))


def drive(
    target: str,
    seconds: float,
    events: dict[float, Callable[[], None]],
    summary: RunSummary | None = None,
    steps_per_second: float = 80.0,
    cycles: float = 2.0,
) -> RunSummary:
    """Run the engine loop against the sidecar at `target` for `seconds` of wall time;
    `events` run when the run's progress (0 … 1) passes their key."""
    rng = np.random.default_rng(1)
    model, memory, summary = StepModel(), EngineMemory(), summary or RunSummary()
    pending = dict(sorted(events.items()))
    client = NightjarClient(
        ClientConfig(target=target, engine_id=ENGINE, deadline_s=0.25, connect_timeout_s=10)
    )
    summary.start = time.time()
    started = time.monotonic()
    previous: int | None = None
    try:
        while (elapsed := time.monotonic() - started) < seconds:
            progress = elapsed / seconds
            while pending and next(iter(pending)) <= progress:
                pending.pop(next(iter(pending)))()
            batch = batch_at(progress, cycles, rng)
            ctx = StepContext(
                ENGINE,
                batch_size=batch,
                step_index=summary.steps,
                num_waiting=max(0, batch - 160) // 4,
                free_kv_blocks=max(0, memory.total_blocks - batch * BLOCKS_PER_REQUEST),
                total_kv_blocks=memory.total_blocks,
                draft_resident=memory.draft_resident,
                previous_gamma=previous,
                max_gamma=GAMMA_MAX,
            )
            decided = client.decide(ctx)
            gamma = decided.gamma if memory.draft_resident else 0
            step_s, generated, accepted = model.run(batch, gamma)
            if decided.decision_id and decided.bin_type is not None:
                bin_type = decided.bin_type.value
                summary.bin_types[bin_type] = summary.bin_types.get(bin_type, 0) + 1
                client.report(
                    StepOutcome(
                        decided.decision_id,
                        ENGINE,
                        gamma,
                        step_s,
                        generated,
                        batch * gamma,
                        accepted,
                    )
                )
            for directive in client.take_directives():
                memory.carry_out(directive.action)
            previous = gamma
            summary.steps += 1
            # Real time passes, so Prometheus sees rates (the modelled step time does not).
            time.sleep(max(0.0, started + summary.steps / steps_per_second - time.monotonic()))
        client.flush()
    finally:
        client.close()
    summary.end = time.time()
    summary.sidecar_decisions = client.stats.sidecar_decisions
    summary.fallbacks = dict(client.stats.fallbacks)
    summary.memory_orders = memory.orders
    return summary


def standard_run(
    target: str, auth: list[tuple[str, str]], seconds: float, steps_per_second: float = 80.0
) -> RunSummary:
    """`drive` with the default events (swaps, a snapshot, rejected requests)."""
    summary = RunSummary()
    with grpc.insecure_channel(target) as channel:
        events = default_events(target, admin_pb2_grpc.AdminServiceStub(channel), auth, summary)
        return drive(target, seconds, events, summary, steps_per_second)


def default_events(
    target: str, admin: Any, auth: list[tuple[str, str]], summary: RunSummary
) -> dict[float, Callable[[], None]]:
    """What happens when, as a fraction of the run."""

    def swap(name: str, params: dict[str, Any], keep_state: bool = False) -> Callable[[], None]:
        def run() -> None:
            request = admin_pb2.SwapPolicyRequest(
                name=name, params_json=json.dumps(params), keep_state=keep_state
            )
            try:
                reply = admin.SwapPolicy(request, metadata=auth, timeout=5)
                summary.swaps.append(f"{reply.policy_name} {reply.policy_version}")
            except grpc.RpcError as exc:
                summary.swaps.append(f"failed: {exc.code().name}")

        return run

    def snapshot() -> None:
        admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=auth, timeout=5)

    def unauthenticated_swap() -> None:
        with contextlib.suppress(grpc.RpcError):  # UNAUTHENTICATED, counted by the sidecar
            admin.SwapPolicy(admin_pb2.SwapPolicyRequest(name="static"), timeout=5)

    def reject() -> None:
        reject_one(target)

    return {
        0.15: reject,
        0.30: swap("nightjar", {"gamma_max": 0}),  # out of range: fails, old policy stays
        0.45: swap("static", {"gamma": 2}),
        0.50: snapshot,
        0.55: reject,
        0.60: unauthenticated_swap,
        0.65: swap("nightjar", {"gamma_max": GAMMA_MAX, "batch_bucketing": "pow2"}),
    }


def reject_one(target: str) -> str:
    """A step context the sidecar must refuse (more free KV blocks than blocks): the
    client falls back and the sidecar counts an INVALID_ARGUMENT."""
    with NightjarClient(
        ClientConfig(target=target, engine_id="bad-engine", deadline_s=1.0, connect_timeout_s=10)
    ) as client:
        bad = StepContext("bad-engine", batch_size=4, free_kv_blocks=10, total_kv_blocks=5)
        return client.decide(bad).fallback_reason


@contextlib.contextmanager
def vllm_engine(workdir: Path, sidecar: Any) -> Iterator[tuple[str, Path]]:
    """`vllm serve` (the OpenAI server) of the tiny target/draft pair with the plugin and
    the memory agent, steered by `sidecar`: yields its base URL and the agent's socket."""
    from benchmarks.vllm_serve import process, wait_healthy
    from tests.rigs.sidecar import free_port
    from tests.rigs.tiny_models import Recipe, build
    from tests.rigs.vllm_engine import api_server_command, draft_model_config, engine_env

    models = build(workdir / "models", Recipe(noise=0.05))
    port, socket = free_port(), Path(tempfile.mkdtemp(prefix="nj-")) / "memory.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTJAR_")}
    env.update(engine_env(sidecar, "vllm-0", 50, socket), VLLM_ENABLE_V1_MULTIPROCESSING="1")
    command = api_server_command(
        models.target,
        port,
        draft_model_config(models.draft),
        extra_flags=["--distributed-executor-backend", "uni"],
    )
    base = f"http://127.0.0.1:{port}"
    with process(command, workdir / "vllm.log", env) as proc:
        wait_healthy(base, proc, 600)
        yield base, socket


def serve_load(base: str, stop: threading.Event, concurrency: int = 3) -> list[threading.Thread]:
    """Completion requests to the vLLM server until `stop`, `concurrency` at a time."""

    def loop(index: int) -> None:
        while not stop.is_set():
            body = json.dumps(
                {
                    "model": "tiny",
                    "prompt": f"request {index} says hello",
                    "max_tokens": 48,
                    "temperature": 0,
                    "ignore_eos": True,
                }
            )
            request = urllib.request.Request(
                f"{base}/v1/completions", body.encode(), {"Content-Type": "application/json"}
            )
            with contextlib.suppress(OSError):
                urllib.request.urlopen(request, timeout=120).read()

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    return threads


def engine_events(
    socket: Path, server: Any, auth: list[tuple[str, str]]
) -> dict[float, Callable[[], None]]:
    """The engine's memory agent offloads and reloads its draft (one reload refused: it is
    already resident) where the engine runs one, and the sidecar restarts (the engines
    decide alone meanwhile)."""
    from nightjar_proto.v1 import memory_pb2, memory_pb2_grpc

    agent = memory_pb2_grpc.MemoryAgentServiceStub(grpc.insecure_channel(f"unix:{socket}"))

    def offload() -> None:
        if not socket.exists():  # see docs/MEMORY.md: where the agent can run
            print("the engine runs no memory agent (its log says why): no memory orders")
            return
        agent.OffloadDraft(memory_pb2.OffloadDraftRequest(), metadata=auth, timeout=60)

    def reload() -> None:
        if socket.exists():
            agent.ReloadDraft(memory_pb2.ReloadDraftRequest(), metadata=auth, timeout=60)
            with contextlib.suppress(grpc.RpcError):
                agent.ReloadDraft(memory_pb2.ReloadDraftRequest(), metadata=auth, timeout=60)

    def restart() -> None:
        server.terminate()  # SIGTERM: a last snapshot, then exit
        time.sleep(6)
        server.start()

    return {0.35: offload, 0.42: reload, 0.72: restart}


def screenshot(out: Path, seconds: float, with_engine: bool, workdir: Path | None) -> None:
    from tests.rigs.prometheus import PrometheusRig
    from tests.rigs.sidecar import ADMIN_TOKEN, server_factory
    from tools.dashboard import panels, query, render

    auth = [("authorization", f"Bearer {ADMIN_TOKEN}")]
    with contextlib.ExitStack() as stack:
        if workdir is None:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="nj-dash-")))
        tmp = workdir
        tmp.mkdir(parents=True, exist_ok=True)
        factory = server_factory(tmp)
        stack.callback(next, factory, None)  # stops the sidecar
        server = next(factory)(*SIDECAR_ARGS)
        jobs = {SIDECAR_JOB: [f"127.0.0.1:{server.metrics_port}"]}
        events: dict[float, Callable[[], None]] = {}
        stop_load = threading.Event()
        if with_engine:
            base, socket = stack.enter_context(vllm_engine(tmp, server))
            jobs[ENGINE_JOB] = [base.removeprefix("http://")]
            stack.callback(stop_load.set)
            serve_load(base, stop_load)
            events = engine_events(socket, server, auth)
        prom = stack.enter_context(PrometheusRig(tmp / "prometheus", jobs))
        prom.wait_for(f'up{{job="{SIDECAR_JOB}"}} == 1')
        reject_one(server.target)
        channel = stack.enter_context(grpc.insecure_channel(server.target))
        admin = admin_pb2_grpc.AdminServiceStub(channel)
        summary = RunSummary()
        events.update(default_events(server.target, admin, auth, summary))
        drive(server.target, seconds, events=events, summary=summary)
        time.sleep(3 * prom.scrape_interval_s)
        print(json.dumps(dataclasses.asdict(summary), indent=1))
        board = panels.load(ROOT / "deploy" / "grafana" / "nightjar.json")
        window = query.Window(summary.start - 5, summary.end, 1.0, prom.scrape_interval_s)
        values = {"job": SIDECAR_JOB, "instance": ".*", "engine_job": ENGINE_JOB, "engine": ".*"}
        drawn = render.render(board, prom, window, values, out)
        print(f"wrote {out}; panels without data: {[t for t, n in drawn.items() if n == 0]}")


def main() -> int:
    parser = argparse.ArgumentParser(description="drive a sidecar and draw the dashboard")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    parser.add_argument("--seconds", type=float, default=150.0)
    parser.add_argument("--no-engine", action="store_true", help="without a vLLM engine")
    parser.add_argument("--workdir", type=Path, help="keep the logs here (default: temporary)")
    args = parser.parse_args()
    screenshot(args.out, args.seconds, not args.no_engine, args.workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
