"""`make bench-rpc`: what a decision costs, in process and over the wire.

Measures (p50/p99):
1. in-process: the Nightjar policy's decide alone, DecisionService.run_step (a table
   a step, its entry run: ids, bookkeeping, Prometheus), and a run_step + report pair;
   steps through decision tables (their amortised mean too), in rounds spread over the run;
2. the round trip of a step the held table cannot answer (a miss: the client asks for
   a table, carrying the reports queued, and waits for it) to a real `nightjar-server`
   process over a Unix socket and loopback TCP, 1 and 8 concurrent client processes;
3. a sustained 1,000 steps/s with the default 2 ms deadline, as the plugin asks: fallbacks;
4. the stock gRPC baseline: the same round trips to a bare echo server
   (`benchmarks/rpc_echo.py`);
5. the engine thread's CPU in the plugin's controller per step, warm and after a
   cache-evicting step, beside the floor (`benchmarks/hook_cost.py`).

Writes its section of docs/BENCHMARKS.md between markers (other benchmarks own
other sections) and prints the raw figures as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.hook_cost import measure_floor, measure_hook
from benchmarks.host import free_port, grpc_server, machine
from benchmarks.report import write_section
from benchmarks.rpc_echo import ECHO_KINDS, measure_echo
from benchmarks.rpc_report import (
    PER_REQUEST_CASE,
    WARM_ROUND_TRIPS,
    Measurement,
    TableWalk,
    median_round,
    render,
    summarise,
    table_walks,
)
from nightjar_common.client import (
    ClientConfig,
    GammaDecision,
    NightjarClient,
)
from nightjar_common.types import BinType, Choice, RequestSignals, StepContext, StepOutcome
from policy_server.blas_threads import limit_blas_threads
from policy_server.policies import DEFAULT_POLICY, Policy, create_policy
from policy_server.service import DecisionService
from policy_server.sim.sources import TableSource

SECTION = "bench-rpc"
# The round-trip cases alternate between these batch sizes, further apart than a table
# reaches: every step misses the held table and waits for a new one.
MISS_SIZES = (4, 48)


def contexts(engine: str, count: int, seed: int = 0) -> list[StepContext]:
    """A realistic mix: batch sizes 1..64, skewed small, with queue and KV numbers."""
    rng = random.Random(seed)
    return [
        StepContext(
            engine_id=engine,
            batch_size=min(64, int(rng.expovariate(1 / 12)) + 1),
            step_index=i,
            num_waiting=rng.randint(0, 8),
            free_kv_blocks=rng.randint(0, 4096),
            total_kv_blocks=4096,
            max_draft_lag_tokens=rng.randint(0, 256),
        )
        for i in range(count)
    ]


def outcome_for(engine: str, decision_id: str, ctx: StepContext, gamma: int) -> StepOutcome:
    generated = ctx.batch_size * (1 + gamma // 2)
    return StepOutcome(
        decision_id,
        engine,
        gamma,
        0.02 + 0.002 * gamma,
        generated,
        ctx.batch_size * gamma,
        ctx.batch_size * (gamma // 2),
    )


# -- 1. in process ------------------------------------------------------------------------


def with_requests(ctx: StepContext) -> StepContext:
    """``ctx`` with each of its requests named (the per-request mode plans for a step
    whose requests it knows): 400 context tokens each, ids that change every 50 steps."""
    cohort = ctx.step_index // 50
    requests = tuple(RequestSignals(f"r{cohort}-{j}", 400) for j in range(ctx.batch_size))
    return dataclasses.replace(ctx, requests=requests, context_tokens=400 * ctx.batch_size)


def request_outcome(ctx: StepContext, choice: Choice) -> StepOutcome:
    """``outcome_for``'s step with each request's accepts: even-numbered requests accept
    all of their γ_i, odd ones half (two populations the plans can tell apart), and a
    step time that grows with the tokens verified (so that a plan can pay)."""
    planned = dict(choice.request_gammas)
    ids = tuple(r.request_id for r in ctx.requests)
    verified = [min(planned.get(rid, choice.gamma), choice.gamma) for rid in ids]
    accepts = tuple(g if j % 2 == 0 else g // 2 for j, g in enumerate(verified))
    return dataclasses.replace(
        batch_outcome(ctx, choice),
        step_seconds=0.01 + 0.0004 * (ctx.batch_size + sum(verified)) + 0.002 * choice.gamma,
        drafted_tokens=sum(verified),
        accepted_tokens=sum(accepts),
        request_accepts=accepts,
        request_ids=ids,
    )


def measure_in_process(samples: int = 20_000) -> list[Measurement]:
    """The default policy's decide alone and through the service (a table decided and
    its entry run and reported, every step), the paper's Nightjar policy's decide for
    reference, and the default's per-request mode deciding steps whose requests are
    named (issue 30's decision cost)."""
    ctxs = contexts("bench", samples)
    warm = min(2_000, samples)
    measured = [
        decide_times(create_policy(name, {"seed": 1}), name, ctxs, warm, batch_outcome)
        for name in (DEFAULT_POLICY, "nightjar")
    ]
    planner = create_policy(DEFAULT_POLICY, {"seed": 1, "per_request": True})
    named = [with_requests(ctx) for ctx in ctxs]
    planning = decide_times(planner, PER_REQUEST_CASE, named, warm, request_outcome)

    service = DecisionService(DEFAULT_POLICY, {"seed": 1})
    decide_ns, pair_ns = [], []
    for i, ctx in enumerate(ctxs):
        start = time.perf_counter_ns()
        ran = service.run_step(ctx)
        middle = time.perf_counter_ns()
        service.report(outcome_for("bench", ran.decision_id, ctx, ran.gamma))
        end = time.perf_counter_ns()
        decide_ns.append(middle - start)
        pair_ns.append(end - start)
        if i == warm:
            decide_ns.clear()
            pair_ns.clear()
    return [
        measured[0],
        summarise(f"DecisionService.run_step, a table a step ({DEFAULT_POLICY})", decide_ns),
        summarise(f"DecisionService.run_step + report ({DEFAULT_POLICY})", pair_ns),
        measured[1],
        planning,
    ]


def batch_outcome(ctx: StepContext, choice: Choice) -> StepOutcome:
    return outcome_for("bench", "x", ctx, choice.gamma)


def decide_times(
    policy: Policy,
    label: str,
    ctxs: Sequence[StepContext],
    warm: int,
    outcome: Callable[[StepContext, Choice], StepOutcome],
) -> Measurement:
    """``policy.decide`` timed on each of ``ctxs`` after the first ``warm``, each step
    learned from its ``outcome``."""
    times_ns: list[int] = []
    for i, ctx in enumerate(ctxs):
        start = time.perf_counter_ns()
        choice = policy.decide(ctx)
        times_ns.append(time.perf_counter_ns() - start)
        policy.observe(ctx, choice, outcome(ctx, choice))
        if i == warm:
            times_ns.clear()
    return summarise(f"{type(policy).__name__}.decide ({label})", times_ns)


class TableRounds:
    """The decision-table walks of every refresh period, in rounds the caller spreads over
    its run (a round after each of the benchmark's phases): a slow spell of a shared host,
    minutes long, then lands in a round or two of each case rather than in all of one
    case's steps; per case the median round (`median_round`). Each round makes the same
    decisions (the same seeds)."""

    def __init__(self, samples: int) -> None:
        self.samples = samples
        self.runs: dict[str, list[Measurement]] = {}

    def run_round(self) -> None:
        warm = min(2_000, self.samples)
        for refresh_steps, walk in table_walks():
            for m in measure_tables(self.samples, warm, refresh_steps, walk):
                self.runs.setdefault(m.case, []).append(m)

    def medians(self) -> list[Measurement]:
        return [median_round(measured) for measured in self.runs.values()]


def table_request_outcome(decision_id: str, ctx: StepContext, gamma: int) -> StepOutcome:
    """``request_outcome`` of a table step: every request verified the table's γ (the
    simulator's tables carry no per-request γ)."""
    outcome = request_outcome(ctx, Choice(gamma, BinType.EXPLOIT))
    return dataclasses.replace(outcome, decision_id=decision_id)


def measure_tables(
    samples: int,
    warm: int,
    refresh_steps: int,
    walk: TableWalk = TableWalk.BATCH,
    inputs_only: bool = False,
) -> list[Measurement]:
    """Steps through decision tables in process, with the protocol's own code (the
    simulator's TableSource: TableCache on the client's side, DecisionService.table_step
    on the sidecar's, refreshed every ``refresh_steps`` steps or when the table cannot
    answer), on a batch
    that moves by a request or two a step, as an engine's does. Per step: deciding (the
    client's lookup, and on the steps that refresh, the sidecar deciding the next table)
    and applying (on those steps, the sidecar checking and applying the ran steps and
    outcomes since the last refresh: learning). Wire encoding is not in it (`make
    bench-load` has it). ``walk``: NAMED steps name their requests (``with_requests``,
    with ``request_outcome``'s accepts); PER_REQUEST decides those with the default's
    per-request mode, so that each refresh also plans the context's own batch size
    request by request. ``inputs_only``: the walk's own work alone — its steps' contexts
    and outcomes built, no client or sidecar asked (γ 1 every step) — what `make
    bench-instructions` subtracts from a walk's count."""
    named = walk is not TableWalk.BATCH
    # Called as outcome_for is, after its engine (a partial, not a wrapper: the step
    # instructions `make bench-instructions` counts include the walk's own).
    step_outcome = table_request_outcome if named else functools.partial(outcome_for, "bench")
    rng = random.Random(1)
    params = {"seed": 1, "per_request": walk is TableWalk.PER_REQUEST}
    source = TableSource.named(DEFAULT_POLICY, params, refresh_steps=refresh_steps)
    decide_time = source.service.metrics.decision_latency
    decide_ns: list[int] = []
    apply_ns: list[int] = []
    batch, previous = 16, None
    for i in range(samples):
        batch = min(64, max(1, batch + rng.choice((-2, -1, 0, 0, 0, 1, 2))))
        ctx = StepContext(
            "bench", batch, step_index=i, previous_gamma=previous, context_tokens=400 * batch
        )
        if named:
            ctx = with_requests(ctx)
        deciding_before = decide_time._sum.get()
        start = time.perf_counter_ns()
        if inputs_only:
            gamma, decision_id = 1, "x"
        else:
            decided = source.decide(ctx, None)  # type: ignore[arg-type]
            gamma, decision_id = decided.gamma, decided.decision_id
        step_ns = time.perf_counter_ns() - start
        outcome = step_outcome(decision_id, ctx, gamma)
        if not inputs_only:
            source.report(ctx, decision_id, outcome)
        # On a refreshing step, what the sidecar did besides deciding the table (checking
        # and applying the report batch) is applying; the rest of any step is deciding.
        table_ns = int(1e9 * (decide_time._sum.get() - deciding_before))
        applying = step_ns - table_ns if table_ns else 0
        decide_ns.append(step_ns - applying)
        apply_ns.append(applying)
        previous = gamma
        if i == warm:
            decide_ns.clear()
            apply_ns.clear()
    case = walk.case(refresh_steps)
    return [
        summarise(f"{case}: deciding a step", decide_ns),
        summarise(f"{case}: applying its report", apply_ns),
    ]


# -- 2–3. over the wire -------------------------------------------------------------------


@contextmanager
def sidecar(transport: str) -> Iterator[str]:
    """A real nightjar-server process; yields its target address."""
    with tempfile.TemporaryDirectory(prefix="nj-bench-") as tmp:
        if transport == "uds":
            listen, target = ["--uds", f"{tmp}/s.sock"], f"unix:{tmp}/s.sock"
        else:
            port = free_port()
            listen, target = ["--port", str(port)], f"127.0.0.1:{port}"
        with grpc_server(["policy_server.cli", *listen, "--log-level", "WARNING"], target):
            yield target


def client_run(args: tuple[str, str, float, int]) -> tuple[list[int], int]:
    """One engine whose every step misses the held table: ``count`` round trips, each
    carrying the previous step's outcome, after ``WARM_ROUND_TRIPS`` unmeasured ones; returns
    the measured steps' latencies (ns) and fallbacks."""
    target, engine, deadline, count = args
    client = NightjarClient(
        ClientConfig(target=target, engine_id=engine, deadline_s=deadline, connect_timeout_s=20)
    )
    nanos: list[int] = []
    misses = client.stats.table_misses
    warm_fallbacks = 0
    try:
        steps = contexts(engine, count + WARM_ROUND_TRIPS, seed=hash(engine) % 1000)
        for i, ctx in enumerate(steps):
            if i == WARM_ROUND_TRIPS:
                # A fresh sidecar's first decisions may outlast the deadline: warm-up.
                warm_fallbacks = client.stats.fallbacks_total
            ctx = dataclasses.replace(ctx, batch_size=MISS_SIZES[i % 2])
            before = misses.total()
            start = time.perf_counter_ns()
            decision = client.take(ctx)
            elapsed = time.perf_counter_ns() - start
            report(client, engine, ctx, decision)
            # A refresh the sender thread asked ahead may answer a step now and then (a
            # slow host ages tables past their refresh time): a lookup, not a round trip.
            if i >= WARM_ROUND_TRIPS and misses.total() > before:
                nanos.append(elapsed)
        missed = misses.total()
        assert missed >= 0.95 * len(steps), f"{missed} misses in {len(steps)} steps"
    finally:
        fallbacks = client.stats.fallbacks_total - warm_fallbacks
        client.close()
    return nanos, fallbacks


def report(client: NightjarClient, engine: str, ctx: StepContext, d: GammaDecision) -> None:
    if d.decision_id:
        client.report(outcome_for(engine, d.decision_id, ctx, d.gamma))


def measure_rpc(transport: str, clients: int, count: int) -> Measurement:
    # A generous deadline: this measures latency, fallbacks would truncate the tail.
    jobs = [(f"engine-{i}", 0.05, count) for i in range(clients)]
    with sidecar(transport) as target:
        if clients == 1:
            results = [client_run((target, *jobs[0]))]
        else:
            with multiprocessing.get_context("spawn").Pool(clients) as pool:
                results = pool.map(client_run, [(target, *job) for job in jobs])
    nanos = [n for latencies, _ in results for n in latencies]
    fallbacks = sum(f for _, f in results)
    return summarise(f"{transport}, {clients} client(s)", nanos, fallbacks)


def measure_rate(rate: float, seconds: float) -> dict[str, Any]:
    """Steps paced at `rate`/s with the default 2 ms deadline, as the plugin asks (the held
    table's γ, a new table asked for when it is due): fallbacks, table misses."""
    with sidecar("uds") as target:
        client = NightjarClient(ClientConfig(target=target, engine_id="rate", connect_timeout_s=20))
        rng = random.Random(0)
        batch, previous = 16, None
        start = time.perf_counter()
        for i in range(int(rate * seconds)):
            pause = start + i / rate - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
            batch = min(64, max(1, batch + rng.choice((-2, -1, 0, 0, 0, 1, 2))))
            ctx = StepContext("rate", batch, step_index=i, previous_gamma=previous)
            decision = client.decide(ctx)
            report(client, "rate", ctx, decision)
            previous = decision.gamma
        elapsed = time.perf_counter() - start
        stats = client.stats
        client.close()
    return {
        "decisions": stats.decisions,
        "achieved_rate": stats.decisions / elapsed,
        "fallbacks": stats.fallbacks_total,
        "fallbacks_by_reason": dict(stats.fallbacks),
        "late_replies": stats.late_replies,
        "table_misses": sum(stats.table_misses.values()),
    }


# -- 4. stock gRPC baseline (benchmarks/rpc_echo.py) ------------------------------------


def wire_size_payload() -> bytes:
    """A table request as the plugin sends it on a miss (context + a queued outcome),
    serialized."""
    from nightjar_proto.v1 import policy_pb2

    from nightjar_common import wire

    ctx = contexts("engine-0", 1)[0]
    request = policy_pb2.StepRequest(seq=12345, context=wire.context_to_pb(ctx))
    request.outcomes.append(wire.outcome_to_pb(outcome_for("engine-0", "ab12cd34-1f2e.3", ctx, 3)))
    return bytes(request.SerializeToString())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-rpc", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument("--json", type=Path, help="also write the raw figures here")
    parser.add_argument("--quick", action="store_true", help="small samples (smoke run)")
    args = parser.parse_args(argv)
    scale = 0.1 if args.quick else 1.0
    limit_blas_threads()  # in process as in the sidecar (policy_server/blas_threads.py)
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "load_average": [os.getloadavg()[0]],
    }
    tables = TableRounds(int(20_000 * scale))
    print("in-process decide ...", file=sys.stderr)
    in_process = measure_in_process(int(20_000 * scale))
    tables.run_round()
    rpc = []
    for transport in ("uds", "tcp"):
        print(f"rpc {transport} 1 client ...", file=sys.stderr)
        rpc.append(measure_rpc(transport, 1, int(5_000 * scale)))
        print(f"rpc {transport} 8 clients ...", file=sys.stderr)
        rpc.append(measure_rpc(transport, 8, int(1_500 * scale)))
    results["rpc"] = [dataclasses.asdict(m) for m in rpc]
    tables.run_round()
    print("stock gRPC echo baseline ...", file=sys.stderr)
    payload = wire_size_payload()
    results["baseline"] = [
        dataclasses.asdict(measure_echo(kind, int(5_000 * scale), payload)) for kind in ECHO_KINDS
    ]
    tables.run_round()
    print("sustained 1000/s ...", file=sys.stderr)
    results["rate"] = measure_rate(1000.0, 10.0 * scale)
    tables.run_round()
    print("hook ...", file=sys.stderr)
    with sidecar("uds") as target:
        hook = [measure_hook(target, int(2_000 * scale), evict) for evict in (False, True)]
    hook.append(measure_floor(int(1_000 * scale)))
    results["hook"] = [dataclasses.asdict(m) for m in hook]
    tables.run_round()
    results["in_process"] = [dataclasses.asdict(m) for m in [*in_process, *tables.medians()]]
    results["load_average"].append(os.getloadavg()[0])
    write_section(args.out, SECTION, render(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
