"""Decision sources for the simulator: a policy object in process (asked every step, or
through the decision-table protocol in process), the real gRPC client, and the oracle
that knows the simulator's true parameters."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from typing import Any

from nightjar_common.client import TABLE_REFRESH_STEPS, ClientConfig, GammaDecision, NightjarClient
from nightjar_common.tables import NextStep, ReportBatch, TableCache, refresh_due
from nightjar_common.types import Choice, RanStep, StepContext, StepOutcome
from nightjar_common.validation import MAX_BATCHED
from policy_server.policies import Policy, create_policy
from policy_server.policies.base import feasible_gamma_max, reads_request_signals
from policy_server.service import DEFAULT_HALF_WIDTH, DecisionService, TableOptions
from policy_server.sim.engine import Decided, Simulator


class PolicySource:
    """Runs a registered policy in process, through the same Policy protocol as the server;
    a policy that reads per-request signals (``reads_request_signals``) gets them, and its
    per-request γ (``Choice.request_gammas``) runs."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.per_request = reads_request_signals(policy)
        self._ids = itertools.count(1)
        self._choices: dict[str, Choice] = {}

    @classmethod
    def named(cls, name: str, params: Mapping[str, Any] | None = None) -> PolicySource:
        return cls(create_policy(name, params))

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        choice = self.policy.decide(ctx)
        decision_id = str(next(self._ids))
        self._choices[decision_id] = choice
        return Decided(choice.gamma, decision_id, choice.request_gammas)

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        choice = self._choices.pop(decision_id)
        self.policy.observe(ctx, choice, outcome)


class TableSource:
    """A policy served through decision tables (docs/DECISION_TABLES.md) in process: the
    sidecar's own DecisionService decides the tables and applies the report batches, and
    the client's own TableCache answers each step, so the simulator runs exactly the wire
    protocol's logic, without the transport. Steps carry per-request signals while the last
    table's policy reads them (``GammaTable.reads_request_signals``, the plugin's rule),
    and a table's per-request γ run (each under its step's entry).

    When a table is asked for:

    - ``refresh_ms`` None (``make bench-tables``): at a step the held table cannot answer
      or that finds it has served ``refresh_steps`` steps, with that step's context and
      every outcome before it (an idealised refresh; tables age by steps only);
    - ``refresh_ms`` a number: as the plugin's client asks (and a replay's, ClientSource):
      right after a step, for the next one (this step's context after its γ; its outcome
      not known yet), when the held table has served ``refresh_steps`` steps, is
      ``refresh_ms`` old on the simulated clock or will not answer the next step; tables
      are void after their ``valid_steps`` / ``valid_ms``, and a step the held table
      cannot answer asks with its own context (an engine's miss)."""

    def __init__(
        self,
        policy: str,
        params: Mapping[str, Any] | None = None,
        refresh_steps: int = TABLE_REFRESH_STEPS,
        half_width: int = DEFAULT_HALF_WIDTH,
        refresh_ms: float | None = None,
    ) -> None:
        self.service = DecisionService(policy, params, tables=TableOptions(half_width))
        self.refresh_steps = refresh_steps
        self.refresh_ms = math.inf if refresh_ms is None else refresh_ms
        self.timed = refresh_ms is not None
        self.per_request = False
        self.refreshes = 0
        self._cache = TableCache()
        self._reports = ReportBatch()
        self._seq = itertools.count(1)

    @classmethod
    def named(
        cls, name: str, params: Mapping[str, Any] | None = None, **options: Any
    ) -> TableSource:
        return cls(name, params, **options)

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        speculation_off = ctx.previous_gamma == 0
        now = sim.now if self.timed else 0.0
        if not self.timed and refresh_due(
            self._cache.held, ctx.batch_size, speculation_off, 0.0, self.refresh_steps, math.inf
        ):
            self._refresh(ctx)
        taken = self._cache.take_size(ctx.batch_size, speculation_off, now)
        if isinstance(taken, str):  # a miss (untimed: an exploring entry ran already)
            self._refresh(ctx)
            taken = self._cache.take_size(ctx.batch_size, speculation_off, now)
            assert not isinstance(taken, str), taken
        decision_id = taken.decision_id  # formatted once: a step's own cost
        self._reports.ran(RanStep(decision_id, ctx, taken.gamma, taken.exploited))
        if self.timed:
            self._refresh_ahead(NextStep(ctx, taken.gamma), now)
        table = taken.held.table
        self.per_request = table.reads_request_signals
        return Decided(taken.gamma, decision_id, table.request_gammas)

    def _refresh_ahead(self, step: NextStep, now: float) -> None:
        """The plugin's refresh: for the next step, when the held table is due for it."""
        if refresh_due(
            self._cache.held,
            step.batch_size,
            step.speculation_off,
            now,
            self.refresh_steps,
            self.refresh_ms,
        ):
            self._refresh(step.context())

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        self._reports.outcome(outcome)

    def _refresh(self, ctx: StepContext) -> None:
        ran, outcomes = self._reports.drain(MAX_BATCHED)
        result = self.service.table_step(ran, outcomes, ctx)
        assert result.table is not None and not result.skipped, result
        self._cache.install(result.table, next(self._seq))
        self.refreshes += 1


# How long a replay's step waits for the table it is due: a simulation is not real-time,
# so a slow answer is waited for rather than charged to the policy as a fallback.
REPLAY_WAIT_S = 10.0


class ClientSource:
    """Asks a running sidecar through the fail-open client, over decision tables as the
    plugin does: its steps carry per-request signals while the policy that decided the
    last table reads them (and a table's per-request γ run). A client in replay mode
    (:meth:`connect`) ages tables on the simulated clock and waits for each refresh it
    asks for ahead: the steps then run from the tables :class:`TableSource` with the
    client's refresh period (``refresh_ms``) would hold, whatever the simulation's pace."""

    def __init__(self, client: NightjarClient) -> None:
        self.client = client
        self.last: GammaDecision | None = None  # for live displays
        self.per_request = False
        # Steps decided, those whose context carried per-request signals, and those that
        # ran a request below the step's γ (a per-request plan): what nightjar-sim shows.
        self.steps = self.signalled = self.planned = 0

    @staticmethod
    def connect(target: str, engine_id: str, connect_timeout_s: float = 0.0) -> NightjarClient:
        """A replay's client of the sidecar at ``target``."""
        config = ClientConfig(
            target=target,
            engine_id=engine_id,
            deadline_s=REPLAY_WAIT_S,
            connect_timeout_s=connect_timeout_s,
            replay=True,
        )
        return NightjarClient(config)

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        decision = self.last = self.client.decide(ctx, sim.now)
        reads = decision.reads_request_signals
        if reads is not None:  # a fallback says nothing of the sidecar's policy
            self.per_request = reads
        decided = Decided(decision.gamma, decision.decision_id or "", decision.request_gammas)
        self.steps += 1
        self.signalled += bool(ctx.requests)
        self.planned += plans_per_request(decided)
        return decided

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        if decision_id:
            self.client.report(outcome)


def plans_per_request(decided: Decided) -> bool:
    """Whether a step runs a request below its γ (a per-request plan)."""
    return any(gamma < decided.gamma for _, gamma in decided.request_gammas)


class RequestOracleSource:
    """The limit of per-request γ: each step's plan (cap and γ_i) with the best expected
    goodput, from every request's true α (``Simulator.best_request_plan``)."""

    per_request = False  # it reads the simulator, not the requests' signals

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        top = feasible_gamma_max(ctx, ctx.max_gamma)
        plan = sim.best_request_plan(top)
        rids = [str(r.rid) for r in sim.pending_decode]
        return Decided(plan.cap, "", tuple(zip(rids, plan.gammas, strict=True)))

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        return None


class OracleSource:
    """The limit of a batch γ: the γ with the best expected goodput of each step, from true
    parameters."""

    per_request = False

    def decide(self, ctx: StepContext, sim: Simulator) -> Decided:
        top = feasible_gamma_max(ctx, ctx.max_gamma)
        goodputs = sim.expected_goodputs(top)
        return Decided(max(range(top + 1), key=goodputs.__getitem__))

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        return None
