"""The plugin's step journal: what the engine's thread records of each step, and the
bookkeeping settled from it off that thread.

The engine's thread appends one record per decided step and one per finished step; the
rest — each step's context, the steps run and their outcomes for the sidecar, pairing each
decision with the step that verified it, the counters — is settled in order by whichever
thread next needs it: the client's sender just before it sends a report batch (the journal
is its ReportSource), the telemetry thread, or the engine's own thread at idle. It knows
the client only as where the reports go, and vLLM not at all.

vLLM drafts the γ chosen when step k is scheduled at the end of step k and verifies those
drafts in step k+1, so decision k is reported with what step k+1 verified (drafted,
accepted + bonus tokens) and step k+1's busy time (decision → update). When the engine
runs out of requests, or a step samples nothing, the pending decision is dropped: nothing
verified its drafts there.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

from nightjar_common.client import GammaDecision, NightjarClient
from nightjar_common.tables import TableStep
from nightjar_common.types import EngineRuntime, RequestSignals, StepContext, StepOutcome


@dataclasses.dataclass(slots=True)
class EngineView:
    """What the scheduler knows at a step boundary."""

    # Requests that sample in the step (decodes and completing prefills, not partial
    # prefill chunks): they draft after it and verify in the next step.
    batch_size: int
    waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    max_gamma: int
    draft_resident: bool = True
    # Tokens in the drafting requests' contexts, and prefill tokens sharing the step.
    context_tokens: int = 0
    prefill_tokens: int = 0
    # Draft passes the drafter runs even at γ = 0 (StepContext.min_draft_passes).
    min_draft_passes: int = 0
    # The drafting requests' ids, given while the policy reads per-request signals
    # (GammaController.wants_request_ids).
    request_ids: tuple[str, ...] = ()


@dataclasses.dataclass(slots=True)
class VerifiedStep:
    """What a finished step verified, summed over its requests."""

    drafted_tokens: int
    accepted_tokens: int
    # Accepted + bonus tokens of every request that sampled in the step.
    generated_tokens: int
    # Accepted draft tokens of each request that verified drafts.
    request_accepts: tuple[int, ...] = ()
    # Their request ids, in the same order (given while the policy reads them).
    request_ids: tuple[str, ...] = ()


# The verified step before any: no request's accepts known yet.
NOTHING_VERIFIED = VerifiedStep(0, 0, 0)


def request_signals(
    request_ids: tuple[str, ...], verified: VerifiedStep
) -> tuple[RequestSignals, ...]:
    """Each named request with its accepted drafts in ``verified`` (none for a request
    that did not verify there). No divergence: vLLM keeps no draft distribution where the
    scheduler runs (docs/VLLM_PLUGIN.md, "Per-request γ")."""
    last = dict(zip(verified.request_ids, verified.request_accepts, strict=True))
    return tuple(
        RequestSignals(request_id, recent_accepts=(last[request_id],))
        if request_id in last
        else RequestSignals(request_id)
        for request_id in request_ids
    )


@dataclasses.dataclass(frozen=True, slots=True)
class StepContexts:
    """Builds an engine's step contexts from a view and the engine's constants only, so
    any thread may build one (the sender thread builds most: nothing the engine's thread
    changes is read here)."""

    engine_id: str
    learner_key: str = ""
    runtime: EngineRuntime | None = None

    def build(
        self,
        view: EngineView,
        step_index: int,
        previous_gamma: int | None,
        requests: tuple[RequestSignals, ...] = (),
    ) -> StepContext:
        return StepContext(
            engine_id=self.engine_id,
            learner_key=self.learner_key,
            batch_size=max(1, view.batch_size),
            step_index=step_index,
            num_waiting=view.waiting,
            free_kv_blocks=max(0, min(view.free_kv_blocks, view.total_kv_blocks)),
            total_kv_blocks=view.total_kv_blocks,
            # vLLM's drafter keeps its KV cache in step at γ = 0 (it runs its first pass
            # anyway), so re-enabling speculation has no catch-up to do.
            max_draft_lag_tokens=0,
            draft_resident=view.draft_resident,
            previous_gamma=previous_gamma,
            max_gamma=view.max_gamma,
            context_tokens=view.context_tokens,
            min_draft_passes=min(view.min_draft_passes, view.max_gamma),
            runtime=self.runtime,
            requests=requests,
        )

    def build_named(
        self,
        view: EngineView,
        step_index: int,
        previous_gamma: int | None,
        accepts_from: VerifiedStep | None,
    ) -> StepContext:
        """:meth:`build` with each of the view's requests' signals from ``accepts_from``
        (the step verified last; None: the policy reads no per-request signals)."""
        requests = () if accepts_from is None else request_signals(view.request_ids, accepts_from)
        return self.build(view, step_index, previous_gamma, requests)


@dataclasses.dataclass(slots=True)
class _InFlight:
    decision: GammaDecision
    started: float
    # Prefill computed in the step: reported with the outcome whose time is this step's
    # (the previous decision's, whose drafts this step verifies).
    prefill_tokens: int = 0


# Journal records (StepJournal), appended by the engine's thread in step
# order. A decided step: its view, step index, the γ the step before ran, its context
# where one was built, else what its requests' signals come from (the step verified
# before it; None: the policy reads none), the table entry it took (not reported yet) or
# the client's decision (reported), the γ it runs, when its hook began.
_Decided = tuple[
    EngineView,
    int,
    "int | None",
    "StepContext | VerifiedStep | None",
    "TableStep | GammaDecision",
    int,
    float,
]
# A finished step: what it verified, when its hook began. IDLE: the engine ran dry.
_Ended = tuple[VerifiedStep, float]
IDLE = "idle"


class StepJournal:
    """One engine's journal and what is settled from it (the client's ReportSource)."""

    def __init__(self, client: NightjarClient, contexts: StepContexts) -> None:
        self._client = client
        self._contexts = contexts
        # Steps decided and ended, in order (deque appends and pops are thread-safe);
        # _lock serialises the settling threads. The engine's thread appends a decided
        # step (_Decided) or an ended one (_Ended) with ``record`` and counts those not
        # settled yet with ``unsettled``: the deque's own methods, no Python frame there.
        self._records: collections.deque[_Decided | _Ended | str] = collections.deque()
        self.record = self._records.append
        self.unsettled = self._records.__len__
        self._lock = threading.Lock()
        # Settled state (under _lock): decisions whose step has not ended / the last ended
        # one, awaiting its verify step.
        self._pending: collections.deque[_InFlight] = collections.deque()
        self._in_flight: _InFlight | None = None
        self.reported = 0
        # Verified in all steps, counted as vLLM's spec-decode metrics count them: drafted
        # and accepted tokens, requests that verified drafts (vLLM's "drafts").
        self.drafted = self.accepted = self.drafts = 0
        # Drafted tokens of the steps whose decision was reported.
        self.drafted_reported = 0
        self.gammas: collections.Counter[int] = collections.Counter()
        # Where each step's γ came from: sidecar, fallback, forced (draft not resident).
        self.sources: collections.Counter[str] = collections.Counter()

    def idle(self) -> None:
        """The engine ran dry: the last decision is never verified."""
        self._records.append(IDLE)

    def settle(self) -> None:
        """Settle the records so far, in order."""
        with self._lock:
            records = self._records
            while records:
                record = records.popleft()
                if record is IDLE:
                    self._in_flight = None
                elif len(record) == 2:
                    self._settle_ended(*record)
                else:
                    self._settle_decided(*record)

    def _settle_decided(
        self,
        view: EngineView,
        step_index: int,
        previous: int | None,
        ctx: StepContext | VerifiedStep | None,
        taken: TableStep | GammaDecision,
        gamma: int,
        started: float,
    ) -> None:
        if isinstance(taken, TableStep):  # the held table's entry
            decision = GammaDecision(taken.gamma, "sidecar", table_step=taken)
        else:  # asked: a table's entry too, or a decision the client reported, or a fallback
            decision = taken
        if decision.table_step is not None:
            if not isinstance(ctx, StepContext):
                ctx = self._contexts.build_named(view, step_index, previous, ctx)
            self._client.ran(decision.table_step, ctx, gamma)
        ran = decision if gamma == decision.gamma else dataclasses.replace(decision, gamma=gamma)
        self._pending.append(_InFlight(ran, started, view.prefill_tokens))
        self.gammas[gamma] += 1
        self.sources[decision.source if view.draft_resident else "forced"] += 1

    def _settle_ended(self, verified: VerifiedStep, started: float) -> None:
        self.drafted += verified.drafted_tokens
        self.accepted += verified.accepted_tokens
        self.drafts += len(verified.request_accepts)
        if not self._pending:
            # No decision this step (nothing sampled in it): whatever the in-flight
            # decision drafted was not verified here, and pairing it with a later
            # step would credit it with someone else's tokens.
            self._in_flight = None
            return
        step = self._pending.popleft()
        if self._in_flight is not None:
            # The time and the prefill are this step's: it verified the in-flight drafts,
            # and its drafter proposed this step's decision's (its γ's draft passes).
            self._report(self._in_flight, verified, started - step.started, step)
        self._in_flight = step

    def _report(
        self, flight: _InFlight, verified: VerifiedStep, seconds: float, step: _InFlight
    ) -> None:
        decision_id = flight.decision.decision_id
        if not decision_id or seconds <= 0:
            return  # a fallback decision: the sidecar never saw it
        self._client.report(
            StepOutcome(
                decision_id=decision_id,
                engine_id=self._contexts.engine_id,
                gamma=flight.decision.gamma,
                step_seconds=seconds,
                generated_tokens=verified.generated_tokens,
                drafted_tokens=verified.drafted_tokens,
                accepted_tokens=verified.accepted_tokens,
                request_accepts=verified.request_accepts,
                prefill_tokens=step.prefill_tokens,
                draft_gamma=step.decision.gamma,
                request_ids=verified.request_ids,
            )
        )
        self.reported += 1
        self.drafted_reported += verified.drafted_tokens
