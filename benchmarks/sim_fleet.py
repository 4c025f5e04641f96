"""`make bench-fleet`: what fleet learning buys a deployment's late joiners, and its cost.

N simulated engines of one model on one kind of hardware (a `make bench` profile), each
with its own sidecar (its own `goodput` policy), join the fleet one after another, every
``--join-gap`` seconds, and serve their share of one trace (the Azure conv trace, each
engine a window of it starting at its join, at ``--qps``). With fleet learning each
sidecar runs the fleet link's algorithm every ``--interval`` simulated seconds: it
publishes its own evidence (policies/fleet_stats.py) as a JSON record, reads the other
members' latest records (published within the TTL), checks them as the link does and
merges their sum; alone, it never does. Engines are simulated one after another in join
order, so a member merges the records of the members that joined before it (at the
simulated time of its round), not of those that join after it (which hold less evidence
than it at any time): exact for the question asked, what a late joiner gets.

Reported per profile, for the late joiners (all but the first), with and without the
fleet: time-to-good-γ (seconds from joining until, over its last 64 decided steps, the
expected tokens lost against the best γ under the simulator's true parameters first fall
below 5 %), throughput over its first minute and over its whole window, and regret; and
the CPU cost of pooling: one round's CPU time in process (encode, check, sum, merge) and,
where `redis-server` is installed, through the real link against a real Redis holding N
members' records.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nightjar_data

from benchmarks.report import write_section
from nightjar_common.json_input import load_json
from nightjar_common.types import StepContext, StepOutcome
from policy_server.policies.fleet_stats import GoodputStats
from policy_server.policies.goodput import GoodputModelPolicy
from policy_server.sim.engine import Decided, SimConfig, SimResult, Simulator
from policy_server.sim.profile import HardwareProfile, builtin_profiles
from policy_server.sim.runs import DATA_HELP, GAMMA_MAX, POPULATIONS, ProfileAssets
from policy_server.sim.sources import PolicySource
from policy_server.sim.workload import read_trace, scale_to_qps, window

SECTION = "bench-fleet"
KEY = "sim-model@sim-device"
LEARNER = f"shared:{KEY}"
# Time-to-good-γ: the window of decided steps and the share of expected tokens lost
# against the best γ it must fall below.
GOOD_WINDOW = 32
GOOD_REGRET = 0.02
FIRST_MINUTE_S = 60.0
# The early steps whose regret is reported on its own: the prior table's warm-up (32
# steps) and the first trials fall in them.
EARLY_STEPS = 256


@dataclasses.dataclass(frozen=True, slots=True)
class Setup:
    engines: int
    join_gap_s: float
    seconds: float
    qps: float
    interval_s: float
    ttl_s: float
    seed: int
    # Where in the trace the first engine's window starts (each seed another stretch).
    offset_s: float = 0.0


@dataclasses.dataclass(slots=True)
class Board:
    """What Redis would hold: each member's published records, oldest first."""

    records: dict[str, list[tuple[float, str]]] = dataclasses.field(default_factory=dict)

    def latest(self, member: str, now: float, ttl_s: float) -> str | None:
        found = None
        for published, record in self.records.get(member, []):
            if published > now:
                break
            found = record if published >= now - ttl_s else None
        return found


class FleetSource(PolicySource):
    """goodput in process under a learner key, pooling through ``board`` every
    ``interval_s`` of fleet time (the engine's simulated time plus its join time) when
    ``board`` is given."""

    def __init__(
        self,
        member: str,
        seed: int,
        assets: ProfileAssets,
        setup: Setup,
        joined_s: float,
        board: Board | None,
    ) -> None:
        policy = GoodputModelPolicy(
            {"seed": seed, "gamma_max": GAMMA_MAX, "prefill_cost_table": assets.prefill_cost_table}
        )
        super().__init__(policy)
        self.goodput = policy
        self.member = member
        self.setup = setup
        self.joined_s = joined_s
        self.board = board
        self.next_round = 0.0
        self.round_cpu_s: list[float] = []
        self.members_seen: list[int] = []

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        if self.board is not None and sim.now >= self.next_round:
            self._round(self.joined_s + sim.now)
            self.next_round = sim.now + self.setup.interval_s
        return super().decide(dataclasses.replace(ctx, learner_key=KEY), sim)

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        super().report(dataclasses.replace(ctx, learner_key=KEY), decision_id, outcome)

    def _round(self, now: float) -> None:
        """What one round of the link does but the Redis calls: publish, read, check, merge."""
        assert self.board is not None
        started = time.process_time()
        policy, scope = self.goodput, self.goodput.pool_scope
        stats = policy.local_evidence(LEARNER, self.member)
        if stats is not None:
            record = json.dumps(
                {
                    "format": "nightjar-fleet/1",
                    "scope": scope,
                    "member": self.member,
                    "learner": LEARNER,
                    "published_unix": now,
                    "stats": stats.to_json(),
                },
                separators=(",", ":"),
            )
            self.board.records.setdefault(self.member, []).append((now, record))
        total = GoodputStats.zero()
        alive = [self.member]
        for member in self.board.records:
            if member == self.member:
                continue
            text = self.board.latest(member, now, self.setup.ttl_s)
            if text is None:
                continue
            document = load_json(text)
            assert document["scope"] == scope and document["learner"] == LEARNER
            total = total.plus(policy.stats_from_json(document["stats"]))
            alive.append(member)
        policy.merge_fleet(LEARNER, total, self.member, alive)
        self.round_cpu_s.append(time.process_time() - started)
        self.members_seen.append(len(alive))


@dataclasses.dataclass(frozen=True, slots=True)
class Joiner:
    """One engine's run, as the report reads it."""

    index: int
    time_to_good_s: float | None
    first_minute_tok_s: float
    throughput: float
    regret_pct: float
    early_regret_pct: float
    first_minute_tpot_ms: float


def time_to_good(result: SimResult) -> float | None:
    decided = [s for s in result.steps if s.batch_size]
    lost = expected = 0.0
    for i, step in enumerate(decided):
        lost += step.regret_tokens
        expected += step.generated + step.regret_tokens
        if i >= GOOD_WINDOW:
            old = decided[i - GOOD_WINDOW]
            lost -= old.regret_tokens
            expected -= old.generated + old.regret_tokens
            if expected > 0 and lost / expected < GOOD_REGRET:
                return step.time_s
    return None


def joiner(index: int, result: SimResult) -> Joiner:
    first = sum(s.generated for s in result.steps if s.time_s < FIRST_MINUTE_S)
    span = min(FIRST_MINUTE_S, result.makespan_s) or 1.0
    decided = [s for s in result.steps if s.batch_size]
    return Joiner(
        index,
        time_to_good(result),
        first / span,
        result.throughput,
        _regret_pct(decided),
        _regret_pct(decided[:EARLY_STEPS]),
        _tpot_ms([r for r in result.requests if r.spec.arrival_s < FIRST_MINUTE_S]),
    )


def _tpot_ms(requests: Sequence[Any]) -> float:
    """Mean time per output token (ms) of the finished requests among ``requests``."""
    tpots = [
        (r.finish_s - r.first_token_s) / (r.spec.output_tokens - 1)
        for r in requests
        if r.finish_s is not None and r.first_token_s is not None and r.spec.output_tokens > 1
    ]
    return 1000 * statistics.fmean(tpots) if tpots else 0.0


def _regret_pct(steps: Sequence[Any]) -> float:
    """Expected tokens lost against the best γ, in % of what the best γ would make."""
    regret = sum(s.regret_tokens for s in steps)
    generated = sum(s.generated for s in steps)
    return 100 * regret / (generated + regret) if generated + regret else 0.0


def run_fleet(
    profile: HardwareProfile, assets: ProfileAssets, trace: list[Any], setup: Setup, pooled: bool
) -> tuple[list[Joiner], list[FleetSource]]:
    board = Board() if pooled else None
    joiners, sources = [], []
    acceptance = POPULATIONS["chat-sps"]
    for k in range(setup.engines):
        joined = k * setup.join_gap_s
        specs = scale_to_qps(window(trace, setup.offset_s + joined, setup.seconds), setup.qps)
        source = FleetSource(f"engine-{k}", setup.seed + k, assets, setup, joined, board)
        config = SimConfig(
            seed=setup.seed + k, gamma_max=GAMMA_MAX, track_regret=True, engine_id=f"engine-{k}"
        )
        result = Simulator(profile, acceptance, specs, source, config).run()
        joiners.append(joiner(k, result))
        sources.append(source)
    return joiners, sources


def redis_round_cost(records: dict[str, str], rounds: int) -> tuple[float, float] | None:
    """CPU and wall seconds of one FleetLink.round() against a real redis-server holding
    ``records`` (member → its record), or None without redis-server."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    from policy_server.fleet_link import FleetLink, FleetOptions
    from policy_server.metrics import Metrics
    from policy_server.service import DecisionService

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        metrics = Metrics()
        service = DecisionService("goodput", {"gamma_max": GAMMA_MAX}, metrics=metrics)
        options = FleetOptions.parse(
            {"url": f"redis://127.0.0.1:{port}/0", "member": "measured", "ttl_s": 3600.0}
        )
        link = FleetLink(service, options, metrics)
        deadline = time.monotonic() + 10
        while True:
            try:
                link.client.ping()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        scope = service.active.policy.pool_scope  # type: ignore[attr-defined]
        prefix = f"nightjar:default:{scope}"
        now = time.time()
        for member, record in records.items():
            link.client.zadd(f"{prefix}:members", {member: now + 3600})
            link.client.hset(f"{prefix}:member:{member}", LEARNER, record)
        link.round()  # the first creates the learner
        cpu, wall = [], []
        for _ in range(rounds):
            c, w = time.process_time(), time.perf_counter()
            report = link.round()
            cpu.append(time.process_time() - c)
            wall.append(time.perf_counter() - w)
            assert report.ok and not report.rejected, report
        link.stop()
        return statistics.median(cpu), statistics.median(wall)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench-fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    parser.add_argument("--data", type=Path, default=nightjar_data.ROOT, help=DATA_HELP)
    parser.add_argument("--engines", type=int, default=5)
    parser.add_argument("--join-gap", type=float, default=30.0, help="seconds between joins")
    parser.add_argument("--seconds", type=float, default=120.0, help="each engine's window (s)")
    parser.add_argument("--qps", type=float, default=4.0, help="each engine's request rate")
    parser.add_argument("--interval", type=float, default=5.0, help="fleet round period (s)")
    parser.add_argument("--ttl", type=float, default=60.0)
    parser.add_argument(
        "--seeds", type=int, default=3, help="runs 1..N, each on another stretch of the trace"
    )
    parser.add_argument("--profiles", default="", help="comma-separated (default: all)")
    args = parser.parse_args(argv)
    if args.engines < 2:
        parser.error("--engines must be >= 2 (late joiners are measured)")
    if args.seeds < 1:
        parser.error("--seeds must be >= 1")
    setup = Setup(args.engines, args.join_gap, args.seconds, args.qps, args.interval, args.ttl, 1)
    # Each seed's fleet on its own stretch of the trace, one after the other.
    stretch = (args.engines - 1) * args.join_gap + args.seconds
    setups = [
        dataclasses.replace(setup, seed=seed, offset_s=(seed - 1) * stretch)
        for seed in range(1, args.seeds + 1)
    ]
    profiles = builtin_profiles(args.data / "calibration")
    if args.profiles:
        profiles = {n: profiles[n] for n in args.profiles.split(",")}
    trace = read_trace(args.data / "traces" / "azure_llm_2023_conv.csv")
    rows, cost_rows = [], []
    # The in-process and link CPU figures share the host: its load is said beside them.
    load = os.getloadavg()[0]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nightjar-bench-fleet-") as scratch:
        for name, profile in profiles.items():
            assets = ProfileAssets.build(profile, Path(scratch))
            alone: list[Joiner] = []
            pooled: list[Joiner] = []
            for each in setups:
                joiners, _ = run_fleet(profile, assets, trace, each, pooled=False)
                alone += joiners[1:]
                joiners, sources = run_fleet(profile, assets, trace, each, pooled=True)
                pooled += joiners[1:]
            rows.append(compare(name, alone, pooled, setup))
            print(rows[-1], file=sys.stderr, flush=True)
            last = sources[-1]
            board_records = {s.member: json.dumps(_record(s)) for s in sources[:-1]}
            redis = redis_round_cost(board_records, rounds=20)
            cost_rows.append(cost_row(name, last, redis, setup))
    took = time.monotonic() - started
    host = f"{os.cpu_count()} CPUs, load average {load:.1f} at the start"
    write_section(args.out, SECTION, render(rows, cost_rows, setup, len(setups), took, host))
    return 0


def _record(source: FleetSource) -> dict[str, Any]:
    stats = source.goodput.local_evidence(LEARNER, source.member)
    assert stats is not None
    return {
        "format": "nightjar-fleet/1",
        "scope": source.goodput.pool_scope,
        "member": source.member,
        "learner": LEARNER,
        "published_unix": time.time(),
        "stats": stats.to_json(),
    }


def _fmt_time(value: float | None, setup: Setup) -> str:
    return f"{value:.0f}" if value is not None else f"> {setup.seconds:.0f}"


def compare(name: str, alone: list[Joiner], pooled: list[Joiner], setup: Setup) -> str:
    def mean_time(joiners: list[Joiner]) -> float:
        return statistics.fmean(
            j.time_to_good_s if j.time_to_good_s is not None else setup.seconds for j in joiners
        )

    def never(joiners: list[Joiner]) -> int:
        return sum(1 for j in joiners if j.time_to_good_s is None)

    cells = []
    for joiners in (alone, pooled):
        cells.append(
            f"{mean_time(joiners):.1f} ({never(joiners)}) | "
            f"{statistics.fmean(j.first_minute_tok_s for j in joiners):.0f} | "
            f"{statistics.fmean(j.first_minute_tpot_ms for j in joiners):.2f} | "
            f"{statistics.fmean(j.throughput for j in joiners):.0f} | "
            f"{statistics.fmean(j.early_regret_pct for j in joiners):.2f} | "
            f"{statistics.fmean(j.regret_pct for j in joiners):.2f}"
        )
    tpot = statistics.fmean(j.first_minute_tpot_ms for j in pooled) / statistics.fmean(
        j.first_minute_tpot_ms for j in alone
    )
    return f"| {name} | {cells[0]} | {cells[1]} | {100 * (tpot - 1):+.2f} % |"


def cost_row(name: str, last: FleetSource, redis: tuple[float, float] | None, setup: Setup) -> str:
    cpu = statistics.median(last.round_cpu_s) if last.round_cpu_s else 0.0
    members = max(last.members_seen, default=1)
    share = 100 * cpu / setup.interval_s
    link = (
        f"{1000 * redis[0]:.2f} | {1000 * redis[1]:.2f} | {100 * redis[0] / setup.interval_s:.3f} %"
        if redis is not None
        else "— | — | — (no redis-server)"
    )
    return f"| {name} | {members} | {1000 * cpu:.2f} | {share:.3f} % | {link} |"


def render(
    rows: list[str], cost_rows: list[str], setup: Setup, seeds: int, took_s: float, host: str
) -> str:
    return "\n".join(
        [
            "## Fleet learning: late joiners with and without the fleet (`make bench-fleet`)",
            "",
            f"Simulated {datetime.date.today().isoformat()} by `make bench-fleet` "
            f"(`benchmarks/sim_fleet.py`, {took_s:.0f} s on {host}): {setup.engines} "
            f"engines of one profile, each with its own `goodput` sidecar (Γmax = {GAMMA_MAX}, "
            "`chat-sps` acceptance, chunked prefill), joining every "
            f"{setup.join_gap_s:.0f} s and each "
            f"serving a {setup.seconds:.0f} s window of the Azure conv trace from its join at "
            f"{setup.qps:g} req/s; {seeds} runs (seeds 1..{seeds}), each fleet on the next "
            "stretch of the trace. With the fleet, each sidecar runs the "
            f"fleet link's round every {setup.interval_s:g} simulated seconds (its own "
            "evidence published as a JSON record; the other members' latest, published "
            f"within {setup.ttl_s:.0f} s, checked, summed and merged); alone, none. Engines "
            "are simulated in join order, so a member pools with those that joined before "
            "it. Figures are means over the late joiners (all but each run's first engine). "
            f"Time-to-good-γ: seconds from joining until the expected tokens lost against the "
            f"best γ (the simulator's true parameters) over the last {GOOD_WINDOW} decided "
            f"steps first fall below {100 * GOOD_REGRET:.0f} % (in brackets: joiners that "
            "never got there, counted at their whole window).",
            "",
            "| profile | "
            + " | ".join(
                f"{side}: {column}"
                for side in ("alone", "fleet")
                for column in (
                    "time-to-good-γ s (never)",
                    "first-minute tok/s",
                    "first-minute TPOT ms",
                    "tok/s",
                    f"regret % of the first {EARLY_STEPS} steps",
                    "regret %",
                )
            )
            + " | first-minute TPOT, fleet vs alone |",
            "|---|" + "---:|" * 13,
            *rows,
            "",
            "The CPU cost of pooling, per round of the last joiner (median): in process "
            "(encode its record, check and sum the others', merge), and through the real "
            "link (`FleetLink.round()`: the same plus the Redis calls, against a local "
            "`redis-server` holding the other members' records), with its share of one core "
            f"at a round every {setup.interval_s:g} s.",
            "",
            "| profile | members | in process ms | share of a core | real link CPU ms | "
            "real link wall ms | share of a core |",
            "|---|---:|---:|---:|---:|---:|---:|",
            *cost_rows,
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
