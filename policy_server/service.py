"""The decision service: owns the active policy, pending decisions and their bookkeeping.

This is the sidecar's core, free of gRPC: the gRPC servicers, the benchmarks
and in-process users all call it. An engine's step holds its own locks only: its shard's
(its pending decisions, engines.py) and its learner's (the part of the policy it changes,
learner_locks.py); policy activation (swap, set-params, restore, reset) holds every
learner's, is atomic and leaves the last good policy in place when it fails.

Every path that touches the active policy and the pending
decisions (decide, report, commit, swap, restore, snapshot) takes those locks in one
order, so they live together; per-engine bookkeeping is in engines.py, the policies in
policies/.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from nightjar_common.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    NightjarError,
    NotFoundError,
    PermissionDeniedError,
)
from nightjar_common.types import (
    BinType,
    Choice,
    Decision,
    DraftState,
    GammaTable,
    MemoryDirective,
    RanStep,
    StepContext,
    StepOutcome,
)
from nightjar_common.validation import (
    Limits,
    check_batch_size,
    check_batched_outcome,
    check_client_path,
    check_context,
    check_outcome,
    check_outcome_against,
    check_ran_step,
)
from policy_server import snapshot
from policy_server.decision_log import DecisionLog, context_fields, outcome_fields
from policy_server.engines import (
    Bounds,
    Candidate,
    CandidateSet,
    EngineShard,
    EngineTable,
    IssuedTable,
    KnownTable,
    PendingDecision,
    step_number,
)
from policy_server.learner_locks import LearnerLocks
from policy_server.memory import OFFLOAD, RELOAD, MemoryController, MemoryParams
from policy_server.metrics import (
    ACCEPTANCE,
    BATCH_BUCKETS,
    DECISIONS,
    GAMMA_CHOSEN,
    GOODPUT,
    REPORTS,
    STEP_DURATION,
    TABLE_STEPS,
    Metrics,
    batch_bucket,
)
from policy_server.policies import (
    DEFAULT_POLICY,
    REGISTRY,
    PolicyError,
    ServedPolicy,
    UnknownPolicyError,
    create_policy,
)
from policy_server.policies.base import (
    UNOWNED,
    MalformedStateError,
    at_batch_size,
    feasible_gamma_max,
    file_path_params,
    prices_speculation_state,
    reads_request_signals,
    trim_state,
    with_room_to_count,
)
from policy_server.state_text import StateText

log = logging.getLogger(__name__)

T = TypeVar("T")

# Candidate.after of a policy whose checkpoints do not cover decide (checkpoints_decide
# False): decided again when the engine names it.
DECIDE_AGAIN = object()

# How long a read of learned state (state_view, snapshots; see _read_state) reads engines'
# parts before it encodes them and hands the GIL over (goodput's part of an engine takes
# about 0.2 ms to build, so about 10 engines a chunk).
STATE_HOLD_S = 0.002
# Reads of the whole state a policy activation may restart before one holds every lock.
STATE_READ_ATTEMPTS = 3


@dataclasses.dataclass(frozen=True, slots=True)
class ActivePolicy:
    policy: ServedPolicy
    name: str
    revision: int
    version: str


DEFAULT_HALF_WIDTH = 8


@dataclasses.dataclass(frozen=True, slots=True)
class TableOptions:
    """What goes into a decision table (nightjar.v1.7; docs/DECISION_TABLES.md)."""

    # Batch sizes either side of the context's: how far the batch may move before the
    # engine's next report asks for a new table.
    half_width: int = DEFAULT_HALF_WIDTH
    # Steps and milliseconds a table serves at most (GammaTable.valid_steps, valid_ms):
    # an engine whose sidecar stopped answering falls back past them. Engines refresh
    # long before (the plugin every TABLE_REFRESH_STEPS steps); these bound what a frozen
    # sidecar costs.
    valid_steps: int = 64
    valid_ms: float = 1000.0

    def __post_init__(self) -> None:
        if self.half_width < 0 or self.valid_steps < 1 or not self.valid_ms > 0:
            raise ValueError("table options: half_width >= 0, valid_steps >= 1, valid_ms > 0")


@dataclasses.dataclass(slots=True)
class TableStepResult:
    """What a v1.7 request did: the table decided (None when none was asked for or the
    request was superseded), and the ran steps and outcomes it could not apply."""

    table: GammaTable | None = None
    skipped: int = 0
    skipped_reason: str = ""
    # Of the skipped, those that failed their checks (the gRPC front counts them).
    malformed: int = 0

    def skip(self, reason: str) -> None:
        self.skipped += 1
        self.skipped_reason = self.skipped_reason or reason


@dataclasses.dataclass(frozen=True, slots=True)
class StateView:
    policy_name: str
    policy_version: str
    params: dict[str, Any]
    # The learned state as JSON text (read and encoded an engine at a time, _read_state).
    state_json: str
    decisions_total: int
    reports_total: int
    engine_ids: list[str]
    last_snapshot_unix: float
    memory: dict[str, Any] = dataclasses.field(default_factory=dict)
    # Engines the sidecar holds; engine_ids may show fewer (a summary, state_view).
    engines_total: int = 0
    # How each engine shown runs speculation (EngineShard.runtime_view).
    engines: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def state(self) -> dict[str, Any]:
        """The learned state (state_json, parsed)."""
        state: dict[str, Any] = json.loads(self.state_json)
        return state


@dataclasses.dataclass(frozen=True, slots=True)
class StateRead:
    """What _read_state read: the policy, its state's JSON, engines' memory states."""

    active: ActivePolicy
    state_json: str
    memory: dict[str, Any]


class DecisionService:
    def __init__(
        self,
        policy_name: str = DEFAULT_POLICY,
        params: Mapping[str, Any] | None = None,
        *,
        limits: Limits | None = None,
        metrics: Metrics | None = None,
        decision_log: DecisionLog | None = None,
        state_dir: str | Path | None = None,
        bounds: Bounds | None = None,
        memory: MemoryController | None = None,
        engine_idle_s: float = 300.0,
        tables: TableOptions | None = None,
        snapshot_max_bytes: int = snapshot.MAX_BYTES,
    ) -> None:
        self.limits = limits or Limits()
        # The most a snapshot may take; never past what a start reads (snapshot.MAX_BYTES).
        self.snapshot_max_bytes = snapshot_max_bytes
        self.table_options = tables or TableOptions()
        self.metrics = metrics or Metrics()
        self.decision_log = decision_log
        self.state_dir = Path(state_dir) if state_dir else None
        # Elastic memory (docs/MEMORY.md); disabled unless configured.
        self.memory = memory or MemoryController(MemoryParams())
        # The draft state last published in nightjar_memory_draft_state, per engine.
        self._published_draft_state: dict[str, DraftState] = {}
        # What an engine's step changes has its own locks: its bookkeeping its shard's
        # (policy_server/engines.py), its part of the policy its learner's
        # (learner_locks.py). This one is taken with all of the learners' to activate a
        # policy or change it whole (reset, eviction). Order: an engine's lock, this one,
        # the learners'.
        self._lock = threading.Lock()
        self._learner_locks = LearnerLocks()
        # Whole-state reads (GetState with the token, snapshots) one at a time: each costs
        # CPU in proportion to the engines, taken from the decisions (the GIL).
        self._whole_reads = threading.Lock()
        # A policy as a start builds it, with its empty state, to check snapshots with
        # (_readable): built once per policy version (building one reads its files).
        self._snapshot_checker: tuple[str, ServedPolicy, dict[str, Any]] | None = None
        self._snapshot_checks = threading.Lock()
        self._revisions = itertools.count(1)
        self._boot_id = secrets.token_hex(4)
        self._sequence = itertools.count(1)
        self.engines = EngineTable(bounds or Bounds(), self.metrics.count_evictions)
        # When an engine last asked counts for the nightjar_engines gauge within
        # engine_idle_s, so a replaced pod's engine drops out of it.
        self.engine_idle_s = engine_idle_s
        self.metrics.engines.set_function(self.active_engines)
        self.last_snapshot_unix = 0.0
        # The policy version whose defect was last logged (see _policy_defect).
        self._defect_logged = ""
        # Told of every activation after the first (the gRPC front notifies its streams).
        self._activation_listeners: list[Callable[[ActivePolicy], None]] = []
        self._active = self._activate(self._build(policy_name, params), "start", "fresh")

    # -- decisions ----------------------------------------------------------------------

    @property
    def active(self) -> ActivePolicy:
        return self._active

    def decide(self, ctx: StepContext) -> Decision:
        decision = self.step(None, ctx)
        assert decision is not None
        return decision

    def report(self, outcome: StepOutcome) -> bool:
        """Record an outcome; True when it updated the active policy's learner."""
        check_outcome(outcome, self.limits)
        shard, pending = self._locate(outcome)
        with shard.lock:
            shard, pending = self._locate(outcome)  # again, under the lock
            with self._learner_part(shard.engine_id, pending.ctx.learner_key):
                return self._report_locked(shard, pending, outcome)

    def step(
        self, outcome: StepOutcome | None, ctx: StepContext | None, decide: bool = True
    ) -> Decision | None:
        """Report the previous outcome and decide the next step; all-or-nothing.

        ``decide=False``: apply what the request says happened (its outcome and the
        tentative decision it names as run) but decide nothing: the engine has already
        asked again (a superseded request on a stream, see grpc_server.py).
        """
        if outcome is None and ctx is None:
            raise InvalidArgumentError("a step request needs an outcome, a context or both")
        if ctx is not None:
            check_context(ctx, self.limits)
        if outcome is not None:
            check_outcome(outcome, self.limits)
            self._locate(outcome)  # everything checked before anything is applied
            if ctx is None or outcome.engine_id != ctx.engine_id:
                self.report(outcome)  # its own engine's shard, before taking another's
                outcome = None
        if ctx is None:
            return None
        shard, evicted = self.engines.shard(ctx.engine_id)
        shard.saw(ctx)
        self._forget(evicted)
        self._forget_learners(self.engines.use_learner_key(ctx.learner_key))
        with shard.lock, self._learner_part(ctx.engine_id, ctx.learner_key):
            if ctx.ran_decision_id:
                self._commit_locked(shard, ctx.ran_decision_id)
            if outcome is not None:
                _, pending = self._locate(outcome)
                self._report_locked(shard, pending, outcome)
            if not decide:
                return None
            # A set still open now was not run (the engine asks afresh): dropped.
            self._resolve_locked(shard, None)
            return self._decide_locked(shard, ctx)

    def table_step(
        self,
        ran_steps: Sequence[RanStep],
        outcomes: Sequence[StepOutcome],
        ctx: StepContext | None,
        decide: bool = True,
    ) -> TableStepResult:
        """Apply a report batch (the steps an engine ran from tables, then outcomes) and
        decide its next table for ``ctx`` (nightjar.v1.7). A malformed context or an
        oversized batch rejects the request before anything is applied; a malformed step
        or outcome, or one naming a table or decision the sidecar no longer holds, is
        skipped and counted (one bad item must not lose a batch). ``decide=False``:
        apply, decide nothing (superseded)."""
        result = TableStepResult()
        if ctx is not None:
            check_context(ctx, self.limits)
            engine_id, learner_key = ctx.engine_id, ctx.learner_key
        elif ran_steps or outcomes:
            engine_id = ran_steps[0].context.engine_id if ran_steps else outcomes[0].engine_id
            learner_key = ran_steps[0].context.learner_key if ran_steps else ""
        else:
            raise InvalidArgumentError("a step request needs an outcome, a context or both")
        check_batch_size(ran_steps, outcomes)
        ran_steps = self._well_formed(ran_steps, check_ran_step, engine_id, result)
        outcomes = self._well_formed(outcomes, check_batched_outcome, engine_id, result)
        shard, evicted = self.engines.shard(engine_id)
        self._forget(evicted)
        if ctx is not None:
            shard.saw(ctx)
            self._forget_learners(self.engines.use_learner_key(ctx.learner_key))
        # Each step's outcome right after the step (the order they happened in, and the
        # pending-decision bound holds however long the batch), older outcomes first.
        ran_ids = {step.decision_id for step in ran_steps}
        later: dict[str, StepOutcome] = {}
        earlier: list[StepOutcome] = []
        seen: set[str] = set()
        for outcome in outcomes:
            if outcome.decision_id in seen:
                # A step has one outcome: a second one in the batch is a duplicate.
                self.metrics.skipped_outcomes.inc()
                result.skip(f"outcome of {outcome.decision_id}: a duplicate in its batch")
                continue
            seen.add(outcome.decision_id)
            if outcome.decision_id in ran_ids:
                later[outcome.decision_id] = outcome
            else:
                earlier.append(outcome)
        with shard.lock, self._learner_part(engine_id, learner_key):
            for outcome in earlier:
                self._report_batched_locked(shard, outcome, result)
            for step in ran_steps:
                try:
                    refused = self._commit_table_step_locked(shard, step)
                except InvalidArgumentError as exc:  # a γ it could not have run
                    result.malformed += 1
                    refused = str(exc)
                if refused:
                    result.skip(refused)
                if step.decision_id in later:
                    self._report_batched_locked(shard, later.pop(step.decision_id), result)
            if ctx is not None and ctx.ran_decision_id:
                self._commit_locked(shard, ctx.ran_decision_id)
            if ctx is not None and decide:
                self._resolve_locked(shard, None)
                result.table = self._decide_table_locked(shard, ctx)
        return result

    def _well_formed(
        self,
        items: Sequence[T],
        check: Callable[[T, str, Limits], None],
        engine_id: str,
        result: TableStepResult,
    ) -> list[T]:
        """The items that pass ``check``; the others skipped, with the first reason."""
        kept: list[T] = []
        for item in items:
            try:
                check(item, engine_id, self.limits)
            except InvalidArgumentError as exc:
                result.malformed += 1
                result.skip(str(exc))
                continue
            kept.append(item)
        return kept

    def _commit_table_step_locked(self, shard: EngineShard, step: RanStep) -> str:
        """The engine ran a table entry: commit what deciding it did to the policy (as for
        a tentative decision it named) and await its outcome under the step's id. Why it
        was not ("" when it was): a replay, or a table the sidecar does not know;
        InvalidArgumentError for a γ the step could not have run."""
        known = shard.known_tables.get(step.table_id)
        number = step_number(step.decision_id)
        if known is not None:
            replayed = self._refused_step(known, number, step)
            if replayed:
                self.metrics.steps.count(TABLE_STEPS, ("replayed",))
                return replayed
        self.memory.observe(step.context)
        directive = self._memory_directive(step.context, step.gamma)
        if directive.action:
            shard.directive = directive  # delivered with the next table
        table = shard.tables.get(step.table_id)
        entry = table.entry(step.context.batch_size) if table is not None else None
        if known is None or known.entry_gamma(step.context.batch_size) is None:
            self.metrics.steps.count(TABLE_STEPS, ("unknown",))
            if known is None:
                return f"ran step {step.decision_id}: its table is not held"
            return (
                f"ran step {step.decision_id}: batch size {step.context.batch_size} is "
                f"outside its table ({known.first_batch_size}.."
                f"{known.first_batch_size + len(known.gammas) - 1})"
            )
        known.mark_run(number)
        revision = known.revision
        if entry is None:
            # Known, no longer kept: newer tables were decided since, so its entry's
            # checkpoint is not committed; the step is still learned from.
            choice = Choice(gamma=step.gamma, bin_type=BinType.EXPLOIT)
            result = "late"
        else:
            # The step's context has the entry's engine and batch size: what restore and a
            # decision again need of it.
            choice, after = entry
            result = "stale"
            if revision == self._active.revision:
                if after is DECIDE_AGAIN:
                    self._active.policy.decide(step.context)
                else:
                    self._active.policy.restore(step.context, after)
                result = "committed"
        if revision != self._active.revision:
            result = "stale"
        self.metrics.steps.count(TABLE_STEPS, (result,))
        if step.gamma != choice.gamma:  # the engine clamped it
            choice = dataclasses.replace(choice, gamma=step.gamma)
        pending = PendingDecision(step.context, choice, revision, known.gamma_max)
        self.engines.add_pending(shard, step.decision_id, pending)
        self._count_decision(step.decision_id, pending)
        return ""

    def _refused_step(self, known: KnownTable, number: int, step: RanStep) -> str:
        """Why a step of a known table is not learned from: "" when it is new and its γ
        is one it could have run; the reason when it was reported before (a replay or a
        duplicate: learned once); InvalidArgumentError for a step number or γ it could not
        have run (more than its table decided, its engine allowed or its policy's Γmax)."""
        name = f"ran step {step.decision_id}"
        valid_steps = self.table_options.valid_steps
        if known.has_run(number):
            return f"{name}: already reported (a replay or a duplicate), learned once"
        gamma, ctx = step.gamma, step.context
        entry_gamma = known.entry_gamma(ctx.batch_size)
        if not 1 <= number <= valid_steps:
            shown = step.decision_id.rpartition(".")[2][:20]
            why = f"step number {shown} is outside a table's steps 1..{valid_steps}"
        elif gamma > known.gamma_max:
            why = f"gamma {gamma} above the deciding policy's gamma_max ({known.gamma_max})"
        elif gamma > 0 and not ctx.draft_resident:
            why = f"gamma {gamma} run while the draft is not resident"
        elif 0 < ctx.max_gamma < gamma:
            why = f"gamma {gamma} above the step's max_gamma ({ctx.max_gamma})"
        elif entry_gamma is not None and gamma > entry_gamma:
            why = f"gamma {gamma} above its table entry ({entry_gamma})"
        else:
            return ""
        self.metrics.steps.count(TABLE_STEPS, ("refused",))
        raise InvalidArgumentError(f"{name}: {why}; not learned from")

    def _report_batched_locked(
        self, shard: EngineShard, outcome: StepOutcome, result: TableStepResult
    ) -> None:
        """An outcome of a report batch: applied as Report would, skipped (and counted)
        where Report would answer NOT_FOUND or find it does not fit its decision."""
        pending = shard.pending.get(outcome.decision_id)
        if pending is None:
            candidates = shard.open
            member = candidates.members.get(outcome.decision_id) if candidates else None
            pending = member.pending if member is not None else None
        if pending is None:
            self.metrics.skipped_outcomes.inc()
            known = shard.known_tables.get(outcome.decision_id.rpartition(".")[0])
            if known is not None and known.has_run(step_number(outcome.decision_id)):
                why = "its step was already reported (a replay or a duplicate)"
            else:
                why = "unknown decision"
            result.skip(f"outcome of {outcome.decision_id}: {why}")
            return
        try:
            check_outcome_against(outcome, pending.ctx, pending.gamma_max, self.limits)
        except InvalidArgumentError as exc:
            # Implausible for its decision: skipped like a malformed item, still pending.
            self.metrics.skipped_outcomes.inc()
            result.malformed += 1
            result.skip(f"outcome of {outcome.decision_id}: {exc}")
            return
        self._report_locked(shard, pending, outcome)

    def _decide_table_locked(self, shard: EngineShard, ctx: StepContext) -> GammaTable:
        """The γ of every batch size within half_width of ``ctx``'s, decided at once (one
        posterior draw), for steps that start in ``ctx``'s speculation state. While requests
        wait the range leans towards growth: a backlog being admitted grows the batch by
        as many as a step's token budget holds, while few requests finish at once."""
        started = time.perf_counter()
        active, options = self._active, self.table_options
        ctx = self._policy_view(ctx)
        lean = min(ctx.num_waiting, options.half_width) // 2
        low = max(1, ctx.batch_size - options.half_width + lean)
        high = min(self.limits.max_batch_size, ctx.batch_size + options.half_width + lean)
        decided = self._within_bounds(
            ctx, _decide_tentative(active.policy, ctx, range(low, high + 1))
        )
        choices = [choice for choice, _ in decided]
        own = choices[ctx.batch_size - low]  # decided for the context's own requests
        table_id = f"{self._boot_id}-{next(self._sequence):x}"
        gamma_max = active.policy.gamma_max
        issued = IssuedTable(active.revision, gamma_max, low, tuple(decided))
        self.engines.keep_table(shard, table_id, issued)
        directive, shard.directive = shard.directive, MemoryDirective()
        self.metrics.tables.inc()
        self.metrics.decision_latency.observe(time.perf_counter() - started)
        return GammaTable(
            table_id=table_id,
            policy_name=active.name,
            policy_version=active.version,
            first_batch_size=low,
            gammas=tuple(choice.gamma for choice in choices),
            exploring=tuple(choice.exploration for choice in choices),
            speculation_off=ctx.previous_gamma == 0,
            step_index=ctx.step_index,
            valid_steps=options.valid_steps,
            valid_ms=options.valid_ms,
            memory_directive=directive,
            reason=_table_reason(choices),
            request_gammas=own.request_gammas,
            reads_request_signals=reads_request_signals(active.policy),
            any_speculation_state=not prices_speculation_state(active.policy),
        )

    def _policy_view(self, reported: StepContext) -> StepContext:
        """The context a policy decides on: the memory controller's view updated with the
        engine's report, asking-ahead fields dropped, and the draft not resident while it
        is (about to be) offloaded."""
        self.memory.observe(reported)
        ctx = reported
        if ctx.candidate_batch_sizes or ctx.ran_decision_id:
            ctx = dataclasses.replace(ctx, candidate_batch_sizes=(), ran_decision_id="")
        if not self.memory.speculation_allowed(ctx):
            ctx = dataclasses.replace(ctx, draft_resident=False)
        return ctx

    def _locate(self, outcome: StepOutcome) -> tuple[EngineShard, PendingDecision]:
        """The decision an outcome answers, checked against it; changes nothing."""
        engine_id = self.engines.decision_engine.get(outcome.decision_id)
        shard = self.engines.get(engine_id) if engine_id is not None else None
        pending = None
        if shard is not None:
            pending = shard.pending.get(outcome.decision_id)
            if pending is None and shard.open is not None:
                candidate = shard.open.members.get(outcome.decision_id)
                pending = candidate.pending if candidate is not None else None
        if shard is None or pending is None:
            raise NotFoundError(
                f"unknown decision_id {outcome.decision_id!r} (never issued, already "
                "reported, or expired)"
            )
        check_outcome_against(outcome, pending.ctx, pending.gamma_max, self.limits)
        return shard, pending

    def _report_locked(
        self, shard: EngineShard, pending: PendingDecision, outcome: StepOutcome
    ) -> bool:
        if not pending.committed:
            self._commit_locked(shard, outcome.decision_id)  # the report names it
        elif shard.open is not None:
            shard.open.touched = True
        self.engines.take_pending(shard, outcome.decision_id)
        return self._apply_locked(pending, outcome)

    def _commit_locked(self, shard: EngineShard, decision_id: str) -> None:
        """The engine ran this tentative decision: keep it (its pending entry and what
        deciding it did to the policy), drop the others of its set."""
        candidates = shard.open
        chosen = candidates.members.get(decision_id) if candidates is not None else None
        if chosen is None:
            # Not in the open set: committed already (its outcome named it), or dropped.
            self.metrics.tentative.labels("unknown").inc()
            return
        assert candidates is not None
        policy = self._active.policy
        if candidates.revision == self._active.revision:
            if candidates.touched or chosen.after is DECIDE_AGAIN:
                # Decided again on the live policy: the same choice unless something else
                # changed it meanwhile; the pending choice stays what the engine ran.
                policy.decide(chosen.pending.ctx)
            else:
                policy.restore(chosen.pending.ctx, chosen.after)
        pending = dataclasses.replace(chosen.pending, committed=True)
        self._resolve_locked(shard, decision_id)
        self.engines.add_pending(shard, decision_id, pending)
        self._count_decision(decision_id, pending)

    def _resolve_locked(self, shard: EngineShard, keep: str | None) -> None:
        """Close the open set, keeping ``keep``'s id (the one the engine ran) if any."""
        candidates = self.engines.close_set(shard, keep)
        if candidates is None:
            return
        dropped = len(candidates.members) - (keep is not None)
        if dropped:
            self.metrics.tentative.labels("dropped").inc(dropped)
        if keep is not None:
            self.metrics.tentative.labels("committed").inc()

    def _decide_locked(self, shard: EngineShard, ctx: StepContext) -> Decision:
        started = time.perf_counter()
        active = self._active
        reported = ctx  # what the engine said; the memory controller tracks the draft by it
        ctx = self._policy_view(reported)
        policy = active.policy
        sizes = [b for b in dict.fromkeys(reported.candidate_batch_sizes) if b != ctx.batch_size]
        tentative = bool(sizes)
        if tentative:
            sizes.insert(0, ctx.batch_size)
            decided = _decide_tentative(policy, ctx, sizes)
        else:
            decided = [(policy.decide(ctx), None)]
        decided = self._within_bounds(ctx, decided)
        members: dict[str, Candidate] = {}

        def stamp(index: int, **extra: Any) -> Decision:
            choice, after = decided[index]
            candidate_ctx = at_batch_size(ctx, sizes[index]) if index else ctx
            decision_id = f"{self._boot_id}-{next(self._sequence):x}"
            pending = PendingDecision(
                candidate_ctx, choice, active.revision, policy.gamma_max, not tentative
            )
            if tentative:
                members[decision_id] = Candidate(pending, after)
            else:
                self.engines.add_pending(shard, decision_id, pending)
                self._count_decision(decision_id, pending)
            return Decision(
                gamma=choice.gamma,
                decision_id=decision_id,
                bin_type=choice.bin_type,
                exploration_probability=choice.exploration_probability,
                policy_name=active.name,
                policy_version=active.version,
                step_index=ctx.step_index,
                request_gammas=choice.request_gammas,
                batch_size=candidate_ctx.batch_size,
                tentative=tentative,
                reads_request_signals=reads_request_signals(policy),
                **extra,
            )

        # Candidates first: the decision for batch_size carries them (built once).
        candidates = tuple(stamp(index) for index in range(1, len(decided)))
        directive = self._memory_directive(reported, decided[0][0].gamma)
        decision = stamp(0, memory_directive=directive, candidates=candidates)
        if tentative:
            self.engines.open_set(shard, CandidateSet(active.revision, members))
        self.metrics.decision_latency.observe(time.perf_counter() - started)
        return decision

    def _within_bounds(
        self, ctx: StepContext, decided: list[tuple[Choice, object]]
    ) -> list[tuple[Choice, object]]:
        """Every choice with γ in 0..what the engine can run (its ``max_gamma``, the
        policy's Γmax, 0 while the draft is not resident): a γ outside is a policy defect,
        never passed on; it is clamped, counted and logged (once per policy version)."""
        top = feasible_gamma_max(ctx, self._active.policy.gamma_max)
        # A table's choices are few objects shared by many sizes: each checked once.
        distinct = {id(choice): choice for choice, _ in decided}.values()
        if all(_fits(choice, top) for choice in distinct):  # nearly always
            return decided
        bounded: list[tuple[Choice, object]] = []
        for choice, after in decided:
            if not _fits(choice, top):
                self._policy_defect(ctx, choice.gamma, top)
                choice = _clamped(choice, top)
            bounded.append((choice, after))
        return bounded

    def _policy_defect(self, ctx: StepContext, gamma: int, top: int) -> None:
        active = self._active
        self.metrics.child(self.metrics.policy_defects, active.name, "gamma_clamped").inc()
        if self._defect_logged != active.version:
            # Once per version: a defective policy answers so every step.
            self._defect_logged = active.version
            log.warning(
                "policy %s (%s) answered gamma %d outside 0..%d (engine %s: max_gamma %d, "
                "policy gamma_max %d, draft resident %s): clamped; a policy defect, counted "
                "in nightjar_policy_defects_total, logged once per policy version",
                active.name,
                active.version,
                gamma,
                top,
                ctx.engine_id,
                ctx.max_gamma,
                active.policy.gamma_max,
                ctx.draft_resident,
            )

    def _count_decision(self, decision_id: str, pending: PendingDecision) -> None:
        """Metrics and log of a decision the engine runs (tentative ones once named)."""
        choice, ctx = pending.choice, pending.ctx
        active = self._active
        steps = self.metrics.steps
        steps.count(DECISIONS, (active.name, str(choice.gamma), choice.bin_type.value))
        steps.observe(GAMMA_CHOSEN, (BATCH_BUCKETS[batch_bucket(ctx.batch_size)],), choice.gamma)
        if self.decision_log is not None:
            # Built, trimmed and encoded by the log's writer thread, off the decision path.
            record = functools.partial(
                _decision_record, time.time(), decision_id, choice, active, ctx
            )
            self.decision_log.write(record)

    def _memory_directive(self, ctx: StepContext, gamma: int) -> MemoryDirective:
        directive = self.memory.step(ctx, gamma)
        memory = self.memory.engines.get(ctx.engine_id)
        if memory is None:
            return directive
        published = self._published_draft_state.get(ctx.engine_id)
        if published is None:
            # Zero series from the engine's first step, so that increase() sees the first.
            for action in (OFFLOAD, RELOAD):
                self.metrics.memory_directives.labels(ctx.engine_id, action)
        if directive.action:
            self.metrics.memory_directives.labels(ctx.engine_id, directive.action).inc()
        # Compared with what was last published, not with the state before this call: the
        # engine's own report (observe, before the policy decided) moves it too.
        if memory.state is not published:
            for state in DraftState:
                value = 1.0 if state is memory.state else 0.0
                self.metrics.memory_draft_state.labels(ctx.engine_id, state.value).set(value)
            self._published_draft_state[ctx.engine_id] = memory.state
        return directive

    def _forget(self, engine_ids: list[str]) -> None:
        """Evicted engines: their policy state, memory state and per-engine series go."""
        if not engine_ids:
            return
        with self._whole_policy():
            for engine_id in engine_ids:
                self._active.policy.reset(engine_id)
                self.memory.engines.pop(engine_id, None)
                if self._published_draft_state.pop(engine_id, None) is not None:
                    self.metrics.forget_engine(engine_id)

    def _forget_learners(self, keys: list[str]) -> None:
        """Learner keys evicted from the table: what the policy learned under them goes."""
        if not keys:
            return
        with self._whole_policy():
            for key in keys:
                self._active.policy.forget_learner(key)

    def _apply_locked(self, pending: PendingDecision, outcome: StepOutcome) -> bool:
        active = self._active
        applied = pending.revision == active.revision
        if applied:
            active.policy.observe(pending.ctx, pending.choice, outcome)
        steps, gamma = self.metrics.steps, (str(outcome.gamma),)
        steps.count(REPORTS, (active.name, "applied" if applied else "stale"))
        steps.observe(GOODPUT, gamma, outcome.goodput)
        steps.observe(STEP_DURATION, (), outcome.step_seconds)
        if outcome.drafted_tokens > 0:
            steps.observe(ACCEPTANCE, gamma, outcome.accepted_tokens / outcome.drafted_tokens)
        if self.decision_log is not None:
            self.decision_log.write(functools.partial(_outcome_record, time.time(), outcome))
        return applied

    # -- administration -----------------------------------------------------------------

    def swap(self, name: str, params: Mapping[str, Any] | None, keep_state: bool) -> ActivePolicy:
        """Activate another policy; the current one stays active if anything fails."""
        candidate = self._build(name, self._confine_paths(name, params))
        with self._whole_policy():
            if keep_state:
                self._carry_state(self._active.policy, candidate)
            return self._activate(candidate, "swap", "kept" if keep_state else "fresh")

    def set_params(self, changes: Mapping[str, Any]) -> ActivePolicy:
        """New parameters for the active policy, keeping its learned state."""
        with self._lock:
            current = self._active
            merged = {**current.policy.params(), **self._confine_paths(current.name, changes)}
        candidate = self._build(current.name, merged)
        with self._whole_policy():
            self._carry_state(self._active.policy, candidate)
            return self._activate(candidate, "set_params", "kept")

    def reset(self, engine_id: str | None = None) -> ActivePolicy:
        with self._whole_policy():
            if engine_id is None:
                self.engines.clear()
                policy = self._build(self._active.name, self._active.policy.params())
                return self._activate(policy, "reset", "fresh")
            shard = self.engines.get(engine_id)
            if shard is None:
                raise NotFoundError(f"unknown engine {engine_id!r}")
            self._active.policy.reset(engine_id)
            shard.last_seen = -math.inf
            return self._active

    def on_activate(self, listener: Callable[[ActivePolicy], None]) -> None:
        """Call ``listener`` with every policy activated from now on (swap, parameter
        change, restore, full reset). It runs under the service's lock: it must not block
        or call back into the service."""
        self._activation_listeners.append(listener)

    def active_engines(self) -> int:
        """Engines that asked for a decision within the last ``engine_idle_s`` (and were
        not reset since)."""
        return self.engines.seen_since(time.perf_counter() - self.engine_idle_s)

    def state_view(
        self, engine_id: str | None = None, *, max_engines: int | None = None
    ) -> StateView:
        """The active policy and its learned state: one engine's part, or the whole, read
        an engine at a time while decisions go on (_read_state), or with ``max_engines`` a
        summary: the parts of the first ``max_engines`` engines by id and as many ids, with
        the count of all in ``engines_total`` (what GetState answers a caller without the
        admin token). Whole reads take turns (``_whole_reads``)."""
        all_ids = sorted(self.engines.engine_ids())
        shown = all_ids if max_engines is None else all_ids[:max_engines]
        if engine_id:
            if engine_id not in self.engines:
                raise NotFoundError(f"unknown engine {engine_id!r}")
            read = self._read_state([engine_id], whole=False, allow_nan=True)
        elif max_engines is not None:
            read = self._read_state(shown, whole=False, allow_nan=True)
        else:
            with self._whole_reads:
                read = self._read_state(shown, whole=True, allow_nan=True)
        active = read.active
        return StateView(
            policy_name=active.name,
            policy_version=active.version,
            params=active.policy.params(),
            state_json=read.state_json,
            decisions_total=int(self.metrics.steps.total(DECISIONS)),
            reports_total=int(self.metrics.steps.total(REPORTS)),
            engine_ids=shown,
            last_snapshot_unix=self.last_snapshot_unix,
            memory={"params": dataclasses.asdict(self.memory.params), "engines": read.memory},
            engines_total=len(all_ids),
            engines=self._runtimes(shown if not engine_id else [engine_id]),
        )

    def _runtimes(self, engine_ids: Sequence[str]) -> dict[str, Any]:
        views = {}
        for engine_id in engine_ids:
            shard = self.engines.get(engine_id)
            view = shard.runtime_view() if shard is not None else None
            if view is not None:
                views[engine_id] = view
        return views

    def _read_state(
        self, engine_ids: Sequence[str], whole: bool, allow_nan: bool, memory: bool = True
    ) -> StateRead:
        """The active policy, the learned state of ``engine_ids`` as JSON text (``whole``:
        with the part no engine's shows, LearnedState.state) and, with ``memory``, their
        memory-controller states. ``allow_nan`` False: ValueError for a NaN or infinity.

        Each engine's part is read holding its learner's lock only (the part no engine
        owns, every learner's), in chunks of STATE_HOLD_S with the GIL handed over between
        them, so a decision waits for one part of its own learner at most, never for the
        whole state (with 10,000 engines of goodput that takes seconds); each chunk is
        encoded as JSON outside the locks (state_text.py). So the result is not one point in
        time: each engine's part (its record and the learner it updates) is read at once
        and is consistent on its own, a learner engines share is the one read last, and an
        engine that comes or goes during the read may be missing. That is all a snapshot
        needs: an engine's decisions read its own part only, so a restored engine goes on
        from a state it was in, as if the snapshot had been taken a moment earlier or later
        for it. A policy activated during the read makes it start again; the last of
        STATE_READ_ATTEMPTS holds every lock throughout (activations are admin calls)."""
        ids = [*engine_ids, UNOWNED] if whole else list(engine_ids)
        for attempt in range(1, STATE_READ_ATTEMPTS + 1):
            read = self._read_chunks(ids, allow_nan, memory, attempt == STATE_READ_ATTEMPTS)
            if read is not None:
                return read
        raise AssertionError("unreachable: the last attempt holds the lock throughout")

    def _read_chunks(
        self, ids: Sequence[str], allow_nan: bool, memory: bool, throughout: bool
    ) -> StateRead | None:
        """One attempt of _read_state; None when a policy was activated meanwhile."""
        text = StateText(allow_nan)
        memories: dict[str, Any] = {}
        held = self._whole_policy() if throughout else contextlib.nullcontext()
        with held:
            active = self._active
            done = 0
            while done < len(ids):
                parts: list[dict[str, Any]] = []
                until = time.perf_counter() + STATE_HOLD_S
                while done < len(ids) and (throughout or not parts or _before(until)):
                    engine_id = ids[done]
                    done += 1
                    with contextlib.ExitStack() as holding:
                        if not throughout:  # the engine's learner only, or all for UNOWNED
                            holding.enter_context(self._engine_part(engine_id))
                        if self._active is not active:
                            return None
                        # state() builds new JSON data: nothing of it changes once unlocked.
                        parts.append(active.policy.state(engine_id))
                        engine_memory = self.memory.engines.get(engine_id) if memory else None
                        if engine_memory is not None:
                            memories[engine_id] = engine_memory.as_dict()
                for part in parts:
                    text.add(part)
                if not throughout:
                    # Hand the GIL over: a decision woken by the release takes the lock
                    # before this thread takes it again (CPython's locks are not fair).
                    time.sleep(0)
        state_json = text.text() if text else json.dumps({"schema": active.policy.state_schema})
        return StateRead(active, state_json, dict(sorted(memories.items())))

    @contextlib.contextmanager
    def _learner_part(self, engine_id: str, learner_key: str) -> Iterator[None]:
        """Hold the lock of the learner the engine's steps change in the active policy
        (LearnedState.learner_for; ``learner_key`` the engine's, for one it has not seen):
        taken again when an activation or a reset moved it before it was held."""
        while True:
            policy = self._active.policy
            lock = self._learner_locks.of(policy.learner_for(engine_id, learner_key))
            with lock:
                current = self._active.policy
                if current is policy and lock is self._learner_locks.of(
                    current.learner_for(engine_id, learner_key)
                ):
                    yield
                    return

    def _engine_part(self, engine_id: str) -> contextlib.AbstractContextManager[None]:
        """What reading ``engine_id``'s part of the state holds (UNOWNED: every learner)."""
        if engine_id == UNOWNED:
            return self._learner_locks.every()
        return self._learner_part(engine_id, "")

    @contextlib.contextmanager
    def _whole_policy(self) -> Iterator[None]:
        """This lock and every learner's: no step is in the policy while it is held."""
        with self._lock, self._learner_locks.every():
            yield

    def list_policies(self) -> list[tuple[str, str, dict[str, Any], bool]]:
        return [
            (spec.name, spec.description, spec.default_params(), spec.name == self._active.name)
            for spec in REGISTRY.values()
        ]

    # -- snapshots ----------------------------------------------------------------------

    def snapshot_document(self) -> dict[str, Any]:
        """The snapshot of the active policy (snapshot_text, parsed)."""
        text, _ = self.snapshot_text()
        document: dict[str, Any] = json.loads(text)
        return document

    def snapshot_text(self) -> tuple[str, float]:
        """The snapshot document of the active policy as JSON text (what snapshot.parse
        reads), and its created_unix: its params and whole learned state, read an engine
        at a time while decisions go on (_read_state says why each engine's part is
        consistent, the whole not one point in time, and why that is enough). ValueError
        for a NaN or infinity in the state."""
        engines = sorted(self.engines.engine_ids())
        created = time.time()
        with self._whole_reads:
            read = self._read_state(engines, whole=True, allow_nan=False, memory=False)
        active = read.active
        head = {"format": snapshot.FORMAT, "created_unix": created}
        policy = {"name": active.name, "version": active.version, "params": active.policy.params()}
        text = (
            snapshot.encode_text(head)[:-1]
            + ',"policy":'
            + snapshot.encode_text(policy)[:-1]
            + f',"state":{read.state_json}}}'
            + f',"engines":{snapshot.encode_text(engines)}}}'
        )
        return text, created

    def write_snapshot(self) -> Path:
        if self.state_dir is None:
            raise FailedPreconditionError("no state directory configured (--state-dir)")
        path = self.state_dir / snapshot.SNAPSHOT_NAME
        try:
            # ValueError: a NaN or infinity in the state (refused when it comes in; this
            # keeps one that slipped through from ending the snapshot loop).
            text, created = self.snapshot_text()
            snapshot.write_bytes_atomic(path, self._readable(text.encode()))
        except (OSError, ValueError, TypeError, NightjarError) as exc:
            self.metrics.snapshots.labels("failed").inc()
            raise FailedPreconditionError(
                f"cannot write snapshot {path}: {exc}; the last snapshot is kept"
            ) from exc
        self.last_snapshot_unix = created
        self.metrics.snapshot_written(self.last_snapshot_unix)
        return path

    def _readable(self, data: bytes) -> bytes:
        """``data`` (a snapshot document) as a start will read it: checked by the reader's
        own checks (snapshot.parse, then the policy's load_state as a start loads it) and
        within the reader's size limit, trimmed of what the policy can lose (base.
        trim_state, with a WARNING) when it is larger; SnapshotError when nothing makes it
        fit, InvalidArgumentError or FailedPreconditionError when a start would refuse it."""
        limit = min(self.snapshot_max_bytes, snapshot.MAX_BYTES)
        document = snapshot.parse(data, "the snapshot to write")
        spec = document["policy"]
        with self._snapshot_checks:
            checker, empty = self._checker(spec)
            data = self._within(limit, data, document, checker)
            try:
                _load_state(checker, spec["state"])
            finally:
                checker.load_state(empty)  # holds no copy of the state between snapshots
        return data

    def _checker(self, spec: Mapping[str, Any]) -> tuple[ServedPolicy, dict[str, Any]]:
        """The policy a start would build for a snapshot's ``spec``, and its empty state."""
        version = str(spec.get("version", ""))
        if self._snapshot_checker is None or self._snapshot_checker[0] != version:
            checker = self._build(spec["name"], spec["params"])
            self._snapshot_checker = (version, checker, checker.state())
        _, checker, empty = self._snapshot_checker
        return checker, empty

    def _within(
        self, limit: int, data: bytes, document: dict[str, Any], policy: ServedPolicy
    ) -> bytes:
        """``data`` (``document`` encoded) if it is at most ``limit`` bytes, else
        ``document`` trimmed of what ``policy`` can lose and encoded again (SnapshotError
        when that is still larger)."""
        spec = document["policy"]
        if len(data) > limit:
            size = len(data)
            dropped = trim_state(policy, spec["state"], size - limit)
            data = snapshot.encode(document)
            if len(data) > limit:
                trimmed = f" after dropping {dropped}" if dropped else ""
                raise snapshot.SnapshotError(
                    f"the snapshot is {len(data):,} bytes{trimmed}, more than the "
                    f"{limit:,} bytes a start reads"
                )
            log.warning(
                "snapshot trimmed from %s to %s bytes to fit the %s a start reads; dropped: %s",
                f"{size:,}",
                f"{len(data):,}",
                f"{limit:,}",
                dropped,
            )
        return data

    def restore_document(
        self, document: Mapping[str, Any], *, from_client: bool = True, keep_state: bool = True
    ) -> ActivePolicy:
        """Activate the policy, params and state of a snapshot; all-or-nothing.

        ``from_client``: file paths in its params are confined to the state directory
        (False only for the server's own snapshot at start). ``keep_state`` False: the
        policy and params only, with fresh state (a state that does not fit them, at start)."""
        spec = document["policy"]
        params = spec["params"]
        if from_client and isinstance(params, Mapping):
            params = self._confine_paths(spec["name"], params)
        candidate = self._build(spec["name"], params)
        # Read whole before the engine table is cleared: a malformed one must not wipe it.
        engines = [str(e) for e in document.get("engines", [])] if keep_state else []
        if keep_state and from_client:
            self._load_restored(candidate, spec["state"])
        elif keep_state:
            _load_state(candidate, spec["state"])
        with self._whole_policy():
            self.engines.clear()
            for engine_id in engines:
                shard, _ = self.engines.shard(str(engine_id))
                shard.last_seen = -math.inf  # known (its state is restored), not active
            return self._activate(candidate, "restore", "restored" if keep_state else "fresh")

    def _load_restored(self, candidate: ServedPolicy, state: Any) -> None:
        """A client's state into ``candidate``, refused (INVALID_ARGUMENT, naming the
        field) unless the snapshots that follow can be written and read at start: its
        floats within snapshot.MAX_RESTORED_FLOAT and its counts half their limit (room to
        grow), and what the policy then holds encodes as JSON, fits a snapshot (trimmed as
        the writer trims) and loads again."""
        try:
            snapshot.check_numbers(state, "policy.state", snapshot.MAX_RESTORED_FLOAT)
        except snapshot.SnapshotError as exc:
            raise InvalidArgumentError(f"snapshot state is out of range: {exc}") from exc
        with with_room_to_count():
            _load_state(candidate, state)
        try:
            held = candidate.state()
            text = snapshot.encode_text(held)
        except (ArithmeticError, ValueError, TypeError) as exc:
            raise InvalidArgumentError(
                f"snapshot state could not be written back: {_unwritable(candidate, exc)}"
            ) from exc
        limit = min(self.snapshot_max_bytes, snapshot.MAX_BYTES)
        if len(text) > limit:  # ASCII: encode_text escapes the rest
            trim_state(candidate, held, len(text) - limit)
            if len(snapshot.encode_text(held)) > limit:
                raise InvalidArgumentError(
                    f"snapshot state takes {len(text):,} bytes, more than the {limit:,} a "
                    "snapshot may take, after dropping what can be dropped"
                )
        _load_state(self._build(candidate.name, candidate.params()), json.loads(text))

    def restore_path(self, given: str) -> ActivePolicy:
        """Restore a snapshot file inside the state directory (relative paths start there)."""
        check_client_path(given)
        try:
            path = snapshot.confine(self.state_dir, given)
        except snapshot.OutsideStateDirError as exc:
            raise PermissionDeniedError(str(exc)) from exc
        if not path.exists():
            raise NotFoundError(f"snapshot file {path} does not exist")
        try:
            document = snapshot.read(path)
        except snapshot.SnapshotError as exc:
            raise InvalidArgumentError(str(exc)) from exc
        return self.restore_document(document)

    # -- internals ----------------------------------------------------------------------

    def _confine_paths(self, name: str, params: Mapping[str, Any] | None) -> dict[str, Any]:
        """Client-given params with every file path resolved inside the state directory;
        PermissionDeniedError for one outside it. A path equal to the active policy's own
        (the operator's, kept by SetParameters and snapshots) is left as it is."""
        confined = dict(params or {})
        spec = REGISTRY.get(name)
        if spec is None:
            return confined  # _build says it is unknown
        active = self._active.policy.params() if self._active.name == name else {}
        for key in file_path_params(spec.params_type):
            given = confined.get(key)
            if not isinstance(given, str) or not given or given == active.get(key):
                continue  # "" = none; a wrong type is _build's to refuse
            check_client_path(given)
            try:
                confined[key] = str(snapshot.confine(self.state_dir, given))
            except snapshot.OutsideStateDirError as exc:
                raise PermissionDeniedError(f"parameter {key!r}: {exc}") from exc
        return confined

    def _build(self, name: str, params: Mapping[str, Any] | None) -> ServedPolicy:
        try:
            return create_policy(name, params)
        except UnknownPolicyError as exc:
            raise NotFoundError(str(exc)) from exc
        except PolicyError as exc:
            raise InvalidArgumentError(str(exc)) from exc

    def _carry_state(self, old: ServedPolicy, new: ServedPolicy) -> None:
        if old.state_schema != new.state_schema:
            raise FailedPreconditionError(
                f"cannot keep state: '{old.name}' state ({old.state_schema}) does not fit "
                f"'{new.name}' ({new.state_schema})"
            )
        try:
            new.load_state(old.state())
        except PolicyError as exc:
            raise FailedPreconditionError(f"cannot keep state: {exc}") from exc

    def _activate(self, policy: ServedPolicy, event: str, state: str) -> ActivePolicy:
        """Make ``policy`` the active one; ``event`` (start, swap, set_params, reset,
        restore) and ``state`` (fresh, kept, restored) go to the decision log."""
        revision = next(self._revisions)
        digest = hashlib.sha256(json.dumps(policy.params(), sort_keys=True).encode()).hexdigest()[
            :8
        ]
        active = ActivePolicy(policy, policy.name, revision, f"r{revision}-{digest}")
        self._active = active
        self.metrics.policy_swaps.labels("ok").inc()
        self.metrics.set_active_policy(active.name, active.version)
        log.info("activated policy %s version %s", active.name, active.version)
        if self.decision_log is not None:
            self.decision_log.write(_policy_record(active, event, state))
        for listener in self._activation_listeners:
            listener(active)
        return active


def _load_state(policy: ServedPolicy, state: Any) -> None:
    """``state`` into a policy not yet active: FAILED_PRECONDITION when it is well formed
    but does not fit (another schema, another Γmax), INVALID_ARGUMENT when it is malformed;
    a policy that chokes on garbage (IndexError, OverflowError, ...) is the latter too, not
    an internal error."""
    if not isinstance(state, Mapping):
        raise InvalidArgumentError("snapshot state must be a JSON object")
    try:
        policy.load_state(state)
    except MalformedStateError as exc:
        raise InvalidArgumentError(f"snapshot state is malformed: {exc}") from exc
    except PolicyError as exc:
        raise FailedPreconditionError(f"snapshot state does not fit: {exc}") from exc
    except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgumentError(f"snapshot state is malformed: {exc!r}") from exc


def _unwritable(policy: ServedPolicy, exc: Exception) -> str:
    """Why ``policy``'s state cannot be written: the field that is not finite if there is
    one, else ``exc``."""
    try:
        snapshot.check_numbers(policy.state(), "policy.state")
    except snapshot.SnapshotError as named:
        return str(named)
    except (ArithmeticError, ValueError, TypeError):
        pass
    return repr(exc)


def _fits(choice: Choice, top: int) -> bool:
    return 0 <= choice.gamma <= top and (
        not choice.request_gammas or all(0 <= g <= choice.gamma for _, g in choice.request_gammas)
    )


def _clamped(choice: Choice, top: int) -> Choice:
    """``choice`` with γ in 0..top and each request's γ within the step's."""
    gamma = min(max(choice.gamma, 0), top)
    requests = tuple((rid, min(max(g, 0), gamma)) for rid, g in choice.request_gammas)
    return dataclasses.replace(choice, gamma=gamma, request_gammas=requests)


def _table_reason(choices: Iterable[Choice]) -> BinType | None:
    """GammaTable.reason: FIXED or FORCED when every entry has it, else None."""
    kinds = {choice.bin_type for choice in choices}
    if len(kinds) == 1 and (kind := kinds.pop()) in (BinType.FIXED, BinType.FORCED):
        return kind
    return None


def _decide_tentative(
    policy: ServedPolicy, ctx: StepContext, batch_sizes: Sequence[int]
) -> list[tuple[Choice, object]]:
    """Decide for each batch size and leave the policy as it was: by the policy itself,
    with the checkpoint each decision leaves, when its checkpoints cover decide
    (``checkpoints_decide``), else each on a deep copy of it (the chosen one is then
    decided again on the live policy when the engine names it)."""
    if policy.checkpoints_decide:
        return policy.decide_candidates(ctx, batch_sizes)
    decided: list[tuple[Choice, object]] = []
    for batch_size in batch_sizes:
        candidate = at_batch_size(ctx, batch_size)
        decided.append((copy.deepcopy(policy).decide(candidate), DECIDE_AGAIN))
    return decided


def _decision_record(
    ts: float, decision_id: str, choice: Choice, active: ActivePolicy, ctx: StepContext
) -> dict[str, Any]:
    return {
        "kind": "decision",
        "ts": ts,
        "decision_id": decision_id,
        "engine_id": ctx.engine_id,
        "policy": active.name,
        "policy_version": active.version,
        **context_fields(ctx),
        "gamma": choice.gamma,
        "bin_type": choice.bin_type.value,
        "exploration": choice.exploration,
        "exploration_probability": choice.exploration_probability,
    }


def _policy_record(active: ActivePolicy, event: str, state: str) -> dict[str, Any]:
    return {
        "kind": "policy",
        "ts": time.time(),
        "event": event,
        "policy": active.name,
        "policy_version": active.version,
        "params": active.policy.params(),
        "state": state,
    }


def _outcome_record(ts: float, outcome: StepOutcome) -> dict[str, Any]:
    return {
        "kind": "outcome",
        "ts": ts,
        "decision_id": outcome.decision_id,
        **outcome_fields(outcome),
    }


def context_from_json(data: Mapping[str, Any]) -> StepContext:
    from nightjar_common.types import RequestSignals

    fields = dict(data)
    fields["candidate_batch_sizes"] = tuple(fields.get("candidate_batch_sizes", ()))
    fields["requests"] = tuple(
        RequestSignals(**{**r, "recent_accepts": tuple(r.get("recent_accepts", ()))})
        for r in fields.get("requests", ())
    )
    return StepContext(**fields)


def outcome_from_json(data: Mapping[str, Any]) -> StepOutcome:
    fields = dict(data)
    # Logs written before v1.5 hold [request id, accepted] pairs.
    fields["request_accepts"] = tuple(
        int(x[1]) if isinstance(x, list | tuple) else int(x)
        for x in fields.get("request_accepts", ())
    )
    return StepOutcome(**fields)


def _before(deadline: float) -> bool:
    return time.perf_counter() < deadline
