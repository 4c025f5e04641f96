"""`make bench-load` / `make soak`: many engine processes on one real sidecar.

N engine processes (default 8), each pacing R decisions/s (default 1,000) for a
duration (default 10 min), drive a `nightjar-server` process started here (Unix
socket by default, or loopback TCP). Each engine uses the plugin's client
(`NightjarClient`, default 2 ms deadline, one stream): it asks for γ with a step
context whose batch grows and shrinks as simulated requests join and finish, and
reports an outcome consistent with the γ it ran on the next request.

Reported: decisions/s achieved, client-side latency of a decision p50/p99/p999,
fallbacks by reason, errors, the sidecar's CPU (user + sys) and RSS at start and
end (from /proc of its pid). `--max-rate` adds a phase with unpaced engines that
measures the most decisions one sidecar serves, per second and per second of its
own CPU. `--soak` swaps the policy and takes a snapshot periodically (through the
admin RPC, with a token), and checks each snapshot file can be read and loaded
into its policy.

Writes its section of docs/BENCHMARKS.md and a reliability record
(docs/reliability/load.json or soak.json); prints the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import logging
import math
import multiprocessing
import os
import queue
import secrets
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc

from benchmarks.report import write_section
from benchmarks.rpc import free_port, machine, met, percentile
from nightjar_common.client import ClientConfig, NightjarClient
from nightjar_common.types import StepContext, StepOutcome
from policy_server import snapshot
from policy_server.policies import create_policy
from vllm_client_patch.controller import candidate_batch_sizes

# Targets of the critical-path issue (8 engines × 1,000 decisions/s for 10 min) and of
# the reliability issue's soak.
TARGET_FALLBACK_FRACTION = 0.001
TARGET_RSS_GROWTH = 0.10
TARGET_DECISIONS_PER_CORE = 10_000.0
# Engines connect before the clock starts; this long after it, the sidecar's RSS is the
# baseline for growth (allocations that warm up once — learner tables, gRPC buffers —
# are not growth).
WARMUP_FRACTION = 0.1
MAX_WARMUP_S = 30.0
# An engine this far behind its schedule skips ahead instead of bursting to catch up.
MAX_LAG_S = 0.1
SAMPLE_EVERY_S = 1.0
# Errors kept verbatim per engine (the count is always exact).
MAX_ERROR_TEXTS = 20
# Client fallback reasons that mean something went wrong (a deadline miss does not).
ERROR_FALLBACK_REASONS = ("rejected", "unavailable", "disconnected")
# Soak: each swap activates the next of these, then the sidecar's own starting policy
# twice (its defaults); the learned state is kept whenever the new policy reads the active
# one's state schema (nightjar → nightjar, ema → ema, ...), and starts fresh otherwise.
SWAP_PLAN: tuple[tuple[str, dict[str, Any]], ...] = (
    ("nightjar", {"seed": 11}),
    ("nightjar", {"seed": 12}),
    ("ema", {}),
    ("ema", {"ema_alpha": 0.3}),
)


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    engines: int = 8
    # Decisions per second per engine; 0 = as fast as each engine can (max-rate phase).
    rate: float = 1000.0
    duration_s: float = 600.0
    transport: str = "uds"
    deadline_s: float = 0.002
    # The plugin's pipelined mode (prefetch for step t+1 while step t runs) instead of a
    # blocking decide per step.
    pipelined: bool = False
    swap_every_s: float = 0.0
    snapshot_every_s: float = 0.0
    seed: int = 0
    # "nightjar" (the real sidecar) or "bare" (benchmarks/bare_server.py: the same wire
    # contract deciding nothing, the stock-gRPC baseline; Unix socket only).
    server: str = "nightjar"

    @property
    def warmup_s(self) -> float:
        return min(MAX_WARMUP_S, WARMUP_FRACTION * self.duration_s)


# -- the engines ----------------------------------------------------------------------------


class EngineModel:
    """A decoding engine's batch, in aggregate: requests arrive in waves, are admitted while
    the batch and KV cache have room, and finish after ~`mean_output_tokens`; outcomes follow
    the γ that ran (acceptance rate α drifting per engine)."""

    MAX_BATCH = 64
    TOTAL_KV_BLOCKS = 4096
    BLOCK_TOKENS = 16
    MEAN_PROMPT_TOKENS = 256
    MEAN_OUTPUT_TOKENS = 200
    # Offered load sweeps through this period (steps), so batch sizes cover 1..MAX_BATCH.
    LOAD_PERIOD_STEPS = 20_000

    def __init__(self, engine_id: str, seed: int) -> None:
        self.engine_id = engine_id
        self.rng = np.random.default_rng(seed)
        self.step_index = 0
        self.batch = 1
        self.waiting = 0
        self.context_tokens = self.MEAN_PROMPT_TOKENS
        self.admitted = 1
        self.alpha = 0.7
        self.phase = float(self.rng.uniform(0, 2 * math.pi))

    def context(self, previous_gamma: int | None) -> StepContext:
        used = math.ceil(self.context_tokens / self.BLOCK_TOKENS)
        return StepContext(
            engine_id=self.engine_id,
            batch_size=self.batch,
            step_index=self.step_index,
            num_waiting=self.waiting,
            free_kv_blocks=max(0, self.TOTAL_KV_BLOCKS - used),
            total_kv_blocks=self.TOTAL_KV_BLOCKS,
            previous_gamma=previous_gamma,
            max_gamma=4,
            context_tokens=self.context_tokens,
        )

    def run_step(self, ctx: StepContext, gamma: int, decision_id: str | None) -> StepOutcome:
        """Run the step at γ: its outcome, then the batch moves on (finishes, arrivals)."""
        rng, batch = self.rng, ctx.batch_size
        # Expected accepted draft tokens per request for a per-token acceptance α (the
        # prefix stops at the first rejection): α(1 − α^γ)/(1 − α).
        self.alpha = min(0.9, max(0.4, self.alpha + float(rng.normal(0, 0.01))))
        expected = self.alpha * (1 - self.alpha**gamma) / (1 - self.alpha)
        accepted = int(rng.binomial(batch * gamma, expected / gamma)) if gamma else 0
        generated = batch + accepted
        prefill = self.admitted * self.MEAN_PROMPT_TOKENS
        step_seconds = 0.006 + 0.00004 * batch * (1 + gamma) + 0.0009 * gamma + 2e-6 * prefill
        outcome = StepOutcome(
            decision_id=decision_id or "",
            engine_id=self.engine_id,
            gamma=gamma,
            step_seconds=step_seconds,
            generated_tokens=generated,
            drafted_tokens=batch * gamma,
            accepted_tokens=accepted,
            prefill_tokens=prefill,
        )
        self._advance(generated)
        return outcome

    def _advance(self, generated: int) -> None:
        rng = self.rng
        finish_p = min(1.0, generated / self.batch / self.MEAN_OUTPUT_TOKENS)
        finished = int(rng.binomial(self.batch, finish_p))
        load = 0.5 + 0.5 * math.sin(
            self.phase + 2 * math.pi * self.step_index / self.LOAD_PERIOD_STEPS
        )
        self.waiting += int(rng.poisson(load * self.MAX_BATCH / self.MEAN_OUTPUT_TOKENS * 1.3))
        remaining = self.batch - finished
        self.admitted = min(self.waiting, self.MAX_BATCH - remaining)
        self.waiting -= self.admitted
        self.batch = max(1, remaining + self.admitted)
        per_request = self.context_tokens / max(1, self.batch) + generated / max(1, self.batch)
        self.context_tokens = int(self.batch * min(4096.0, per_request))
        self.step_index += 1


@dataclasses.dataclass
class EngineResult:
    engine_id: str
    decisions: int = 0
    sidecar_decisions: int = 0
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)
    late_replies: int = 0
    rejected_reports: int = 0
    reconnects: int = 0
    prefetch_misses: int = 0
    skipped_behind: int = 0
    errors: int = 0
    error_texts: list[str] = dataclasses.field(default_factory=list)
    elapsed_s: float = 0.0
    # Time the engine spent getting its γ, µs (client side, fallbacks included).
    latencies_us: bytes = b""

    def error(self, text: str) -> None:
        self.errors += 1
        if len(self.error_texts) < MAX_ERROR_TEXTS:
            self.error_texts.append(text)


@dataclasses.dataclass(frozen=True)
class EngineJob:
    index: int
    target: str
    config: LoadConfig
    start_at: float
    end_at: float


def run_engine(job: EngineJob, progress: Synchronized[int]) -> EngineResult:
    """One engine process: paced decisions until `end_at` (wall clock, shared by all)."""
    config = job.config
    engine_id = f"load-engine-{job.index}"
    result = EngineResult(engine_id)
    model = EngineModel(engine_id, seed=config.seed * 1000 + job.index)
    client = NightjarClient(
        ClientConfig(target=job.target, engine_id=engine_id, deadline_s=config.deadline_s,
                     connect_timeout_s=30)
    )  # fmt: skip
    latencies = array("d")
    previous_gamma: int | None = None
    interval = 1 / config.rate if config.rate > 0 else 0.0
    try:
        if not client.connected:
            result.error("not connected to the sidecar after 30 s")
        time.sleep(max(0.0, job.start_at - time.time()))
        started = time.perf_counter()
        wall_offset = time.time() - started
        stop, next_at = job.end_at - wall_offset, started
        if config.pipelined:
            client.prefetch(model.context(previous_gamma))
        while (now := time.perf_counter()) < stop:
            if interval:
                if now < next_at:
                    time.sleep(next_at - now)
                elif now - next_at > MAX_LAG_S:
                    result.skipped_behind += 1
                    next_at = now
                next_at += interval
            ctx = model.context(previous_gamma)
            begin = time.perf_counter()
            decision = client.take(ctx) if config.pipelined else client.decide(ctx)
            latencies.append((time.perf_counter() - begin) * 1e6)
            previous_gamma = decision.gamma
            if config.pipelined:
                # As the plugin: ask for the next step while this one runs, for the batch as it
                # is and the sizes it may take (a move outside that window is a miss).
                client.prefetch(dataclasses.replace(
                    ctx, step_index=ctx.step_index + 1, previous_gamma=previous_gamma,
                    candidate_batch_sizes=candidate_batch_sizes(ctx.batch_size, ctx.num_waiting),
                ))  # fmt: skip
            outcome = model.run_step(ctx, decision.gamma, decision.decision_id)
            # Rides on the next request, as in the plugin (fallback decisions: not sent).
            client.report(outcome)
            if len(latencies) % 100 == 0:
                progress.value = len(latencies)
        result.elapsed_s = time.perf_counter() - started
        progress.value = len(latencies)
    except Exception as exc:  # an engine must report, not vanish
        result.error(f"{type(exc).__name__}: {exc}")
    finally:
        client.close()
    stats = client.stats
    result.decisions = stats.decisions
    result.sidecar_decisions = stats.sidecar_decisions
    result.fallbacks = dict(stats.fallbacks)
    result.late_replies = stats.late_replies
    result.rejected_reports = stats.rejected_reports
    result.reconnects = stats.reconnects
    result.prefetch_misses = stats.prefetch_misses
    for reason in ERROR_FALLBACK_REASONS:
        if result.fallbacks.get(reason):
            result.error(f"{result.fallbacks[reason]} fallback(s) for reason {reason!r}")
    if result.rejected_reports:
        result.error(f"{result.rejected_reports} outcome report(s) rejected")
    if result.reconnects:
        result.error(f"{result.reconnects} reconnect(s) to the sidecar")
    result.latencies_us = latencies.tobytes()
    return result


def _engine_entry(
    job: EngineJob, progress: Synchronized[int], results: multiprocessing.Queue[Any]
) -> None:
    results.put(run_engine(job, progress))


# -- the sidecar ----------------------------------------------------------------------------


class Sidecar:
    """A running `nightjar-server` and an admin channel to it."""

    def __init__(
        self, process: subprocess.Popen[bytes], target: str, token: str, log_path: Path
    ) -> None:
        self.process = process
        self.target = target
        self.auth = [("authorization", f"Bearer {token}")]
        self.log_path = log_path
        self._channel = grpc.insecure_channel(target)
        self._starting_policy: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float) -> None:
        """Until the sidecar answers; a sidecar that exits or stays silent is an error that
        shows its log."""
        ready = grpc.channel_ready_future(self._channel)
        give_up = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < give_up:
            try:
                ready.result(timeout=0.2)
                return
            except grpc.FutureTimeoutError:
                continue
        ready.cancel()
        state = (f"exited with code {self.process.returncode}" if self.process.poll() is not None
                 else f"gave no answer in {timeout:.0f} s")  # fmt: skip
        log_tail = self.log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"nightjar-server {state}; its log:\n{log_tail}")

    def admin(self) -> Any:
        return admin_pb2_grpc.AdminServiceStub(self._channel)

    @property
    def starting_policy(self) -> str:
        if self._starting_policy is None:
            reply = self.admin().GetState(admin_pb2.GetStateRequest(), timeout=10)
            self._starting_policy = str(reply.policy_name)
        return self._starting_policy

    def decisions_total(self) -> int:
        reply = self.admin().GetState(admin_pb2.GetStateRequest(), timeout=10)
        return int(reply.decisions_total)

    def log_problems(self) -> list[str]:
        """ERROR/CRITICAL lines and tracebacks in the sidecar's own log."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [ln for ln in lines if " ERROR " in ln or " CRITICAL " in ln or "Traceback" in ln]

    def close(self) -> None:
        self._channel.close()


SERVER_MODULES = {"nightjar": "policy_server.cli", "bare": "benchmarks.bare_server"}


@contextmanager
def sidecar(transport: str, workdir: Path, server_kind: str = "nightjar") -> Iterator[Sidecar]:
    """A real `nightjar-server` with a state directory and an admin token (or, for
    ``server_kind`` "bare", the baseline stub in its place)."""
    if server_kind not in ("nightjar", "bare") or (server_kind == "bare" and transport != "uds"):
        raise ValueError(f"no {server_kind!r} server on {transport}")
    state_dir = workdir / "state"
    token = secrets.token_hex(16)
    token_file = workdir / "admin.token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    if transport == "uds":
        listen, target = ["--uds", str(workdir / "nightjar.sock")], f"unix:{workdir}/nightjar.sock"
    else:
        port = free_port()
        listen, target = ["--port", str(port)], f"127.0.0.1:{port}"
    log_path = workdir / "server.log"
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", SERVER_MODULES[server_kind], *listen,
             "--state-dir", str(state_dir),
             "--admin-token-file", str(token_file), "--log-level", "INFO"],
            stderr=log_file, stdout=log_file,
        )  # fmt: skip
    server = Sidecar(process, target, token, log_path)
    try:
        server.wait_ready(timeout=30)
        yield server
    finally:
        server.close()
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclasses.dataclass(frozen=True)
class ProcSample:
    at_s: float
    cpu_s: float
    rss_bytes: int
    # The machine's 1-minute load average: how busy the cores were, by anything.
    load_average: float


def sample_process(pid: int, at_s: float) -> ProcSample:
    """User + system CPU seconds and resident set size of `pid`, from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the command name (which may hold spaces) start at field 3 (state).
    fields = stat.rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu_s = (int(fields[11]) + int(fields[12])) / ticks
    rss_kib = next(
        int(line.split()[1])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        if line.startswith("VmRSS:")
    )
    return ProcSample(at_s, cpu_s, rss_kib * 1024, os.getloadavg()[0])


# -- soak: swaps and snapshots ----------------------------------------------------------------


@dataclasses.dataclass
class AdminEvent:
    at_s: float
    action: str
    ok: bool
    detail: str


def swap_plan(starting_policy: str) -> list[tuple[str, dict[str, Any]]]:
    return [*SWAP_PLAN, (starting_policy, {}), (starting_policy, {})]


def state_schema(name: str) -> str:
    return str(create_policy(name, {}).state_schema)


def swap(server: Sidecar, index: int, plan: list[tuple[str, dict[str, Any]]]) -> AdminEvent:
    """The plan's next policy, keeping the learned state when the schemas allow it."""
    name, params = plan[index % len(plan)]
    try:
        active = server.admin().GetState(admin_pb2.GetStateRequest(), timeout=10).policy_name
    except grpc.RpcError as exc:
        return AdminEvent(0.0, f"swap to {name}", False, f"{exc.code().name}: {exc.details()}")
    keep_state = state_schema(active) == state_schema(name)
    request = admin_pb2.SwapPolicyRequest(
        name=name, params_json=json.dumps(params) if params else "", keep_state=keep_state
    )
    label = f"swap to {name} {json.dumps(params)}{' keep-state' if keep_state else ''}"
    try:
        reply = server.admin().SwapPolicy(request, metadata=server.auth, timeout=10)
    except grpc.RpcError as exc:
        return AdminEvent(0.0, label, False, f"{exc.code().name}: {exc.details()}")
    return AdminEvent(0.0, label, True, f"{reply.policy_name} {reply.policy_version}")


def snapshot_and_check(server: Sidecar) -> AdminEvent:
    """Take a snapshot through the admin RPC; read the file back and load it into its policy."""
    try:
        reply = server.admin().Snapshot(
            admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=10
        )
    except grpc.RpcError as exc:
        return AdminEvent(0.0, "snapshot", False, f"{exc.code().name}: {exc.details()}")
    path = Path(reply.path)
    problem = check_snapshot(path)
    if problem:
        return AdminEvent(0.0, "snapshot", False, f"{path.name} unusable: {problem}")
    return AdminEvent(0.0, "snapshot", True, f"{path.stat().st_size} bytes, readable and loadable")


def check_snapshot(path: Path) -> str | None:
    """What is wrong with a snapshot file (None: it parses and its state loads into a fresh
    instance of its policy, as a restore would)."""
    try:
        document = snapshot.read(path)
        spec = document["policy"]
        create_policy(spec["name"], spec["params"]).load_state(spec["state"])
    except Exception as exc:  # anything wrong with the file is the finding
        return f"{type(exc).__name__}: {exc}"
    return None


# -- a run ----------------------------------------------------------------------------------


@dataclasses.dataclass
class LoadResult:
    config: dict[str, Any]
    started: str
    decisions: int
    sidecar_decisions: int
    server_decisions: int
    decisions_per_s: float
    elapsed_s: float
    latency_us: dict[str, float]
    fallbacks: dict[str, int]
    late_replies: int
    prefetch_misses: int
    skipped_behind: int
    errors: int
    error_texts: list[str]
    server_cpu_s: float
    server_cpu_percent: float
    server_decisions_per_cpu_s: float
    rss_start_bytes: int
    rss_warm_bytes: int
    rss_end_bytes: int
    rss_max_bytes: int
    load_average_mean: float
    load_average_max: float
    admin_events: list[dict[str, Any]]
    # The sidecar's policy at start (its default).
    starting_policy: str

    @property
    def fallback_fraction(self) -> float:
        return sum(self.fallbacks.values()) / max(1, self.decisions)

    @property
    def rss_growth(self) -> float:
        """End over the post-warm-up baseline."""
        return self.rss_end_bytes / max(1, self.rss_warm_bytes) - 1

    @property
    def snapshots(self) -> list[dict[str, Any]]:
        return [e for e in self.admin_events if e["action"] == "snapshot"]


def run_load(config: LoadConfig, progress_bar: bool = True) -> LoadResult:
    """Start a sidecar and the engines, run for the configured time, and collect."""
    with (
        tempfile.TemporaryDirectory(prefix="nj-load-") as tmp,
        sidecar(config.transport, Path(tmp), config.server) as server,
    ):
        return _drive(config, server, progress_bar)


def _drive(config: LoadConfig, server: Sidecar, progress_bar: bool) -> LoadResult:
    ctx = multiprocessing.get_context("spawn")
    results_queue: multiprocessing.Queue[EngineResult] = ctx.Queue()
    counters = [ctx.Value("q", 0, lock=False) for _ in range(config.engines)]
    # Spawned engines import the client and connect first; the clock starts for all at once.
    spawn_allowance = 5.0 + 1.5 * config.engines / max(1, os.cpu_count() or 1)
    start_at = time.time() + spawn_allowance
    end_at = start_at + config.duration_s
    engines = [
        ctx.Process(target=_engine_entry, name=f"load-engine-{i}",
                    args=(EngineJob(i, server.target, config, start_at, end_at), counters[i],
                          results_queue))
        for i in range(config.engines)
    ]  # fmt: skip
    for engine in engines:
        engine.start()
    decisions_before = server.decisions_total()
    started_iso = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    time.sleep(max(0.0, start_at - time.time()))
    t0 = time.time()
    samples = [sample_process(server.pid, 0.0)]
    warm: ProcSample | None = None
    events: list[AdminEvent] = []
    next_swap = config.swap_every_s or math.inf
    # Snapshots half a period after swaps, so each sees a policy that has served a while.
    next_snapshot = config.snapshot_every_s / 2 if config.snapshot_every_s else math.inf
    swaps = 0
    plan = swap_plan(server.starting_policy) if config.swap_every_s else []
    expected = config.engines * config.rate * config.duration_s if config.rate else None
    bar = _progress(expected, config, enabled=progress_bar)
    try:
        while (elapsed := time.time() - t0) < config.duration_s:
            time.sleep(min(SAMPLE_EVERY_S, max(0.0, config.duration_s - elapsed)))
            elapsed = time.time() - t0
            if all(not e.is_alive() for e in engines):
                break
            samples.append(sample_process(server.pid, elapsed))
            if warm is None and elapsed >= config.warmup_s:
                warm = samples[-1]
            if elapsed >= next_swap:
                events.append(dataclasses.replace(swap(server, swaps, plan), at_s=elapsed))
                swaps += 1
                next_swap += config.swap_every_s
            if elapsed >= next_snapshot:
                events.append(dataclasses.replace(snapshot_and_check(server), at_s=elapsed))
                next_snapshot += config.snapshot_every_s
            done = sum(int(c.value) for c in counters)
            bar.n = done
            rss = samples[-1].rss_bytes / 2**20
            bar.set_postfix(rate=f"{done / elapsed:,.0f}/s", rss=f"{rss:.0f}MiB", refresh=False)
            bar.refresh()
        results = _engine_results(results_queue, len(engines))
    finally:
        bar.close()
        for engine in engines:
            engine.join(timeout=30)
            if engine.is_alive():
                engine.kill()
    end = sample_process(server.pid, time.time() - t0)
    samples.append(end)
    server_decisions = server.decisions_total() - decisions_before
    return _collect(config, started_iso, results, samples, warm or end, server, server_decisions,
                    events)  # fmt: skip


def _engine_results(results: multiprocessing.Queue[EngineResult], count: int) -> list[EngineResult]:
    """Every engine's result; one that never reports (crashed) is an error."""
    collected: list[EngineResult] = []
    give_up = time.monotonic() + 120
    while len(collected) < count:
        try:
            collected.append(results.get(timeout=max(0.1, give_up - time.monotonic())))
        except queue.Empty:
            lost = EngineResult(f"{count - len(collected)} engine(s)")
            lost.error("exited without a result")
            return [*collected, lost]
    return collected


def _progress(total: float | None, config: LoadConfig, enabled: bool) -> Any:
    from tqdm import tqdm

    label = f"{config.engines} engines × {config.rate:,.0f}/s" if config.rate else "max rate"
    return tqdm(total=int(total) if total else None, desc=label, unit="dec", unit_scale=True,
                disable=not enabled, file=sys.stderr, mininterval=1.0)  # fmt: skip


def _collect(
    config: LoadConfig,
    started: str,
    results: list[EngineResult],
    samples: list[ProcSample],
    warm: ProcSample,
    server: Sidecar,
    server_decisions: int,
    events: list[AdminEvent],
) -> LoadResult:
    latencies = array("d")
    fallbacks: collections.Counter[str] = collections.Counter()
    error_texts: list[str] = []
    for r in results:
        latencies.frombytes(r.latencies_us)
        fallbacks.update(r.fallbacks)
        error_texts += [f"{r.engine_id}: {t}" for t in r.error_texts]
    errors = sum(r.errors for r in results)
    for event in events:
        if not event.ok:
            errors += 1
            error_texts.append(f"{event.action} at {event.at_s:.0f} s: {event.detail}")
    if server.process.poll() is not None:
        errors += 1
        error_texts.append(f"the sidecar exited with code {server.process.returncode}")
    problems = server.log_problems()
    errors += len(problems)
    error_texts += [f"sidecar log: {line}" for line in problems[:MAX_ERROR_TEXTS]]
    ordered = sorted(latencies)
    elapsed = max((r.elapsed_s for r in results), default=0.0) or config.duration_s
    cpu_s = samples[-1].cpu_s - samples[0].cpu_s
    decisions = sum(r.decisions for r in results)
    return LoadResult(
        config=dataclasses.asdict(config),
        started=started,
        decisions=decisions,
        sidecar_decisions=sum(r.sidecar_decisions for r in results),
        server_decisions=server_decisions,
        decisions_per_s=decisions / elapsed,
        elapsed_s=elapsed,
        latency_us={
            name: percentile(ordered, q) if ordered else float("nan")
            for name, q in (("p50", 0.5), ("p99", 0.99), ("p999", 0.999), ("max", 1.0))
        },
        fallbacks=dict(fallbacks),
        late_replies=sum(r.late_replies for r in results),
        prefetch_misses=sum(r.prefetch_misses for r in results),
        skipped_behind=sum(r.skipped_behind for r in results),
        errors=errors,
        error_texts=error_texts[: 4 * MAX_ERROR_TEXTS],
        server_cpu_s=cpu_s,
        server_cpu_percent=100 * cpu_s / max(1e-9, samples[-1].at_s - samples[0].at_s),
        server_decisions_per_cpu_s=server_decisions / max(1e-9, cpu_s),
        rss_start_bytes=samples[0].rss_bytes,
        rss_warm_bytes=warm.rss_bytes,
        rss_end_bytes=samples[-1].rss_bytes,
        rss_max_bytes=max(s.rss_bytes for s in samples),
        load_average_mean=sum(s.load_average for s in samples) / len(samples),
        load_average_max=max(s.load_average for s in samples),
        admin_events=[dataclasses.asdict(e) for e in events],
        starting_policy=server.starting_policy,
    )


# -- report ---------------------------------------------------------------------------------


def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def load_verdicts(run: LoadResult) -> dict[str, bool]:
    """The critical-path issue's targets for a paced run, each met or not."""
    c = run.config
    full = c["engines"] >= 8 and c["rate"] >= 1000 and c["duration_s"] >= 600
    return {
        "8 engines × 1,000 decisions/s for 10 min, rate held (≥ 99 %)": full
        and run.decisions_per_s >= 0.99 * c["engines"] * c["rate"],
        "0 errors": run.errors == 0,
        "fallbacks ≤ 0.1 %": run.fallback_fraction <= TARGET_FALLBACK_FRACTION,
        "sidecar RSS growth ≤ 10 %": run.rss_growth <= TARGET_RSS_GROWTH,
    }


def soak_verdicts(run: LoadResult) -> dict[str, bool]:
    snapshots = run.snapshots
    return {
        "0 errors": run.errors == 0,
        "sidecar RSS growth ≤ 10 %": run.rss_growth <= TARGET_RSS_GROWTH,
        "every snapshot readable and loadable": bool(snapshots) and all(s["ok"] for s in snapshots),
    }


def describe(run: LoadResult) -> str:
    c = run.config
    mode = "pipelined (prefetch/take, as the plugin)" if c["pipelined"] else "blocking decide"
    rate = f"{c['rate']:,.0f} decisions/s each" if c["rate"] else "unpaced (as fast as each can)"
    return (f"{c['engines']} engine processes × {rate} for {c['duration_s']:.0f} s, "
            f"{c['transport'].upper()}, one stream per engine, {mode}, "
            f"{c['deadline_s'] * 1000:g} ms deadline")  # fmt: skip


def run_table(run: LoadResult) -> list[str]:
    lat = run.latency_us
    fallbacks = ", ".join(f"{k} {v}" for k, v in sorted(run.fallbacks.items())) or "none"
    return [
        "| figure | value |",
        "|---|---|",
        f"| decisions (client side) | {run.decisions:,} in {run.elapsed_s:.1f} s |",
        f"| decisions/s achieved | {run.decisions_per_s:,.0f} |",
        f"| decisions served by the sidecar (its counter) | {run.server_decisions:,} "
        f"({run.server_decisions / run.elapsed_s:,.0f}/s) |",
        f"| time to get γ, p50 / p99 / p999 / max | {lat['p50'] / 1000:.3f} / "
        f"{lat['p99'] / 1000:.3f} / {lat['p999'] / 1000:.3f} / {lat['max'] / 1000:.3f} ms |",
        f"| fallbacks | {sum(run.fallbacks.values()):,} ({100 * run.fallback_fraction:.3f} %): "
        f"{fallbacks} |",
        f"| late replies (answered after the deadline) | {run.late_replies:,} |",
        f"| engine fell > {MAX_LAG_S * 1000:.0f} ms behind its schedule | {run.skipped_behind:,} |",
        f"| errors | {run.errors} |",
        f"| sidecar CPU (user + sys) | {run.server_cpu_s:.1f} s, {run.server_cpu_percent:.0f} % "
        f"of one core |",
        f"| sidecar decisions per CPU-second | {run.server_decisions_per_cpu_s:,.0f} |",
        f"| sidecar RSS at start / after warm-up / end / max | {mib(run.rss_start_bytes)} / "
        f"{mib(run.rss_warm_bytes)} / {mib(run.rss_end_bytes)} / {mib(run.rss_max_bytes)} |",
        f"| RSS growth, end over after warm-up ({LoadConfig(**run.config).warmup_s:.0f} s) | "
        f"{100 * run.rss_growth:+.1f} % |",
        f"| machine load average (1 min) during the run, mean / max | "
        f"{run.load_average_mean:.1f} / {run.load_average_max:.1f} ({os.cpu_count()} cores) |",
    ]


def verdict_lines(verdicts: dict[str, bool]) -> list[str]:
    return [f"- {name}: {met(ok)}" for name, ok in verdicts.items()]


def render_load(
    load: LoadResult, peak: LoadResult | None, header: dict[str, str],
    baseline: LoadResult | None = None,
) -> str:  # fmt: skip
    lines = [
        "## Many engines on one sidecar (`make bench-load`)",
        "",
        f"Measured {header['date']} on {header['machine']} at commit {header['revision']}, by "
        f"`{header['command']}` "
        "(`benchmarks/load.py`). A real `nightjar-server` process and the engine "
        "processes share the machine's cores; each engine runs the plugin's client "
        "(`NightjarClient`) with simulated step contexts (batch 1–64 as requests join and "
        "finish, KV blocks, context tokens) and reports outcomes consistent with the γ it ran. "
        "Latency is the engine's time to get γ (a fallback counts at its deadline). "
        + header["note"],
        "",
        f"### Paced: {describe(load)}",
        "",
        *run_table(load),
        "",
        "Targets (issue: 8 engines × 1,000 decisions/s for 10 minutes):",
        "",
        *verdict_lines(load_verdicts(load)),
    ]
    if peak is not None:
        per_core = peak.server_decisions_per_cpu_s
        lines += [
            "",
            f"### Most decisions one sidecar serves: {describe(peak)}",
            "",
            *run_table(peak),
            "",
            f"- one sidecar core ≥ {TARGET_DECISIONS_PER_CORE:,.0f} decisions/s: "
            f"{per_core:,.0f} decisions per second of sidecar CPU — "
            f"{met(per_core >= TARGET_DECISIONS_PER_CORE)}",
        ]
    if baseline is not None:
        lines += [
            "",
            f"### Stock gRPC baseline, measured the same way: {describe(baseline)}, against "
            "a bare stream server",
            "",
            "The same engine processes, rate and deadline against `benchmarks/bare_server.py`"
            ": the sidecar's wire contract on a `grpc.aio` server that answers every step with "
            "γ = 1 and does nothing else (no policy, validation, bookkeeping or metrics). The "
            'rows that say "sidecar" are that server\'s.',
            "",
            *run_table(baseline),
            "",
            f"- fallbacks: sidecar {100 * load.fallback_fraction:.3f} %, bare server "
            f"{100 * baseline.fallback_fraction:.3f} %; time to get γ p99: sidecar "
            f"{load.latency_us['p99'] / 1000:.3f} ms, bare server "
            f"{baseline.latency_us['p99'] / 1000:.3f} ms",
        ]
    errors = load.error_texts + (peak.error_texts if peak else [])
    errors += baseline.error_texts if baseline else []
    if errors:
        lines += ["", "Errors seen (first ones):", "", *[f"- `{t}`" for t in errors[:10]]]
    return "\n".join(lines) + "\n"


def render_soak(soak: LoadResult, header: dict[str, str]) -> str:
    swaps = [e for e in soak.admin_events if e["action"] != "snapshot"]
    lines = [
        "## Soak: swaps and snapshots under load (`make soak`)",
        "",
        f"Measured {header['date']} on {header['machine']} at commit {header['revision']}, by "
        f"`{header['command']}` "
        f"(`benchmarks/load.py --soak`). {describe(soak)}; every "
        f"{soak.config['swap_every_s']:g} s a policy swap through the admin RPC (with the admin "
        "token), cycling "
        + ", ".join(f"{n} {json.dumps(p)}" for n, p in swap_plan(soak.starting_policy))
        + " (keep-state whenever the active policy's state schema allows it)"
        + f"; every {soak.config['snapshot_every_s']:g} s a snapshot through the admin RPC, "
        "whose file is then read back (`policy_server/snapshot.py`) and its state loaded into "
        "a fresh instance of its policy. " + header["note"],
        "",
        *run_table(soak),
        f"| swaps (ok / all) | {sum(e['ok'] for e in swaps)} / {len(swaps)} |",
        f"| snapshots readable and loadable | {sum(s['ok'] for s in soak.snapshots)} / "
        f"{len(soak.snapshots)} |",
        "",
        "Targets (issue: 0 errors, RSS growth ≤ 10 %, snapshot always readable):",
        "",
        *verdict_lines(soak_verdicts(soak)),
    ]
    if soak.error_texts:
        lines += ["", "Errors seen (first ones):", "", *[f"- `{t}`" for t in soak.error_texts[:10]]]
    return "\n".join(lines) + "\n"


def reliability_record(
    name: str, what: str, figure: str, verdicts: dict[str, bool], header: dict[str, str]
) -> dict[str, Any]:
    return {
        "test": name,
        "what": what,
        "figure": figure,
        "passed": all(verdicts.values()),
        "date": header["date"],
        "machine": header["machine"],
        "command": header["command"],
    }


def summary_figure(run: LoadResult) -> str:
    return (f"{run.errors} errors; {run.decisions:,} decisions at {run.decisions_per_s:,.0f}/s; "
            f"fallbacks {100 * run.fallback_fraction:.3f} %; p99 "
            f"{run.latency_us['p99'] / 1000:.2f} ms; RSS {mib(run.rss_warm_bytes)} → "
            f"{mib(run.rss_end_bytes)} ({100 * run.rss_growth:+.1f} %)")  # fmt: skip


# -- command line ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench-load", description=__doc__.splitlines()[0])
    p.add_argument("--engines", type=int, default=8, help="engine processes (default 8)")
    p.add_argument("--rate", type=float, default=1000.0,
                   help="decisions/s per engine (default 1000)")  # fmt: skip
    p.add_argument("--duration", type=float, default=600.0, help="seconds (default 600)")
    p.add_argument("--quick", action="store_true",
                   help="60 s (a smoke run; --duration still wins when given)")  # fmt: skip
    p.add_argument("--transport", choices=("uds", "tcp"), default="uds")
    p.add_argument("--deadline-ms", type=float, default=2.0,
                   help="the client's decision deadline (default 2, the plugin's)")  # fmt: skip
    p.add_argument("--pipelined", action="store_true",
                   help="prefetch/take as the plugin, not a blocking decide")  # fmt: skip
    p.add_argument("--max-rate", type=float, default=60.0, metavar="SECONDS",
                   help="then this long with unpaced engines: the most one sidecar serves "
                   "(0 = skip; not in --soak)")  # fmt: skip
    p.add_argument("--max-rate-engines", type=int, default=4)
    p.add_argument("--baseline", type=float, default=60.0, metavar="SECONDS",
                   help="then this long the paced load against a bare stream server that "
                   "decides nothing: stock-gRPC baseline (0 = skip; not in --soak)")  # fmt: skip
    p.add_argument("--soak", action="store_true", help="swap the policy and snapshot periodically")
    p.add_argument("--swap-every", type=float, default=60.0, help="soak: seconds between swaps")
    p.add_argument("--snapshot-every", type=float, default=60.0,
                   help="soak: seconds between snapshots")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    p.add_argument("--reliability-dir", type=Path, default=Path("docs/reliability"))
    p.add_argument("--json", type=Path, help="also write the raw figures here")
    p.add_argument("--note", default="", help="conditions to state in the report")
    p.add_argument("--revision", help="the source revision measured (default: from git)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick and "--duration" not in (argv if argv is not None else sys.argv):
        args.duration = 60.0
    return args


# Where the results go and how they are shown: not part of the measured conditions.
OUTPUT_OPTIONS = {
    "--out": 1, "--reliability-dir": 1, "--json": 1, "--note": 1, "--no-progress": 0,
    "--revision": 1,
}  # fmt: skip


def source_revision() -> str:
    """The commit measured (with "+ local changes" when the checkout differs from it)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()  # fmt: skip

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit} + local changes" if dirty else commit


def shown_command(argv: list[str]) -> str:
    """The command as the report states it: the make target when run as one."""
    shown, skip = [], 0
    for arg in argv:
        name = arg.split("=", 1)[0]
        if skip:
            skip -= 1
        elif name in OUTPUT_OPTIONS:
            skip = OUTPUT_OPTIONS[name] if "=" not in arg else 0
        else:
            shown.append(arg)
    if shown == []:
        return "make bench-load"
    if shown == ["--soak"]:
        return "make soak"
    return " ".join(["python -m benchmarks.load", *shown])


def main(argv: Sequence[str] | None = None) -> int:
    # The snapshot check builds policies here; their start-up notes are not the report's.
    # Put the level back after: main also runs inside other processes (the tests).
    policies_log = logging.getLogger("policy_server.policies")
    level = policies_log.level
    policies_log.setLevel(logging.ERROR)
    try:
        return _main(argv)
    finally:
        policies_log.setLevel(level)


def _main(argv: Sequence[str] | None) -> int:
    args = parse_args(argv)
    header = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "command": shown_command(list(argv if argv is not None else sys.argv[1:])),
        "note": args.note,
        "revision": args.revision or source_revision(),
    }
    config = LoadConfig(
        engines=args.engines, rate=args.rate, duration_s=args.duration, transport=args.transport,
        deadline_s=args.deadline_ms / 1000, pipelined=args.pipelined, seed=args.seed,
        swap_every_s=args.swap_every if args.soak else 0.0,
        snapshot_every_s=args.snapshot_every if args.soak else 0.0,
    )  # fmt: skip
    progress = not args.no_progress
    args.reliability_dir.mkdir(parents=True, exist_ok=True)
    raw: dict[str, Any] = {"header": header}
    if args.soak:
        soak = run_load(config, progress)
        raw["soak"] = dataclasses.asdict(soak) | {"verdicts": soak_verdicts(soak)}
        write_section(args.out, "soak", render_soak(soak, header))
        figure = (
            f"{summary_figure(soak)}; {sum(s['ok'] for s in soak.snapshots)}/"
            f"{len(soak.snapshots)} snapshots readable"
        )
        record = reliability_record("soak", f"{describe(soak)}; policy swap every "
                                    f"{config.swap_every_s:g} s, snapshot every "
                                    f"{config.snapshot_every_s:g} s", figure,
                                    soak_verdicts(soak), header)  # fmt: skip
        (args.reliability_dir / "soak.json").write_text(json.dumps(record, indent=2) + "\n")
        ok = all(soak_verdicts(soak).values())
    else:
        load = run_load(config, progress)
        peak = None
        if args.max_rate > 0:
            peak_config = dataclasses.replace(
                config,
                engines=args.max_rate_engines,
                rate=0.0,
                duration_s=args.max_rate,
                pipelined=False,
            )
            peak = run_load(peak_config, progress)
        baseline = None
        if args.baseline > 0 and config.transport == "uds":
            base_config = dataclasses.replace(config, duration_s=args.baseline, server="bare")
            baseline = run_load(base_config, progress)
        raw["load"] = dataclasses.asdict(load) | {"verdicts": load_verdicts(load)}
        if peak is not None:
            raw["max_rate"] = dataclasses.asdict(peak)
        if baseline is not None:
            raw["baseline"] = dataclasses.asdict(baseline)
        write_section(args.out, "bench-load", render_load(load, peak, header, baseline))
        record = reliability_record("load", describe(load), summary_figure(load),
                                    load_verdicts(load), header)  # fmt: skip
        (args.reliability_dir / "load.json").write_text(json.dumps(record, indent=2) + "\n")
        ok = all(load_verdicts(load).values())
    text = json.dumps(raw, indent=2)
    if args.json:
        args.json.write_text(text)
    print(text)
    print("targets met" if ok else "targets NOT met (see the report)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
