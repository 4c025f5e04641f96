"""The decision service: the sidecar's core, free of gRPC, in three parts.

The gRPC servicers, the CLI, the benchmarks and in-process users call this façade; each
part owns its piece of state:

* activation.py — the active policy (swap, parameter change, reset, the last good policy
  kept when one fails) and the locks on it;
* decisions.py — decision tables, the steps engines ran from them and their outcomes;
* state_store.py — reads of the learned state, snapshots and restores.

The per-engine bookkeeping they share is engines.py; the decision log and its record
codecs decision_log.py; the policies policies/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from nightjar_common.errors import NotFoundError
from nightjar_common.types import GammaTable, RanStep, StepContext, StepOutcome
from nightjar_common.validation import Limits
from policy_server import snapshot
from policy_server.activation import ActivePolicy, PolicyActivation
from policy_server.decision_log import DecisionLog
from policy_server.decisions import (
    DEFAULT_HALF_WIDTH,
    TableDecisions,
    TableOptions,
    TableStepResult,
)
from policy_server.engines import Bounds, EngineTable
from policy_server.memory import MemoryController, MemoryParams
from policy_server.metrics import Metrics
from policy_server.policies import DEFAULT_POLICY, REGISTRY
from policy_server.policies.per_request import RECORD_BYTES, plan_cache_bytes
from policy_server.state_store import StateStore, StateView

__all__ = [
    "DEFAULT_HALF_WIDTH",
    "ActivePolicy",
    "DecisionService",
    "RanEntry",
    "StateView",
    "TableOptions",
    "TableStepResult",
]


@dataclasses.dataclass(frozen=True, slots=True)
class RanEntry:
    """A step run in process from its own table (DecisionService.run_step)."""

    table: GammaTable
    decision_id: str
    gamma: int
    exploring: bool

    @property
    def request_gammas(self) -> tuple[tuple[str, int], ...]:
        """γ of each request of the step (a per-request policy's plan)."""
        return self.table.request_gammas


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
        self.metrics = metrics or Metrics()
        self.decision_log = decision_log
        self.state_dir = Path(state_dir) if state_dir else None
        # Elastic memory (docs/MEMORY.md); disabled unless configured.
        self.memory = memory or MemoryController(MemoryParams())
        self.engines = EngineTable(bounds or Bounds(), self.metrics.count_evictions)
        self.metrics.watch_bytes("pending", lambda: self.engines.pending_bytes)
        self.metrics.watch_bytes("tables", lambda: self.engines.table_bytes)
        self.metrics.watch_bytes("plan_cache", plan_cache_bytes)
        self.metrics.watch_bytes("request_records", self._request_records_bytes)
        if decision_log is not None:
            self.metrics.watch_bytes("decision_log", lambda: decision_log.queued_bytes)
        # When an engine last asked counts for the nightjar_engines gauge within
        # engine_idle_s, so a replaced pod's engine drops out of it.
        self.engine_idle_s = engine_idle_s
        self.metrics.engines.set_function(self.active_engines)
        # nightjar_request_mode: each engine's per-request mode, read from the active policy.
        self.metrics.request_modes.watch(lambda: self.activation.active.policy)
        self.activation = PolicyActivation(
            policy_name,
            params,
            metrics=self.metrics,
            decision_log=decision_log,
            state_dir=self.state_dir,
        )
        self.decisions = TableDecisions(
            self.activation,
            self.engines,
            limits=self.limits,
            metrics=self.metrics,
            memory=self.memory,
            decision_log=decision_log,
            options=tables or TableOptions(),
        )
        # The fleet link's status, set by the link when --fleet runs one (fleet_link.py).
        self.fleet_status: Callable[[], dict[str, Any]] | None = None
        # The decision path itself (TableDecisions.table_step): a report batch applied, the
        # engine's next table decided.
        self.table_step = self.decisions.table_step
        self.store = StateStore(
            self.activation,
            self.engines,
            metrics=self.metrics,
            memory=self.memory,
            state_dir=self.state_dir,
            snapshot_max_bytes=snapshot_max_bytes,
        )

    # -- decisions ----------------------------------------------------------------------

    @property
    def active(self) -> ActivePolicy:
        return self.activation.active

    @property
    def table_options(self) -> TableOptions:
        return self.decisions.options

    def run_step(self, ctx: StepContext) -> RanEntry:
        """One step as an engine runs it, in process (benchmarks, embedding, tests): a
        table for ``ctx``, and its entry for ``ctx``'s batch size run and reported at once;
        the step's outcome goes to ``report``. Engines on the wire do the same through
        the plugin's client, a table serving many steps."""
        table = self.table_step((), (), ctx).table
        assert table is not None
        index = ctx.batch_size - table.first_batch_size
        gamma = table.gammas[index]
        ran = RanStep(f"{table.table_id}.1", ctx, gamma)
        refused = self.table_step((ran,), (), None)
        if refused.skipped:
            raise AssertionError(f"a step run from its own table was refused: {refused}")
        return RanEntry(table, ran.decision_id, gamma, table.exploring[index])

    def report(self, outcome: StepOutcome) -> TableStepResult:
        """The outcome of a step run_step ran (skipped, with the reason, when it does not
        fit its step or the step is no longer held)."""
        return self.table_step((), (outcome,), None)

    def _request_records_bytes(self) -> int:
        """Estimated bytes of the active policy's per-request records (RECORD_BYTES each,
        an upper bound); 0 for a policy without them."""
        count = getattr(self.activation.active.policy, "request_records", None)
        return RECORD_BYTES * count() if callable(count) else 0

    def active_engines(self) -> int:
        """Engines that asked for a table within the last ``engine_idle_s`` (and were
        not reset since)."""
        return self.engines.seen_since(time.perf_counter() - self.engine_idle_s)

    # -- administration -----------------------------------------------------------------

    def swap(self, name: str, params: Mapping[str, Any] | None, keep_state: bool) -> ActivePolicy:
        """Activate another policy; the current one stays active if anything fails."""
        return self.activation.swap(name, params, keep_state)

    def set_params(self, changes: Mapping[str, Any]) -> ActivePolicy:
        """New parameters for the active policy, keeping its learned state."""
        return self.activation.set_params(changes)

    def reset(self, engine_id: str | None = None) -> ActivePolicy:
        """Forget what was learned: everything (a fresh policy of the same name and
        params, every engine forgotten) or one engine's part."""
        activation = self.activation
        with activation.whole_policy():
            active = activation.active
            if engine_id is None:
                self.engines.clear()
                policy = activation.build(active.name, active.policy.params())
                return activation.activate(policy, "reset", "fresh")
            shard = self.engines.get(engine_id)
            if shard is None:
                raise NotFoundError(f"unknown engine {engine_id!r}")
            active.learned.reset(engine_id)
            shard.last_seen = -math.inf
            return active

    def holding_learner(self, learner_id: str) -> contextlib.AbstractContextManager[ActivePolicy]:
        """PolicyActivation.holding_learner: one learner's lock, for a change to it from
        outside the decision path (fleet learning's merges)."""
        return self.activation.holding_learner(learner_id)

    def on_activate(self, listener: Callable[[ActivePolicy], None]) -> None:
        """PolicyActivation.on_activate."""
        self.activation.on_activate(listener)

    def list_policies(self) -> list[tuple[str, str, dict[str, Any], bool]]:
        active = self.activation.active.name
        return [
            (spec.name, spec.description, spec.default_params(), spec.name == active)
            for spec in REGISTRY.values()
        ]

    # -- learned state ------------------------------------------------------------------

    def state_view(
        self, engine_id: str | None = None, *, max_engines: int | None = None
    ) -> StateView:
        """StateStore.state_view, with the fleet link's status when one runs."""
        view = self.store.state_view(engine_id, max_engines=max_engines)
        if self.fleet_status is None:
            return view
        return dataclasses.replace(view, fleet=self.fleet_status())

    @property
    def last_snapshot_unix(self) -> float:
        return self.store.last_snapshot_unix

    @property
    def snapshot_max_bytes(self) -> int:
        return self.store.snapshot_max_bytes

    def snapshot_document(self) -> dict[str, Any]:
        return self.store.snapshot_document()

    def snapshot_text(self) -> tuple[str, float]:
        return self.store.snapshot_text()

    def write_snapshot(self) -> Path:
        return self.store.write_snapshot()

    def restore_document(
        self, document: Mapping[str, Any], *, from_client: bool = True, keep_state: bool = True
    ) -> ActivePolicy:
        """StateStore.restore_document."""
        return self.store.restore_document(document, from_client=from_client, keep_state=keep_state)

    def restore_json(self, text: str | bytes) -> ActivePolicy:
        """StateStore.restore_json."""
        return self.store.restore_json(text)

    def restore_client(self, read: Callable[[], dict[str, Any]]) -> ActivePolicy:
        """StateStore.restore_client."""
        return self.store.restore_client(read)

    def document_at(self, given: str) -> dict[str, Any]:
        """StateStore.document_at."""
        return self.store.document_at(given)

    def restore_path(self, given: str) -> ActivePolicy:
        return self.store.restore_path(given)
