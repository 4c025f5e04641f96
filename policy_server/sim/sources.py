"""Decision sources for the simulator: a policy object in process (asked every step, or
through decision tables), the real gRPC client, and the oracle that knows the simulator's
true parameters."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from nightjar_common.client import GammaDecision, NightjarClient
from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.policies import Policy, ServedPolicy, create_policy
from policy_server.sim.engine import Simulator


class PolicySource:
    """Runs a registered policy in process, through the same Policy protocol as the server."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._ids = itertools.count(1)
        self._choices: dict[str, Choice] = {}

    @classmethod
    def named(cls, name: str, params: Mapping[str, Any] | None = None) -> PolicySource:
        return cls(create_policy(name, params))

    def decide(self, ctx: StepContext, sim: Simulator) -> tuple[int, str]:
        choice = self.policy.decide(ctx)
        decision_id = str(next(self._ids))
        self._choices[decision_id] = choice
        return choice.gamma, decision_id

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        choice = self._choices.pop(decision_id)
        self.policy.observe(ctx, choice, outcome)


class TableSource:
    """A policy consulted through decision tables (docs/DECISION_TABLES.md), emulated in
    process: every ``refresh_steps`` steps, or when the batch size leaves the table, the
    policy decides the γ of every batch size within ``half_width`` of the current one at
    once (one posterior draw for the table); each step runs its batch size's entry, commits
    that entry's state (γ_prev, a trial started) and learns from its outcome at once, as a
    sidecar applying a report batch before deciding the next table would. A table holds one
    row per speculation state the step starts from (γ_prev = 0 or > 0), because turning
    speculation back on pays a catch-up the policy prices (the switching cost). Only for
    policies whose checkpoints cover decide (``checkpoints_decide``)."""

    def __init__(self, policy: ServedPolicy, refresh_steps: int = 8, half_width: int = 8) -> None:
        if not policy.checkpoints_decide:
            raise ValueError(f"{policy.name}: decision tables need checkpoints_decide")
        self.policy = policy
        self.refresh_steps = refresh_steps
        self.half_width = half_width
        self.refreshes = 0
        self._table: dict[tuple[int, bool], tuple[StepContext, Choice, object]] = {}
        self._age = 0
        self._ids = itertools.count(1)
        self._choices: dict[str, Choice] = {}

    @classmethod
    def named(
        cls, name: str, params: Mapping[str, Any] | None = None, **options: int
    ) -> TableSource:
        return cls(create_policy(name, params), **options)

    def decide(self, ctx: StepContext, sim: Simulator) -> tuple[int, str]:
        key = (ctx.batch_size, ctx.previous_gamma == 0)
        if self._age >= self.refresh_steps:
            self._table.clear()
        if key not in self._table:
            self._refresh(ctx)
        entry_ctx, choice, after = self._table[key]
        if choice.bin_type is BinType.EXPLORE:
            del self._table[key]  # a trial or a draw's exploration runs once
        self.policy.restore(entry_ctx, after)
        self._age += 1
        decision_id = str(next(self._ids))
        self._choices[decision_id] = choice
        return choice.gamma, decision_id

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        self.policy.observe(ctx, self._choices.pop(decision_id), outcome)

    def _refresh(self, ctx: StepContext) -> None:
        low = max(1, ctx.batch_size - self.half_width)
        sizes = [
            ctx.batch_size,
            *(b for b in range(low, ctx.batch_size + self.half_width + 1) if b != ctx.batch_size),
        ]
        if not self._table:
            self._age = 0
        stopped = ctx.previous_gamma == 0
        for entry in self.policy.decide_candidates(ctx, sizes):
            self._table[entry[0].batch_size, stopped] = entry
        self.refreshes += 1


class ClientSource:
    """Asks a running sidecar through the fail-open client, exactly as the plugin does."""

    def __init__(self, client: NightjarClient) -> None:
        self.client = client
        self.last: GammaDecision | None = None  # for live displays

    def decide(self, ctx: StepContext, sim: Simulator) -> tuple[int, str]:
        decision = self.last = self.client.decide(ctx)
        return decision.gamma, decision.decision_id or ""

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        if decision_id:
            self.client.report(outcome)


class OracleSource:
    """The limit: the γ with the best expected goodput of each step, from true parameters."""

    def decide(self, ctx: StepContext, sim: Simulator) -> tuple[int, str]:
        top = ctx.max_gamma if ctx.draft_resident else 0
        goodputs = sim.expected_goodputs(top)
        best = max(range(top + 1), key=goodputs.__getitem__)
        return best, ""

    def report(self, ctx: StepContext, decision_id: str, outcome: StepOutcome) -> None:
        return None
