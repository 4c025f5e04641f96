"""The active policy and its activation: built, checked and made active atomically.

One owner for which policy decides (Open Policy Agent's bundle activation): a swap, a
parameter change, a reset or a restore builds the new policy aside, loads what it
keeps, and activates it under every lock in one step; whatever fails on the way leaves
the last good policy active. The locks an engine's step takes on the policy are here
too, since an activation must hold them all: its learner's (learner_locks.py), and this
module's own, taken with all of the learners' to change the policy whole.

Lock order everywhere: an engine's shard lock (engines.py), the activation lock, the
learners' locks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from nightjar_common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
)
from nightjar_common.validation import check_client_path
from policy_server import snapshot
from policy_server.decision_log import DecisionLog, policy_record
from policy_server.learner_locks import LearnerLocks
from policy_server.metrics import Metrics
from policy_server.policies import (
    REGISTRY,
    LearnedState,
    Policy,
    PolicyError,
    TentativeDecisions,
    UnknownPolicyError,
    create_policy,
    learned_state,
    tentative_decisions,
)
from policy_server.policies.base import MalformedStateError, file_path_params
from policy_server.policies.fleet_stats import Pooling, pooling

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class ActivePolicy:
    """A policy as activated, with the optional capabilities found in it once."""

    policy: Policy
    name: str
    revision: int
    version: str
    # The policy's LearnedState, or policies.base.NOTHING_LEARNED.
    learned: LearnedState
    # The policy's TentativeDecisions; None: decided on copies (decisions.py).
    tentative: TentativeDecisions | None
    # The policy's Pooling (fleet learning, fleet_link.py); None: it cannot pool.
    pooling: Pooling | None


class PolicyActivation:
    """Holds the active policy; builds, checks and activates new ones."""

    def __init__(
        self,
        policy_name: str,
        params: Mapping[str, Any] | None,
        *,
        metrics: Metrics,
        decision_log: DecisionLog | None,
        state_dir: Path | None,
    ) -> None:
        self.metrics = metrics
        self.decision_log = decision_log
        self.state_dir = state_dir
        self._lock = threading.Lock()
        self.learner_locks = LearnerLocks()
        self._revisions = itertools.count(1)
        # Told of every activation after the first (the gRPC front notifies its streams).
        self._listeners: list[Callable[[ActivePolicy], None]] = []
        self._active = self.activate(self.build(policy_name, params), "start", "fresh")

    @property
    def active(self) -> ActivePolicy:
        return self._active

    def on_activate(self, listener: Callable[[ActivePolicy], None]) -> None:
        """Call ``listener`` with every policy activated from now on (swap, parameter
        change, restore, full reset). It runs under every lock of the policy: it must not
        block or call back into the service."""
        self._listeners.append(listener)

    # -- locks --------------------------------------------------------------------------

    @contextlib.contextmanager
    def learner_part(self, engine_id: str, learner_key: str) -> Iterator[None]:
        """Hold the lock of the learner the engine's steps change in the active policy
        (LearnedState.learner_for; ``learner_key`` the engine's, for one it has not seen):
        taken again when an activation or a reset moved it before it was held."""
        while True:
            active = self._active
            lock = self.learner_locks.of(active.learned.learner_for(engine_id, learner_key))
            with lock:
                current = self._active
                if current is active and lock is self.learner_locks.of(
                    current.learned.learner_for(engine_id, learner_key)
                ):
                    yield
                    return

    @contextlib.contextmanager
    def holding_learner(self, learner_id: str) -> Iterator[ActivePolicy]:
        """Hold the lock of one learner by its id (LearnedState.learner_for's answer), the
        one engines' steps that change it take; the active policy, which no activation can
        replace while the lock is held."""
        with self.learner_locks.of(learner_id):
            yield self._active

    @contextlib.contextmanager
    def whole_policy(self) -> Iterator[None]:
        """The activation lock and every learner's: no step is in the policy meanwhile."""
        with self._lock, self.learner_locks.every():
            yield

    # -- activation ---------------------------------------------------------------------

    def swap(self, name: str, params: Mapping[str, Any] | None, keep_state: bool) -> ActivePolicy:
        """Activate another policy; the current one stays active if anything fails."""
        candidate = self.build(name, self.confine_paths(name, params))
        with self.whole_policy():
            if keep_state:
                carry_state(self._active, candidate)
            return self.activate(candidate, "swap", "kept" if keep_state else "fresh")

    def set_params(self, changes: Mapping[str, Any]) -> ActivePolicy:
        """New parameters for the active policy, keeping its learned state."""
        with self._lock:
            current = self._active
            merged = {**current.policy.params(), **self.confine_paths(current.name, changes)}
        candidate = self.build(current.name, merged)
        with self.whole_policy():
            carry_state(self._active, candidate)
            return self.activate(candidate, "set_params", "kept")

    def activate(self, policy: Policy, event: str, state: str) -> ActivePolicy:
        """Make ``policy`` the active one (the caller holds whole_policy, but at start);
        ``event`` (start, swap, set_params, reset, restore) and ``state`` (fresh, kept,
        restored) go to the decision log."""
        revision = next(self._revisions)
        params = policy.params()
        digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:8]
        active = ActivePolicy(
            policy,
            policy.name,
            revision,
            f"r{revision}-{digest}",
            learned_state(policy),
            tentative_decisions(policy),
            pooling(policy),
        )
        self._active = active
        self.metrics.policy_swaps.labels("ok").inc()
        self.metrics.set_active_policy(active.name, active.version)
        log.info("activated policy %s version %s", active.name, active.version)
        if self.decision_log is not None:
            self.decision_log.write(
                policy_record(active.name, active.version, params, event, state)
            )
        for listener in self._listeners:
            listener(active)
        return active

    def build(self, name: str, params: Mapping[str, Any] | None) -> Policy:
        """A new policy, not active: NOT_FOUND for an unknown name, INVALID_ARGUMENT for
        parameters it refuses."""
        try:
            return create_policy(name, params)
        except UnknownPolicyError as exc:
            raise NotFoundError(str(exc)) from exc
        except PolicyError as exc:
            raise InvalidArgumentError(str(exc)) from exc

    def confine_paths(self, name: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Client-given params with every file path resolved inside the state directory;
        PermissionDeniedError for one outside it. A path equal to the active policy's own
        (the operator's, kept by SetParameters and snapshots) is left as it is."""
        confined = dict(params or {})
        spec = REGISTRY.get(name)
        if spec is None:
            return confined  # build says it is unknown
        active = self._active.policy.params() if self._active.name == name else {}
        for key in file_path_params(spec.params_type):
            given = confined.get(key)
            if not isinstance(given, str) or not given or given == active.get(key):
                continue  # "" = none; a wrong type is build's to refuse
            check_client_path(given)
            try:
                confined[key] = str(snapshot.confine(self.state_dir, given))
            except snapshot.OutsideStateDirError as exc:
                raise PermissionDeniedError(f"parameter {key!r}: {exc}") from exc
        return confined


def carry_state(old: ActivePolicy, new: Policy) -> None:
    """What ``old`` learned into ``new`` (not yet active); FAILED_PRECONDITION when it
    does not fit."""
    learned = learned_state(new)
    if old.learned.state_schema != learned.state_schema:
        raise FailedPreconditionError(
            f"cannot keep state: '{old.name}' state ({old.learned.state_schema}) does not fit "
            f"'{new.name}' ({learned.state_schema})"
        )
    try:
        learned.load_state(old.learned.state())
    except PolicyError as exc:
        raise FailedPreconditionError(f"cannot keep state: {exc}") from exc


def load_state(policy: Policy, state: Any) -> None:
    """``state`` into a policy not yet active: FAILED_PRECONDITION when it is well formed
    but does not fit (another schema, another Γmax), INVALID_ARGUMENT when it is malformed;
    a policy that chokes on garbage (IndexError, OverflowError, ...) is the latter too, not
    an internal error."""
    if not isinstance(state, Mapping):
        raise InvalidArgumentError("snapshot state must be a JSON object")
    try:
        learned_state(policy).load_state(state)
    except MalformedStateError as exc:
        raise InvalidArgumentError(f"snapshot state is malformed: {exc}") from exc
    except PolicyError as exc:
        raise FailedPreconditionError(f"snapshot state does not fit: {exc}") from exc
    except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgumentError(f"snapshot state is malformed: {exc!r}") from exc
