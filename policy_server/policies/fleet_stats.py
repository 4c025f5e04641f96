"""Fleet learning's algorithm: what a policy pools with the other sidecars of a deployment,
and how it takes the fleet's evidence into its own without counting any of it twice.

Pooling is an optional capability: a policy that can pool is a ``Pooling`` (checked with
isinstance, never a flag); the others cannot, and the fleet link says so (``pooling``).
goodput pools (``GoodputPooling``): per shared learner (a learner key: model, device,
draft, TP), its sufficient statistics, each a forgotten sum over steps, so the fleet's
model is the sum of the members' (``GoodputStats``): the acceptance counts, the step-time
regression's normal equations and residual sums, the local correction's per-cell sums
and the step count. Never decisions, engines or requests.

Counted once. A learner's models hold prior + local + fleet folded together, so the
decision path reads one model as it does alone. The learner's ``FleetShare`` records the
prior and the fleet's part as they were when last folded in, and the models count the
decays applied since (``forgotten`` in models.py), so what those parts are worth now is
known exactly and local = models − prior·f − fleet·f. A sidecar publishes that local part
only; a merge replaces the fleet's part with the sum of the *other* members' published
local parts. So a member's own evidence never comes back to it, nothing is subtracted
twice, and after a restart its record under its member id is overwritten, not added to
(the snapshot carries the share, so the restored local part is its own). A learner
whose local part another member learned (an import, another pod's snapshot) gives it up
while that member still publishes it, and adopts it once that member has left.

Forgetting works as alone: each member's local part forgets at its own steps; the
fleet's part in a learner forgets at the learner's own steps between merges and is
replaced at each merge by the members' latest, so a fleet-wide shift is forgotten at the
rate each member forgets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from policy_server.policies.base import MAX_COUNT, learner_id_of_key
from policy_server.policies.models import (
    FEATURES,
    MAX_OCTAVE,
    AcceptanceModel,
    FloatArray,
    LocalCorrection,
    StepTimeModel,
)

# What a goodput learner's pooled statistics are: another layout is another schema, and
# only statistics of one schema (and one Γmax: the correction's rows) are ever summed.
STATS_SCHEMA = "goodput-stats/1"
# The pooled step count is capped well below what a state may hold (base.MAX_COUNT).
MAX_POOLED_STEPS = MAX_COUNT >> 4
# The correction's row: [n, Σy, Σx...].
ROW = 2 + FEATURES


@runtime_checkable
class Pooling(Protocol):
    """What a policy that pools across sidecars offers the fleet link (all calls under the
    lock of the learner named, the way the server changes a learner)."""

    @property
    def pool_scope(self) -> str:
        """What must match for two sidecars' statistics to be summed (the policy, its
        statistics' schema and whatever shapes them, e.g. Γmax)."""
        ...

    def pooled_learners(self) -> list[str]:
        """The learner ids that pool: those of learner keys, never one engine's own."""
        ...

    def local_evidence(self, learner_id: str, member: str) -> GoodputStats | None:
        """What ``member`` (this sidecar) learned itself of ``learner_id``; None when it
        has no such learner or its local part is another member's to publish."""
        ...

    def merge_fleet(
        self, learner_id: str, fleet: GoodputStats, member: str, alive: Collection[str]
    ) -> None:
        """Make ``fleet`` (the other members' evidence, summed) the learner's fleet part,
        creating the learner when new; ``alive``: the members publishing now."""
        ...

    def stats_from_json(self, data: Any) -> GoodputStats:
        """Statistics as published, checked (ValueError, TypeError or KeyError if not)."""
        ...

    def evidence(self, learner_id: str) -> tuple[dict[str, float], dict[str, float]]:
        """The learner's local and fleet evidence (steps, acceptance tokens), for people
        and metrics."""
        ...


def pooling(policy: object) -> Pooling | None:
    """``policy`` as a Pooling, or None when it cannot pool."""
    return policy if isinstance(policy, Pooling) else None


@dataclasses.dataclass(slots=True)
class GoodputStats:
    """A goodput learner's sufficient statistics; every member is a forgotten sum."""

    # [successes, failures] of AcceptanceModel.
    acceptance: FloatArray
    # StepTimeModel's A and b, and [count, weight_sum, squared_error].
    gram: FloatArray
    moment: FloatArray
    sums: FloatArray
    # LocalCorrection.blocks: octave → rows γ = 0..Γmax of [n, Σy, Σx...].
    correction: dict[int, FloatArray]
    steps: int

    @classmethod
    def zero(cls) -> GoodputStats:
        return cls(
            np.zeros(2), np.zeros((FEATURES, FEATURES)), np.zeros(FEATURES), np.zeros(3), {}, 0
        )

    def plus(self, other: GoodputStats) -> GoodputStats:
        correction = {o: b.copy() for o, b in self.correction.items()}
        for octave, block in other.correction.items():
            if octave in correction:
                correction[octave] += block
            else:
                correction[octave] = block.copy()
        return GoodputStats(
            self.acceptance + other.acceptance,
            self.gram + other.gram,
            self.moment + other.moment,
            self.sums + other.sums,
            correction,
            min(self.steps + other.steps, MAX_POOLED_STEPS),
        )

    def minus(self, other: GoodputStats) -> GoodputStats:
        """This less ``other``, with counts that rounding would take below 0 at 0."""
        correction = {}
        for octave, block in self.correction.items():
            less = other.correction.get(octave)
            rows = block - less if less is not None else block.copy()
            rows[:, :2] = np.maximum(rows[:, :2], 0.0)
            # A cell whose count is rounding noise was not run here.
            rows[rows[:, 0] < 1e-9] = 0.0
            if rows[:, 0].any():
                correction[octave] = rows
        return GoodputStats(
            np.maximum(self.acceptance - other.acceptance, 0.0),
            self.gram - other.gram,
            self.moment - other.moment,
            np.maximum(self.sums - other.sums, 0.0),
            correction,
            max(self.steps - other.steps, 0),
        )

    def decayed(
        self, acceptance: float, step_time: float, correction: Mapping[int, FloatArray]
    ) -> GoodputStats:
        """What these statistics, folded into a learner, are worth after its models applied
        the decays whose products are given (the models' ``forgotten``)."""
        blocks = {}
        for octave, block in self.correction.items():
            factors = correction.get(octave)
            blocks[octave] = block * factors[:, None] if factors is not None else block.copy()
        return GoodputStats(
            self.acceptance * acceptance,
            self.gram * step_time,
            self.moment * step_time,
            self.sums * step_time,
            blocks,
            self.steps,
        )

    @property
    def empty(self) -> bool:
        """Whether this holds no evidence at all."""
        return not (
            self.steps or self.correction or self.acceptance.any() or self.sums.any()
        ) and not (self.gram.any() or self.moment.any())

    def summary(self) -> dict[str, float]:
        """Steps and acceptance tokens (forgotten): how much evidence this is."""
        return {"steps": self.steps, "acceptance_tokens": round(float(self.acceptance.sum()), 3)}

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": STATS_SCHEMA,
            "acceptance": self.acceptance.tolist(),
            "gram": self.gram.tolist(),
            "moment": self.moment.tolist(),
            "sums": self.sums.tolist(),
            "correction": [
                [octave, gamma, *row.tolist()]
                for octave, block in sorted(self.correction.items())
                for gamma, row in enumerate(block)
                if row[0] > 0
            ],
            "steps": self.steps,
        }

    @classmethod
    def from_json(cls, data: Any, gamma_max: int) -> GoodputStats:
        """Statistics from their JSON, checked as a state is: shapes, finite numbers,
        counts >= 0; ValueError, TypeError or KeyError says what is wrong."""
        if not isinstance(data, Mapping) or data.get("schema") != STATS_SCHEMA:
            raise ValueError(f"not {STATS_SCHEMA} statistics")
        acceptance = _array(data["acceptance"], (2,), "acceptance")
        sums = _array(data["sums"], (3,), "sums")
        if (acceptance < 0).any() or (sums < 0).any():
            raise ValueError("acceptance counts and step-time sums must be >= 0")
        correction: dict[int, FloatArray] = {}
        entries = data["correction"]
        if not isinstance(entries, list) or len(entries) > (MAX_OCTAVE + 1) * (gamma_max + 1):
            raise ValueError("correction must be a list of at most one row per cell")
        for entry in entries:
            if not isinstance(entry, list) or len(entry) != 2 + ROW:
                raise ValueError(f"a correction row is [octave, γ, {ROW} numbers]")
            octave, gamma = entry[0], entry[1]
            if not (_is_int(octave) and _is_int(gamma)):
                raise TypeError("a correction row's octave and γ must be integers")
            if not (0 <= octave <= MAX_OCTAVE and 0 <= gamma <= gamma_max):
                raise ValueError(
                    f"correction rows need octave in 0..{MAX_OCTAVE}, γ in 0..{gamma_max}"
                )
            row = _array(entry[2:], (ROW,), "correction row")
            if row[0] < 0 or row[1] < 0:
                raise ValueError("a correction row's count and time must be >= 0")
            block = correction.setdefault(octave, np.zeros((gamma_max + 1, ROW)))
            block[gamma] = row
        steps = data["steps"]
        if not (_is_int(steps) and 0 <= steps <= MAX_POOLED_STEPS):
            raise ValueError(f"steps must be an integer in 0..{MAX_POOLED_STEPS}")
        return cls(
            acceptance,
            _array(data["gram"], (FEATURES, FEATURES), "gram"),
            _array(data["moment"], (FEATURES,), "moment"),
            sums,
            correction,
            int(steps),
        )


@dataclasses.dataclass(slots=True)
class FleetShare:
    """What of a learner is not its own sidecar's, as it was when last folded in: the
    acceptance prior's pseudo-counts and the fleet's statistics; and whose local part
    the rest is (``member``: the sidecar that learned it)."""

    member: str
    prior: FloatArray
    fleet: GoodputStats

    def to_json(self, learner: PooledLearner) -> dict[str, Any]:
        """As the learner's state holds it: decayed to now (loading resets the models'
        decay products), with a summary of local and fleet evidence for people."""
        prior, fleet = _not_local(learner, self.prior)
        local = _combined(learner).minus(fleet)
        local.acceptance = np.maximum(local.acceptance - prior, 0.0)
        return {
            "member": self.member,
            "prior": prior.tolist(),
            "stats": fleet.to_json(),
            # Derived, for people (nightjarctl state): not read back.
            "evidence": {"local": local.summary(), "fleet": fleet.summary()},
        }

    @classmethod
    def from_json(cls, data: Any, gamma_max: int) -> FleetShare | None:
        """A learner state's share (None: the learner never merged a fleet's evidence)."""
        if data is None:
            return None
        if not isinstance(data, Mapping) or not isinstance(data["member"], str):
            raise TypeError("a learner's fleet share must be an object with a member id")
        prior = _array(data["prior"], (2,), "fleet prior")
        if (prior < 0).any():
            raise ValueError("the fleet share's prior counts must be >= 0")
        return cls(data["member"], prior, GoodputStats.from_json(data["stats"], gamma_max))


class PooledLearner(Protocol):
    """What pooling reads and replaces of a goodput learner."""

    acceptance: AcceptanceModel
    step_time: StepTimeModel
    correction: LocalCorrection
    steps: int
    fleet: FleetShare | None


class PoolingHost(Protocol):
    """What GoodputPooling needs of its policy: its learners (engine_state.LearnerBook)
    and its parameters (Γmax, the acceptance prior)."""

    @property
    def gamma_max(self) -> int: ...

    @property
    def _book(self) -> Any: ...

    @property
    def _params(self) -> Any: ...


def _pooled(host: PoolingHost, learner_id: str, create: bool = False) -> PooledLearner | None:
    learner: PooledLearner | None = (
        host._book.learner(learner_id) if create else host._book.learners.get(learner_id)
    )
    return learner


def _acceptance_prior(host: PoolingHost) -> FloatArray:
    """The acceptance prior's pseudo-counts (AcceptanceModel.with_prior)."""
    alpha, weight = host._params.prior_alpha, host._params.prior_weight
    return np.array([alpha * weight, (1.0 - alpha) * weight])


class GoodputPooling:
    """Pooling of the goodput policy (its learners are PooledLearner)."""

    @property
    def pool_scope(self: PoolingHost) -> str:
        return f"goodput/{STATS_SCHEMA}/gamma_max={self.gamma_max}"

    def pooled_learners(self: PoolingHost) -> list[str]:
        return [lid for lid in tuple(self._book.learners) if lid.startswith(learner_id_of_key(""))]

    def local_evidence(self: PoolingHost, learner_id: str, member: str) -> GoodputStats | None:
        learner = _pooled(self, learner_id)
        if learner is None:
            return None
        share = learner.fleet
        if share is not None and share.member not in ("", member):
            return None  # another member's to publish (or to give up at the next merge)
        return _local(learner, _acceptance_prior(self))

    def merge_fleet(
        self: PoolingHost,
        learner_id: str,
        fleet: GoodputStats,
        member: str,
        alive: Collection[str],
    ) -> None:
        learner = _pooled(self, learner_id, create=True)
        assert learner is not None
        share = learner.fleet
        prior = share.prior if share is not None else _acceptance_prior(self)
        prior_now, _ = _not_local(learner, prior)
        local = _local(learner, _acceptance_prior(self))
        if share is not None and share.member not in ("", member) and share.member in alive:
            # Its owner publishes it: counted through the fleet, not again here.
            local = GoodputStats.zero()
        elif fleet.empty and (share is None or share.fleet.empty):
            # Nothing of the fleet's before or now (a first member): the models stay as
            # they are, decisions too; only the share is marked.
            _mark(learner, prior_now, member, fleet)
            return
        _fold(learner, prior_now, local.plus(fleet), member, fleet)

    def stats_from_json(self: PoolingHost, data: Any) -> GoodputStats:
        return GoodputStats.from_json(data, self.gamma_max)

    def evidence(self: PoolingHost, learner_id: str) -> tuple[dict[str, float], dict[str, float]]:
        learner = _pooled(self, learner_id)
        if learner is None:
            return GoodputStats.zero().summary(), GoodputStats.zero().summary()
        share = learner.fleet
        _, fleet = _not_local(learner, share.prior if share else _acceptance_prior(self))
        return _local(learner, _acceptance_prior(self)).summary(), fleet.summary()


def _combined(learner: PooledLearner) -> GoodputStats:
    """Everything the learner's models hold (prior, local and fleet)."""
    a, t, c = learner.acceptance, learner.step_time, learner.correction
    return GoodputStats(
        np.array([a.successes, a.failures]),
        t.gram.copy(),
        t.moment.copy(),
        np.array([t.count, t.weight_sum, t.squared_error]),
        {octave: block.copy() for octave, block in c.blocks.items()},
        learner.steps,
    )


def _not_local(learner: PooledLearner, prior: FloatArray) -> tuple[FloatArray, GoodputStats]:
    """The prior's counts and the fleet's statistics as the learner's models hold them
    now (``prior``: the prior's counts when last folded in; without a share, at creation:
    a learner loaded from a state without a share counts its prior as undecayed since,
    the most it can hold of it, its pseudo-tokens)."""
    forgotten = learner.acceptance.forgotten
    share = learner.fleet
    if share is None:
        return prior * forgotten, GoodputStats.zero()
    fleet = share.fleet.decayed(
        forgotten, learner.step_time.forgotten, learner.correction.forgotten
    )
    return share.prior * forgotten, fleet


def _local(learner: PooledLearner, prior: FloatArray) -> GoodputStats:
    """What the learner learned from this sidecar's own steps."""
    share = learner.fleet
    prior_now, fleet = _not_local(learner, share.prior if share is not None else prior)
    local = _combined(learner).minus(fleet)
    local.acceptance = np.maximum(local.acceptance - prior_now, 0.0)
    return local


def _fold(
    learner: PooledLearner,
    prior: FloatArray,
    evidence: GoodputStats,
    member: str,
    fleet: GoodputStats,
) -> None:
    """Replace the learner's models by ``prior`` + ``evidence`` (local + the fleet's),
    their decay products reset, with the share that says which part is the fleet's."""
    a, t, c = learner.acceptance, learner.step_time, learner.correction
    counts = evidence.acceptance + prior
    learner.acceptance = AcceptanceModel(float(counts[0]), float(counts[1]), a.decay)
    step_time = StepTimeModel(t.decay, t.ridge, t.refit_every, t.refit_ms)
    step_time.gram = evidence.gram
    step_time.moment = evidence.moment
    step_time.count, step_time.weight_sum, step_time.squared_error = (
        float(v) for v in evidence.sums
    )
    learner.step_time = step_time  # solved afresh by the next decision
    correction = LocalCorrection(c.decay, c.prior_steps, c.gamma_max)
    correction.blocks = evidence.correction
    learner.correction = correction
    learner.steps = evidence.steps
    learner.fleet = FleetShare(member, prior.copy(), fleet)


def _mark(learner: PooledLearner, prior: FloatArray, member: str, fleet: GoodputStats) -> None:
    """The share of a learner whose models stay as they are: what of them is not its own
    as of now, and the models' decay products counted from now."""
    learner.acceptance.forgotten = 1.0
    learner.step_time.forgotten = 1.0
    learner.correction.forgotten = {}
    learner.fleet = FleetShare(member, prior.copy(), fleet)


def _array(data: Any, shape: tuple[int, ...], name: str) -> FloatArray:
    if not isinstance(data, list):
        raise TypeError(f"{name} must be a list")
    array = np.asarray(data, dtype=np.float64)
    if array.shape != shape or not np.isfinite(array).all():
        raise ValueError(f"{name} must be finite numbers of shape {shape}")
    if (np.abs(array) > 1e60).any():  # snapshot.MAX_RESTORED_FLOAT: room to grow
        raise ValueError(f"{name} holds a magnitude beyond 1e60")
    return array


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
