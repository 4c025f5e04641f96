"""Offline replay of decision logs.

Joins logged decisions with their outcomes and feeds them to a fresh policy's
learner, so an operator can (a) warm-start a new replica or a candidate
policy from production history and (b) see the logged goodput per batch size
and γ. The result is a snapshot document `nightjarctl restore` accepts.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from nightjar_common.types import BinType, Choice
from policy_server import snapshot
from policy_server.decision_log import (
    context_from_json,
    last_activation,
    outcome_from_json,
    read_logs,
)
from policy_server.policies import DEFAULT_POLICY, Policy, create_policy, learned_state


@dataclasses.dataclass(slots=True)
class ReplayResult:
    policy: Policy
    decisions: int = 0
    outcomes: int = 0
    # (batch_size, gamma) -> [steps, summed goodput]
    cells: dict[tuple[int, int], list[float]] = dataclasses.field(
        default_factory=lambda: collections.defaultdict(lambda: [0, 0.0])
    )

    def snapshot_document(self) -> dict[str, Any]:
        return {
            "format": snapshot.FORMAT,
            "created_unix": time.time(),
            "policy": {
                "name": self.policy.name,
                "version": "replay",
                "params": self.policy.params(),
                "state": learned_state(self.policy).state(),
            },
            "engines": sorted(learned_state(self.policy).state().get("engines", {})),
        }

    def table(self) -> list[tuple[int, int, int, float]]:
        """Rows (batch_size, gamma, steps, mean goodput), sorted."""
        return [
            (bs, gamma, int(n), total / n) for (bs, gamma), (n, total) in sorted(self.cells.items())
        ]


def replay_policy(
    paths: Iterable[str | Path], policy_name: str | None
) -> tuple[str, dict[str, Any], str]:
    """The policy to replay into and its parameters, and where they came from: the logs'
    last policy record (the policy the sidecar ran when they end, with its parameters, e.g.
    ones changed with set-params), or the last of ``policy_name``; its defaults when the
    logs never ran it."""
    logged = last_activation(paths, policy_name)
    if logged is not None:
        version = logged.get("policy_version", "")
        return str(logged["policy"]), dict(logged["params"]), f"parameters as logged, {version}"
    if policy_name is None:
        return DEFAULT_POLICY, {}, "the default: the logs record no policy"
    return policy_name, {}, "its defaults: the logs record no activation of it"


def replay(
    paths: Iterable[str | Path], policy_name: str, params: Mapping[str, Any] | None = None
) -> ReplayResult:
    """Feed every logged (context, outcome) pair to a fresh policy, in log order."""
    result = ReplayResult(create_policy(policy_name, params))
    for joined in read_logs(paths):
        result.decisions += 1
        if joined.outcome is None:
            continue
        ctx = context_from_json(joined.decision["context"])
        outcome = outcome_from_json(joined.outcome)
        if not 0 <= outcome.gamma <= result.policy.gamma_max:
            continue  # logged under a policy with a larger Γmax
        # A per-request decision's γ by request, as logged (its first requests: the
        # context's kept ones); a request without one verified the step's γ.
        told = joined.decision.get("request_gammas") or {}
        choice = Choice(
            gamma=int(joined.decision["gamma"]),
            bin_type=BinType.FIXED,
            request_gammas=tuple((str(rid), int(gamma)) for rid, gamma in told.items()),
        )
        result.policy.observe(ctx, choice, outcome)
        result.outcomes += 1
        cell = result.cells[(ctx.batch_size, outcome.gamma)]
        cell[0] += 1
        cell[1] += outcome.goodput
    return result
