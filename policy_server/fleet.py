"""Fleet warm start: carry one learner's state from a sidecar to another.

A new engine (a new pod, a scaled-out replica) serving the same model on the same
hardware sends the same learner key and can start from what another engine learned
instead of from the prior. ``nightjarctl export`` cuts one learner out of a sidecar's
state into a small document; ``nightjarctl import`` merges it into another sidecar's
active policy (same policy and state schema) through the admin API's Restore, leaving
every other learner and engine as it was.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping, Sequence
from typing import Any

from policy_server import snapshot

FORMAT = "nightjar-learner/1"


class FleetError(ValueError):
    """A learner document that does not fit (format, policy, schema, Γmax, learner)."""


def learner_id_for(learner_key: str = "", engine_id: str = "") -> str:
    """The state's key of a learner: shared by a learner key, or one engine's own."""
    if bool(learner_key) == bool(engine_id):
        raise FleetError("give exactly one of a learner key or an engine id")
    return f"shared:{learner_key}" if learner_key else f"engine:{engine_id}"


def export_learner(policy: str, state: Mapping[str, Any], learner: str) -> dict[str, Any]:
    """One learner of a policy's state as a portable document."""
    learners = state.get("learners")
    if not isinstance(learners, Mapping):
        raise FleetError(f"policy {policy!r} keeps no per-learner state to export")
    if learner not in learners:
        known = ", ".join(sorted(learners)) or "none"
        raise FleetError(f"no learner {learner!r} in the {policy} state (learners: {known})")
    return {
        "format": FORMAT,
        "policy": policy,
        "schema": state.get("schema"),
        "gamma_max": state.get("gamma_max"),
        "learner": learner,
        "state": learners[learner],
        "exported_unix": time.time(),
    }


def import_learner(
    policy: str,
    params: Mapping[str, Any],
    state: Mapping[str, Any],
    engines: Sequence[str],
    document: Mapping[str, Any],
) -> dict[str, Any]:
    """A snapshot document of the active policy (params, state, the sidecar's known
    ``engines``) with the learner merged in, replacing a learner of the same id; other
    learners and engines are untouched."""
    if document.get("format") != FORMAT:
        raise FleetError(f"not a {FORMAT} document")
    for field, have in (
        ("policy", policy),
        ("schema", state.get("schema")),
        ("gamma_max", state.get("gamma_max")),
    ):
        if document.get(field) != have:
            raise FleetError(
                f"the learner was exported with {field}={document.get(field)!r}; "
                f"the active policy has {field}={have!r}"
            )
    merged = copy.deepcopy(dict(state))
    learners = merged.get("learners")
    if not isinstance(learners, dict):
        raise FleetError(f"policy {policy!r} keeps no per-learner state")
    learners[str(document["learner"])] = document["state"]
    return {
        "format": snapshot.FORMAT,
        "policy": {"name": policy, "params": dict(params), "state": merged},
        "engines": list(engines),
    }
