"""The engine processes of `make bench-load` / `make soak` and what they are asked to do.

A run's configuration (`LoadConfig`) and the shapes `--preset` names (`PRESETS`); a
decoding engine's batch in aggregate (`EngineModel`); and one engine process
(`run_engine`): the plugin's client (`NightjarClient`) pacing decisions against the sidecar
until a wall-clock end shared by all engines, reporting each outcome on the next request,
and returning its counts and latencies (`EngineResult`).
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import time
from array import array
from multiprocessing.sharedctypes import Synchronized
from typing import Any

import numpy as np

from nightjar_common.client import ClientConfig, NightjarClient
from nightjar_common.types import StepContext, StepOutcome

# Engines connect before the clock starts; this long after it, the sidecar's RSS is the
# baseline for growth (allocations that warm up once — learner tables, gRPC buffers —
# are not growth).
WARMUP_FRACTION = 0.1
MAX_WARMUP_S = 30.0
# An engine this far behind its schedule skips ahead instead of bursting to catch up.
MAX_LAG_S = 0.1
# Errors kept verbatim per engine (the count is always exact).
MAX_ERROR_TEXTS = 20
# Client fallback reasons that mean something went wrong (a deadline miss does not).
ERROR_FALLBACK_REASONS = ("rejected", "unavailable", "disconnected")


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    engines: int = 8
    # Decisions per second per engine; 0 = as fast as each engine can (max-rate phase).
    rate: float = 1000.0
    duration_s: float = 600.0
    transport: str = "uds"
    deadline_s: float = 0.002
    swap_every_s: float = 0.0
    snapshot_every_s: float = 0.0
    seed: int = 0
    # "nightjar" (the real sidecar) or "bare" (benchmarks/bare_server.py: the same wire
    # contract deciding nothing, the stock-gRPC baseline).
    server: str = "nightjar"

    @property
    def warmup_s(self) -> float:
        return min(MAX_WARMUP_S, WARMUP_FRACTION * self.duration_s)

    @property
    def shape(self) -> str:
        """The preset this run's shape is (engines, rate), else "NxR"."""
        for name, preset in PRESETS.items():
            if (self.engines, self.rate) == (preset.engines, preset.rate):
                return name
        return f"{self.engines}x{self.rate:g}" if self.rate else f"{self.engines}x-unpaced"


@dataclasses.dataclass(frozen=True)
class Preset:
    """A shape of load `--preset` names: engines × steps/s each."""

    engines: int
    rate: float
    # Seconds of the unpaced phase after the paced run (0 = none).
    max_rate_s: float
    what: str


# The real shapes (issue 31) and the stress case the critical-path issue set. Each runs for
# --duration (default 10 min) and is compared with the bare stream server in the same run.
PRESETS: dict[str, Preset] = {
    "stress": Preset(8, 1000.0, 60.0, "8 engines × 1,000 steps/s: the critical-path stress case"),
    "node": Preset(8, 125.0, 0.0, "one node of 8 GPUs: 8 engines × 125 steps/s (8 ms steps)"),
    "node-fast": Preset(8, 500.0, 0.0, "one node of 8 GPUs at 2 ms steps: 8 engines × 500 steps/s"),
    "pod": Preset(1, 200.0, 0.0, "one engine per pod: 1 engine × 200 steps/s"),
}


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
    # Steps the engine ran (each got a γ: from the sidecar or from the fallback).
    steps: int = 0
    # The client's count of the same (`ClientStats.decisions`).
    decisions: int = 0
    sidecar_decisions: int = 0
    fallbacks: dict[str, int] = dataclasses.field(default_factory=dict)
    late_replies: int = 0
    rejected_reports: int = 0
    reconnects: int = 0
    # Steps the held decision table could not answer (the client asked and waited).
    table_misses: int = 0
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
        ClientConfig(
            target=job.target,
            engine_id=engine_id,
            deadline_s=config.deadline_s,
            connect_timeout_s=30,
        )
    )
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
            # As the plugin: the held table's γ, and a new table asked for when it is due.
            decision = client.decide(ctx)
            latencies.append((time.perf_counter() - begin) * 1e6)
            previous_gamma = decision.gamma
            outcome = model.run_step(ctx, decision.gamma, decision.decision_id)
            # Goes with the next batch of reports, as in the plugin (fallbacks: not sent).
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
    result.steps = len(latencies)
    result.decisions = stats.decisions
    result.sidecar_decisions = stats.sidecar_decisions
    result.fallbacks = dict(stats.fallbacks)
    result.late_replies = stats.late_replies
    result.rejected_reports = stats.rejected_reports
    result.reconnects = stats.reconnects
    result.table_misses = sum(stats.table_misses.values())
    for reason in ERROR_FALLBACK_REASONS:
        if result.fallbacks.get(reason):
            result.error(f"{result.fallbacks[reason]} fallback(s) for reason {reason!r}")
    if result.rejected_reports:
        result.error(f"{result.rejected_reports} outcome report(s) rejected")
    if result.reconnects:
        result.error(f"{result.reconnects} reconnect(s) to the sidecar")
    result.latencies_us = latencies.tobytes()
    return result


def engine_entry(
    job: EngineJob, progress: Synchronized[int], results: multiprocessing.Queue[Any]
) -> None:
    results.put(run_engine(job, progress))
