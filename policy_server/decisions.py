"""Decisions: an engine's decision tables, the steps it ran from them and their outcomes.

The one decision path (nightjar.v1, docs/DECISION_TABLES.md): an engine's request
carries the steps it ran from its tables and their outcomes, and a context when it wants
its next table. Each ran step commits what deciding its entry did to the policy
(TentativeDecisions) and awaits its outcome; each outcome teaches the policy once. A
table holds γ for every batch size near the context's, decided at once for the batch
sizes the engine's next steps may run.

An engine's step holds its own locks only: its shard's (its pending decisions and
tables, engines.py) and its learner's (activation.py).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

from nightjar_common.errors import InvalidArgumentError
from nightjar_common.types import (
    BinType,
    Choice,
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
    check_context,
    check_outcome_against,
    check_ran_step,
)
from policy_server.activation import ActivePolicy, PolicyActivation
from policy_server.decision_log import DecisionLog, decision_record, outcome_record
from policy_server.engines import (
    EngineShard,
    EngineTable,
    IssuedTable,
    KnownTable,
    PendingDecision,
    context_bytes,
    outcome_bytes,
    step_number,
)
from policy_server.memory import OFFLOAD, RELOAD, MemoryController
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
from policy_server.policies.base import (
    at_batch_size,
    feasible_gamma_max,
    prices_speculation_state,
    reads_request_signals,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# IssuedTable's "what committing takes" of a policy without TentativeDecisions: its
# entry is decided again, on the live policy, when a step runs it.
DECIDE_AGAIN = object()

DEFAULT_HALF_WIDTH = 8


@dataclasses.dataclass(frozen=True, slots=True)
class TableOptions:
    """What goes into a decision table (docs/DECISION_TABLES.md)."""

    # Batch sizes either side of the context's at the least: how far the batch may move
    # before the engine's next report asks for a new table (see sizes()).
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

    def sizes(self, batch_size: int, num_waiting: int, max_batch_size: int) -> range:
        """The batch sizes a table for a step of ``batch_size`` covers. Below, as far as
        three quarters of the batch (requests admitted together with one output length
        finish together), at least half_width and at most twice it; above, half_width
        plus one size per waiting request, up to three times half_width more (a backlog
        is admitted as fast as a step's token budget allows). Each miss costs the engine
        a blocking round trip, each extra size the sidecar a few µs a table."""
        width = self.half_width
        below = min(max(width, 3 * batch_size // 4), 2 * width)
        above = width + min(num_waiting, 3 * width)
        return range(max(1, batch_size - below), min(max_batch_size, batch_size + above) + 1)


@dataclasses.dataclass(slots=True)
class TableStepResult:
    """What a request did: the table decided (None when none was asked for or the
    request was superseded), and the ran steps and outcomes it could not apply."""

    table: GammaTable | None = None
    skipped: int = 0
    skipped_reason: str = ""
    # Of the skipped, those that failed their checks (the gRPC front counts them).
    malformed: int = 0

    def skip(self, reason: str) -> None:
        self.skipped += 1
        self.skipped_reason = self.skipped_reason or reason


class TableDecisions:
    """Decides tables and learns from the steps run from them."""

    def __init__(
        self,
        activation: PolicyActivation,
        engines: EngineTable,
        *,
        limits: Limits,
        metrics: Metrics,
        memory: MemoryController,
        decision_log: DecisionLog | None,
        options: TableOptions,
    ) -> None:
        self.activation = activation
        self.engines = engines
        self.limits = limits
        self.metrics = metrics
        self.memory = memory
        self.decision_log = decision_log
        self.options = options
        self._boot_id = secrets.token_hex(4)
        self._sequence = itertools.count(1)
        # The draft state last published in nightjar_memory_draft_state, per engine.
        self._published_draft_state: dict[str, DraftState] = {}
        # The policy version whose defect was last logged (see _policy_defect).
        self._defect_logged = ""

    def table_step(
        self,
        ran_steps: Sequence[RanStep],
        outcomes: Sequence[StepOutcome],
        ctx: StepContext | None,
        decide: bool = True,
    ) -> TableStepResult:
        """Apply a report batch (the steps an engine ran from tables, then outcomes) and
        decide its next table for ``ctx``. A malformed context or an oversized batch
        rejects the request before anything is applied; a malformed step or outcome, or
        one naming a table or decision the sidecar no longer holds, is skipped and
        counted (one bad item must not lose a batch). ``decide=False``: apply, decide
        nothing (superseded)."""
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
        with shard.lock, self.activation.learner_part(engine_id, learner_key):
            for outcome in earlier:
                self._report_locked(shard, outcome, result)
            for step in ran_steps:
                try:
                    refused = self._commit_step_locked(shard, step)
                except InvalidArgumentError as exc:  # a γ it could not have run
                    result.malformed += 1
                    refused = str(exc)
                if refused:
                    result.skip(refused)
                if step.decision_id in later:
                    self._report_locked(shard, later.pop(step.decision_id), result)
            if ctx is not None and decide:
                result.table = self._decide_table_locked(shard, ctx)
        return result

    def forget_engine(self, engine_id: str) -> None:
        """What the server published of an engine it no longer holds goes (the caller
        holds the whole policy)."""
        self.activation.active.learned.reset(engine_id)
        self.memory.engines.pop(engine_id, None)
        if self._published_draft_state.pop(engine_id, None) is not None:
            self.metrics.forget_engine(engine_id)

    # -- ran steps and outcomes -----------------------------------------------------------

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

    def _commit_step_locked(self, shard: EngineShard, step: RanStep) -> str:
        """The engine ran a table entry: commit what deciding it did to the policy and
        await its outcome under the step's id. Why it was not ("" when it was): a replay,
        no room for its context within the byte budgets, or a table the sidecar does not
        know; InvalidArgumentError for a γ the step could not have run."""
        known = shard.known_tables.get(step.table_id)
        number = step_number(step.decision_id)
        if known is not None:
            replayed = self._refused_step(known, number, step)
            if replayed:
                self.metrics.steps.count(TABLE_STEPS, ("replayed",))
                return replayed
        size = context_bytes(step.context)
        refusal = self.engines.pending_refusal(shard, size)
        if refusal:  # over a byte budget: nothing committed or counted, nothing learned
            self.metrics.child(self.metrics.budget_refusals, "pending").inc()
            self.metrics.steps.count(TABLE_STEPS, ("refused",))
            return f"ran step {step.decision_id}: {refusal}; not learned from"
        self.memory.observe(step.context)
        directive = self._memory_directive(step.context, step.gamma)
        if directive.action:
            shard.directive = directive  # delivered with the next table
        table = shard.tables.get(step.table_id)
        batch_size = step.context.batch_size
        entry = table.entry(batch_size, step.exploited) if table is not None else None
        if known is None or known.entry_gamma(batch_size) is None:
            self.metrics.steps.count(TABLE_STEPS, ("unknown",))
            if known is None:
                return f"ran step {step.decision_id}: its table is not held"
            return (
                f"ran step {step.decision_id}: batch size {step.context.batch_size} is "
                f"outside its table ({known.first_batch_size}.."
                f"{known.first_batch_size + len(known.gammas) - 1})"
            )
        known.mark_run(number)
        active = self.activation.active
        if entry is None:
            # Known, no longer kept: newer tables were decided since, so its entry's
            # decision is not committed; the step is still learned from.
            choice = Choice(gamma=step.gamma, bin_type=BinType.EXPLOIT)
            result = "late"
        else:
            # The step's context has the entry's engine and batch size: what committing
            # and deciding again take of it.
            choice, decided = entry
            result = "stale"
            if known.revision == active.revision:
                if active.tentative is None or decided is DECIDE_AGAIN:
                    active.policy.decide(step.context)
                else:
                    active.tentative.commit(step.context, decided)
                result = "committed"
        if known.revision != active.revision:
            result = "stale"
        self.metrics.steps.count(TABLE_STEPS, (result,))
        if step.gamma != choice.gamma:  # the engine clamped it
            choice = dataclasses.replace(choice, gamma=step.gamma)
        pending = PendingDecision(step.context, choice, known.revision, known.gamma_max, size)
        self.engines.add_pending(shard, step.decision_id, pending)
        self._count_decision(step.decision_id, pending)
        return ""

    def _refused_step(self, known: KnownTable, number: int, step: RanStep) -> str:
        """Why a step of a known table is not learned from: "" when it is new and its γ
        is one it could have run; the reason when it was reported before (a replay or a
        duplicate: learned once); InvalidArgumentError for a step number or γ it could not
        have run (more than its table decided, its engine allowed or its policy's Γmax)."""
        name = f"ran step {step.decision_id}"
        valid_steps = self.options.valid_steps
        if known.has_run(number):
            return f"{name}: already reported (a replay or a duplicate), learned once"
        gamma, ctx = step.gamma, step.context
        entry_gamma = known.entry_gamma(ctx.batch_size, step.exploited)
        inside = known.entry_gamma(ctx.batch_size) is not None
        if not 1 <= number <= valid_steps:
            shown = step.decision_id.rpartition(".")[2][:20]
            why = f"step number {shown} is outside a table's steps 1..{valid_steps}"
        elif gamma > known.gamma_max:
            why = f"gamma {gamma} above the deciding policy's gamma_max ({known.gamma_max})"
        elif gamma > 0 and not ctx.draft_resident:
            why = f"gamma {gamma} run while the draft is not resident"
        elif 0 < ctx.max_gamma < gamma:
            why = f"gamma {gamma} above the step's max_gamma ({ctx.max_gamma})"
        elif step.exploited and inside and entry_gamma is None:
            why = f"exploited, but its table entry (batch size {ctx.batch_size}) has no exploit γ"
        elif entry_gamma is not None and gamma > entry_gamma:
            entry = "its table entry's exploit γ" if step.exploited else "its table entry"
            why = f"gamma {gamma} above {entry} ({entry_gamma})"
        else:
            return ""
        self.metrics.steps.count(TABLE_STEPS, ("refused",))
        raise InvalidArgumentError(f"{name}: {why}; not learned from")

    def _report_locked(
        self, shard: EngineShard, outcome: StepOutcome, result: TableStepResult
    ) -> None:
        """An outcome: applied to the policy once, or skipped (and counted) when its step
        is unknown, was reported already, or the outcome does not fit it."""
        pending = shard.pending.get(outcome.decision_id)
        known = shard.known_tables.get(outcome.decision_id.rpartition(".")[0])
        number = step_number(outcome.decision_id)
        if pending is None:
            self.metrics.skipped_outcomes.inc()
            if known is not None and known.has_learned(number):
                why = "it was already learned from (a replay or a duplicate)"
            elif known is not None and known.has_run(number):
                why = (
                    "its step waited longer than the newest "
                    f"{self.engines.bounds.max_pending_per_engine} awaiting outcomes (evicted)"
                )
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
        self.engines.take_pending(shard, outcome.decision_id)
        if known is not None:
            known.mark_learned(number)
        self._apply(pending, outcome)

    def _apply(self, pending: PendingDecision, outcome: StepOutcome) -> None:
        active = self.activation.active
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
            size = outcome_bytes(outcome)
            self.decision_log.write(functools.partial(outcome_record, time.time(), outcome), size)

    def _count_decision(self, decision_id: str, pending: PendingDecision) -> None:
        """Metrics and log of a decision the engine ran."""
        choice, ctx = pending.choice, pending.ctx
        active = self.activation.active
        steps = self.metrics.steps
        steps.count(DECISIONS, (active.name, str(choice.gamma), choice.bin_type.value))
        steps.observe(GAMMA_CHOSEN, (BATCH_BUCKETS[batch_bucket(ctx.batch_size)],), choice.gamma)
        if self.decision_log is not None:
            # Built, trimmed and encoded by the log's writer thread, off the decision path.
            record = functools.partial(
                decision_record, time.time(), decision_id, choice, active.name, active.version, ctx
            )
            self.decision_log.write(record, pending.size)

    # -- tables -------------------------------------------------------------------------

    def _decide_table_locked(self, shard: EngineShard, ctx: StepContext) -> GammaTable:
        """The γ of every batch size the batch may move to from ``ctx``'s before the
        engine's next report (TableOptions.sizes), decided at once (one posterior draw),
        for steps that start in ``ctx``'s speculation state."""
        started = time.perf_counter()
        active, options = self.activation.active, self.options
        ctx = self._policy_view(ctx)
        sizes = options.sizes(ctx.batch_size, ctx.num_waiting, self.limits.max_batch_size)
        low = sizes.start
        decided = self._within_bounds(ctx, _decide_tentatively(active, ctx, sizes))
        choices = [choice for choice, _ in decided]
        exploits = self._exploits(ctx, active, decided)
        own = choices[ctx.batch_size - low]  # decided for the context's own requests
        table_id = f"{self._boot_id}-{next(self._sequence):x}"
        gamma_max = active.policy.gamma_max
        issued = IssuedTable(active.revision, gamma_max, low, tuple(decided), exploits)
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
            exploit_gammas=tuple(
                (-1 if choice.exploration else choice.gamma) if e is None else e[0].gamma
                for choice, e in zip(choices, exploits, strict=True)
            )
            if exploits
            else (),
        )

    def _exploits(
        self, ctx: StepContext, active: ActivePolicy, decided: list[tuple[Choice, object]]
    ) -> tuple[tuple[Choice, object] | None, ...]:
        """Per entry of a table, the choice a step runs once the entry's exploration ran
        (TentativeDecisions.exploit; None for an entry that does not explore or has none:
        its steps then ask again), bounded as the entries are; () where no entry has one."""
        tentative = active.tentative
        if tentative is None or not any(choice.exploration for choice, _ in decided):
            return ()
        exploits = [
            tentative.exploit(after) if choice.exploration else None for choice, after in decided
        ]
        if not any(exploits):
            return ()
        bounded = self._within_bounds(ctx, [e for e in exploits if e is not None])
        kept = iter(bounded)
        return tuple(None if e is None else next(kept) for e in exploits)

    def _policy_view(self, reported: StepContext) -> StepContext:
        """The context a policy decides on: the memory controller's view updated with the
        engine's report, and the draft not resident while it is (about to be) offloaded."""
        self.memory.observe(reported)
        if not self.memory.speculation_allowed(reported):
            return dataclasses.replace(reported, draft_resident=False)
        return reported

    def _within_bounds(
        self, ctx: StepContext, decided: list[tuple[Choice, object]]
    ) -> list[tuple[Choice, object]]:
        """Every choice with γ in 0..what the engine can run (its ``max_gamma``, the
        policy's Γmax, 0 while the draft is not resident): a γ outside is a policy defect,
        never passed on; it is clamped, counted and logged (once per policy version)."""
        top = feasible_gamma_max(ctx, self.activation.active.policy.gamma_max)
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
        active = self.activation.active
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

    # -- evictions ------------------------------------------------------------------------

    def _forget(self, engine_ids: list[str]) -> None:
        """Evicted engines: their policy state, memory state and per-engine series go."""
        if not engine_ids:
            return
        with self.activation.whole_policy():
            for engine_id in engine_ids:
                self.forget_engine(engine_id)

    def _forget_learners(self, keys: list[str]) -> None:
        """Learner keys evicted from the table: what the policy learned under them goes."""
        if not keys:
            return
        with self.activation.whole_policy():
            for key in keys:
                self.activation.active.learned.forget_learner(key)


def _decide_tentatively(
    active: ActivePolicy, ctx: StepContext, batch_sizes: Sequence[int]
) -> list[tuple[Choice, object]]:
    """Decide for each batch size and leave the policy as it was: by its
    TentativeDecisions, else each on a deep copy of it (an entry that runs is then
    decided again on the live policy)."""
    if active.tentative is not None:
        return active.tentative.decide_candidates(ctx, batch_sizes)
    return [
        (copy.deepcopy(active.policy).decide(at_batch_size(ctx, size)), DECIDE_AGAIN)
        for size in batch_sizes
    ]


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
