"""Decision sources for the simulator: a policy object in process, the real gRPC client,
and the oracle that knows the simulator's true parameters."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from nightjar_common.client import GammaDecision, NightjarClient
from nightjar_common.types import Choice, StepContext, StepOutcome
from policy_server.policies import Policy, create_policy
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
