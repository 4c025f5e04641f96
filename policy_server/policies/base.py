"""The protocol every γ policy implements (Policy), the optional capabilities the server
discovers in one (LearnedState, TentativeDecisions), and helpers they share.

A policy is a small, engine-agnostic object: it sees a StepContext, returns a
Choice, and learns from StepOutcomes. It knows nothing of gRPC or vLLM.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import types
import typing
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.prefill_cost import PrefillCostError, PrefillCostTable

log = logging.getLogger(__name__)


class PolicyError(ValueError):
    """Bad policy parameters or an incompatible learned state."""


class MalformedStateError(PolicyError):
    """A learned state that no policy could have written (a value out of range, a wrong
    type), as opposed to a well-formed one that does not fit (another schema or Γmax)."""


# The largest count (steps, pulls, tokens summed) a learned state may hold: a step a
# microsecond for 290,000 years.
MAX_COUNT = 1 << 63

# What load_state accepts of a count (count_limit): MAX_COUNT for what the sidecar wrote,
# half of it in a state a client restores (with_room_to_count), so that a restored count
# can still grow for 2^62 steps and be written and read back (one at MAX_COUNT would make
# every snapshot after its next step unreadable at start).
_COUNT_LIMIT: contextvars.ContextVar[int] = contextvars.ContextVar("count_limit", default=MAX_COUNT)


def count_limit() -> int:
    """The largest count load_state accepts here (MAX_COUNT unless restoring)."""
    return _COUNT_LIMIT.get()


@contextlib.contextmanager
def with_room_to_count() -> Iterator[None]:
    """Load states (a client's Restore) leaving every count room to grow."""
    token = _COUNT_LIMIT.set(MAX_COUNT >> 1)
    try:
        yield
    finally:
        _COUNT_LIMIT.reset(token)


class Policy(Protocol):
    """What deciding γ takes; as small as SGLang's adaptive-spec protocol
    (get_steps_for_batch / on_verify_complete). The simulator drives policies through it."""

    name: ClassVar[str]

    @property
    def gamma_max(self) -> int:
        """Largest γ this policy can choose (Γmax)."""
        ...

    def params(self) -> dict[str, Any]:
        """Effective parameters as a JSON-serialisable dict."""
        ...

    def decide(self, ctx: StepContext) -> Choice:
        """Choose γ for the step described by ``ctx``."""
        ...

    def observe(self, ctx: StepContext, choice: Choice, outcome: StepOutcome) -> None:
        """Learn from the outcome of a step this policy decided."""
        ...


def reads_request_signals(policy: object) -> bool:
    """Whether ``policy`` decides per request from StepContext.requests and the request ids
    of outcomes (its class sets ``reads_request_signals``); engines send those only then:
    a policy that decides for the batch has no use for them."""
    return bool(getattr(policy, "reads_request_signals", False))


def prices_speculation_state(policy: object) -> bool:
    """Whether ``policy``'s decision for a step may depend on the speculation state the step
    starts in (its class sets ``prices_speculation_state``; assumed so unless it says
    not): a decision table then answers steps in its own state only (GammaTable.
    any_speculation_state)."""
    return bool(getattr(policy, "prices_speculation_state", True))


def trim_state(policy: object, state: dict[str, Any], excess_bytes: int) -> str:
    """Drop, in place, what ``state`` (as ``policy`` writes it) can lose and be learned
    again, to shorten its JSON by ``excess_bytes`` (its class's ``trim_state``: goodput's
    per-request records); what was dropped, "" for nothing (a policy without one)."""
    trim = getattr(policy, "trim_state", None)
    return str(trim(state, excess_bytes)) if trim is not None else ""


@typing.runtime_checkable
class LearnedState(Protocol):
    """Optional capability: what the server does with what a policy has learned (reads,
    snapshots, restores, resets, evictions; learner locks). A policy without it learns
    nothing the server keeps (learned_state gives NOTHING_LEARNED for it)."""

    # Policies with the same schema can carry learned state across a swap.
    state_schema: ClassVar[str]

    def state(self, engine_id: str | None = None) -> dict[str, Any]:
        """Learned state as JSON-serialisable data: all of it, or one engine's part (its
        record and the learner it updates), or with UNOWNED the part no engine's shows
        (learners no engine updates now). The parts of all engines and UNOWNED, merged by
        merge_state_parts, are the whole state: the server reads it so, an engine at a
        time (policy_server/state_store.py). One engine's part costs what that part holds,
        whatever the number of engines."""
        ...

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Replace the learned state; raise PolicyError and change nothing if it does not fit."""
        ...

    def reset(self, engine_id: str | None = None) -> None:
        """Forget learned state (of one engine when given)."""
        ...

    def forget_learner(self, learner_key: str) -> None:
        """Drop what was learned under ``learner_key`` (nothing when the policy keeps no
        tables per key): the server bounds how many keys it holds and calls this for the
        least recently used one it evicts (policy_server/engines.py)."""
        ...

    def learner_for(self, engine_id: str, learner_key: str) -> str:
        """The learner whose state the engine's decisions and outcomes change, besides its
        own record: the one its record updates, or for an engine without a record the one
        a step sending ``learner_key`` would create (own_learner(engine_id) when nothing is
        shared). Steps of one learner are serialised by the server, those of others not
        (a lock per learner, policy_server/learner_locks.py)."""
        ...


@typing.runtime_checkable
class TentativeDecisions(Protocol):
    """Optional capability: deciding for batch sizes the engine may run, then keeping
    only the one it ran. A decision table holds γ for several batch sizes and the engine
    runs one entry a step; only that decision may count, so schedules, RNG draws and
    γ_prev advance exactly as if only it had been asked for. A policy without it is
    decided on a deep copy per batch size and asked again, live, for the entry that ran
    (policy_server/decisions.py): correct, and as costly as the copy."""

    def decide_candidates(
        self, ctx: StepContext, batch_sizes: Sequence[int]
    ) -> list[tuple[Choice, object]]:
        """The choice for ``ctx`` at each batch size (in order), each with what committing
        it takes (opaque to the server); the policy's state is left unchanged."""
        ...

    def commit(self, ctx: StepContext, decided: object) -> None:
        """The engine ran the candidate decided with ``decided`` (for a context of that
        engine and batch size): leave the policy as deciding it alone would have."""
        ...

    def exploit(self, decided: object) -> tuple[Choice, object] | None:
        """For a candidate that explores, decided with ``decided``: the choice the policy
        exploits at its batch size, with what committing that takes. A step there runs it
        once the exploration ran (GammaTable.exploit_gammas), so that exploring once costs
        no new table. None: there is none (such a step asks again)."""
        ...


# LearnedState.state's engine id for the part of a state no engine's part shows: learners
# that no engine updates now (an evicted engine's shared learner). Engine ids are never
# empty (nightjar_common/validation.py).
UNOWNED = ""


def merge_state_parts(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The state whose parts (LearnedState.state of some engines and UNOWNED) are ``parts``:
    members that are JSON objects (engines, learners, slots: keyed by engine or learner id)
    are merged key by key, each sorted by key as a whole state is; the others (schema,
    gamma_max) are the same in every part and taken from the first. A learner several
    parts show is taken from the last (each part is consistent on its own)."""
    merged: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, Mapping):
                merged.setdefault(key, {}).update(value)
            else:
                merged.setdefault(key, value)
    return {
        key: dict(sorted(value.items())) if isinstance(value, dict) else value
        for key, value in merged.items()
    }


class NothingLearned:
    """LearnedState of a policy without one: an empty state of schema ``stateless/1``
    (what every policy that learns nothing reads and writes, so they swap keeping it)."""

    state_schema: ClassVar[str] = "stateless/1"

    def state(self, engine_id: str | None = None) -> dict[str, Any]:
        return {"schema": self.state_schema}

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("schema") != self.state_schema:
            raise PolicyError(f"state schema {state.get('schema')!r} is not {self.state_schema}")

    def reset(self, engine_id: str | None = None) -> None:
        return None

    def forget_learner(self, learner_key: str) -> None:
        return None

    def learner_for(self, engine_id: str, learner_key: str) -> str:
        return own_learner(engine_id)


NOTHING_LEARNED = NothingLearned()


def learned_state(policy: Policy) -> LearnedState:
    """The policy's LearnedState capability, NOTHING_LEARNED where it has none."""
    return policy if isinstance(policy, LearnedState) else NOTHING_LEARNED


def tentative_decisions(policy: Policy) -> TentativeDecisions | None:
    """The policy's TentativeDecisions capability, None where it has none."""
    return policy if isinstance(policy, TentativeDecisions) else None


class GammaParams(Protocol):
    """A params dataclass with a ``gamma_max`` field."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]

    @property
    def gamma_max(self) -> int: ...


G = TypeVar("G", bound=GammaParams)


class ParamsPolicy(Generic[G]):
    """Policy.gamma_max and Policy.params of a policy whose parameters (``_params``, set
    by its constructor) are a dataclass with a ``gamma_max`` field."""

    _params: G

    @property
    def gamma_max(self) -> int:
        return self._params.gamma_max

    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self._params)


class Checkpointed(Protocol):
    """What deciding candidates between checkpoints takes of a policy."""

    def decide(self, ctx: StepContext) -> Choice: ...

    def checkpoint(self, ctx: StepContext) -> object: ...

    def restore(self, ctx: StepContext, saved: object) -> None: ...


class CheckpointedDecide:
    """TentativeDecisions of a policy whose checkpoint(ctx) holds everything decide(ctx)
    may change: each candidate is decided between a checkpoint and its restore, and keeps
    the checkpoint taken right after deciding, which committing restores."""

    def decide_candidates(
        self: Checkpointed, ctx: StepContext, batch_sizes: Sequence[int]
    ) -> list[tuple[Choice, object]]:
        decided: list[tuple[Choice, object]] = []
        for batch_size in batch_sizes:
            candidate = at_batch_size(ctx, batch_size)
            before = self.checkpoint(candidate)
            choice = self.decide(candidate)
            decided.append((choice, self.checkpoint(candidate)))
            self.restore(candidate, before)
        return decided

    def commit(self: Checkpointed, ctx: StepContext, decided: object) -> None:
        self.restore(ctx, decided)

    def exploit(self, decided: object) -> tuple[Choice, object] | None:
        return None


class DecideChangesNothing:
    """TentativeDecisions of a policy whose decide() changes nothing (static, off, table):
    every candidate is just decided, and committing has nothing to do."""

    def decide_candidates(
        self: Policy, ctx: StepContext, batch_sizes: Sequence[int]
    ) -> list[tuple[Choice, object]]:
        return [(self.decide(at_batch_size(ctx, size)), None) for size in batch_sizes]

    def commit(self, ctx: StepContext, decided: object) -> None:
        return None

    def exploit(self, decided: object) -> tuple[Choice, object] | None:
        return None


def at_batch_size(ctx: StepContext, batch_size: int) -> StepContext:
    """``ctx`` as a candidate with ``batch_size`` (itself when it has that size already)."""
    if batch_size == ctx.batch_size:
        return ctx
    return dataclasses.replace(ctx, batch_size=batch_size)


def feasible_gamma_max(ctx: StepContext, gamma_max: int) -> int:
    """Largest γ the engine can run this step: 0 while the draft is not resident."""
    if not ctx.draft_resident:
        return 0
    return min(gamma_max, ctx.max_gamma) if ctx.max_gamma > 0 else gamma_max


def forced_choice_if_no_speculation(ctx: StepContext, gamma_max: int) -> Choice | None:
    """The forced γ=0 choice when speculation is infeasible, else None."""
    if feasible_gamma_max(ctx, gamma_max) == 0:
        return Choice(gamma=0, bin_type=BinType.FORCED)
    return None


def learner_id(ctx: StepContext, share_learner: bool) -> str:
    """Whose learned state a step updates: the engine's learner key when it sends one and
    sharing is on (engines of one model and hardware learn together), else its own."""
    return engine_learner_id(ctx.engine_id, ctx.learner_key, share_learner)


def engine_learner_id(engine_id: str, learner_key: str, share_learner: bool) -> str:
    """learner_id of a step of ``engine_id`` that sends ``learner_key``."""
    if share_learner and learner_key:
        return learner_id_of_key(learner_key)
    return own_learner(engine_id)


def learner_id_of_key(learner_key: str) -> str:
    """The learner id of engines sharing ``learner_key`` (what learner_id returns, what
    LearnedState.forget_learner drops)."""
    return f"shared:{learner_key}"


def own_learner(engine_id: str) -> str:
    return f"engine:{engine_id}"


# LearnedState.learner_for of a policy whose every step may read all of it.
WHOLE_POLICY = "*"


class StatePerEngine:
    """LearnedState.forget_learner and learner_for of a policy whose state is per engine
    only (nothing shared under a learner key): nothing to forget, each engine its own."""

    def forget_learner(self, learner_key: str) -> None:
        return None

    def learner_for(self, engine_id: str, learner_key: str) -> str:
        return own_learner(engine_id)


def load_prefill_cost(path: str, policy: str) -> PrefillCostTable | None:
    """The c_prefill(L_max, B) table of a policy's ``prefill_cost_table`` ("" = none)."""
    if not path:
        # The documented default, not a mistake: said, not warned about.
        log.info("%s: no prefill_cost_table given; switching cost c_prefill = 0", policy)
        return None
    try:
        return PrefillCostTable.from_csv(path)
    except PrefillCostError as exc:
        raise PolicyError(str(exc)) from exc


# Metadata of a params field that names a file to read: the server confines such paths,
# when a client gives them (SwapPolicy, SetParameters, Restore), to its state directory.
FILE_PATH: Mapping[str, Any] = types.MappingProxyType({"file_path": True})


def file_path_params(params_type: type[Any]) -> tuple[str, ...]:
    """Names of the fields of a params dataclass that name files (marked FILE_PATH)."""
    return tuple(f.name for f in dataclasses.fields(params_type) if f.metadata.get("file_path"))


P = TypeVar("P")


def parse_params(cls: type[P], raw: Mapping[str, Any] | None, policy: str) -> P:
    """Build a params dataclass from JSON data, rejecting unknown keys and wrong types.

    Validation beyond types belongs in the dataclass's ``__post_init__`` (raise PolicyError).
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise PolicyError(f"parameters of policy '{policy}' must be a JSON object")
    assert dataclasses.is_dataclass(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise PolicyError(
            f"unknown parameter(s) {unknown} for policy '{policy}'; known: {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        if not _matches(value, hints[key]):
            raise PolicyError(
                f"parameter '{key}' of policy '{policy}' must be {_describe(hints[key])}, "
                f"got {value!r}"
            )
        # A NaN or infinity passes every range check (comparisons are false) and only
        # fails later, when a snapshot cannot encode it; TOML and Python callers can give one.
        if isinstance(value, float) and not math.isfinite(value):
            raise PolicyError(
                f"parameter '{key}' of policy '{policy}' must be a finite number, got {value!r}"
            )
    try:
        return cls(**raw)
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"policy '{policy}': {exc}") from exc


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin in (list, tuple):
        return isinstance(value, list | tuple)
    return True


def _describe(hint: Any) -> str:
    return getattr(hint, "__name__", str(hint))
