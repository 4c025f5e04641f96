"""The memory agent: carries out draft offload/reload and KV expand/compact orders at step
boundaries, and knows the state they leave behind.

Orders come from the sidecar (directives riding on decisions) and from operators (the
memory-agent gRPC service). They queue here (at most :attr:`MemoryAgent.max_queued`; more
are refused with RESOURCE_EXHAUSTED) and run one at a time, each in two halves:

* **pool half** — on the scheduler's thread, at the start of a ``schedule()`` call, before
  any block is allocated: shrink the usable KV pool (:class:`KVPool`), which returns the
  migration plan of the live blocks above the new size, or grow it where no memory has to
  move first;
* **worker half** — in the worker, at the start of that step's ``execute_model``, before
  the forward pass: copy the migrated blocks, re-point the block tables, offload the draft
  or start its reload (:class:`DraftDevice`). The plan travels with the step's
  ``SchedulerOutput`` (:class:`WorkerOrder`), so the worker applies exactly what the
  scheduler decided, in step order.

An order is a transaction. The pool never grows over memory the worker has not freed yet:
an offload grows it at the *next* boundary, once the draft's memory is the KV cache's. A
failure anywhere in the worker half (a driver call, a copy, a reload that does not verify)
is undone there — the draft's memory back where it was, the block tables as they were —
and never raises into vLLM; what the pool half changed is undone at the next boundary
(the pool's old size, blocks whose copies did not run back at their old ids). The order
then fails (ABORTED, or FAILED_PRECONDITION for a reload that does not verify) and the
next one runs.

An order carries its caller's deadline: one still queued when it passes expires unrun.
A queued order can be cancelled (:meth:`MemoryAgent.cancel`); a running one completes or
is undone.

A reload is verified before the draft counts as resident: where the copy runs
asynchronously (CUDA side stream) it is finished and checked at the next boundary, so it
overlaps a forward pass. While the draft is not resident the engine may only run γ = 0
(:attr:`MemoryAgent.draft_resident`) and the drafter does not run at all.

Nothing here imports vLLM; ``vllm_client_patch/kv_pool.py`` and
``vllm_client_patch/worker_memory.py`` adapt vLLM's objects to the two protocols below.

One module: the order queue and the two halves of each order share the agent's state and
lock.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from memory_agent.draft_weights import ReloadError, Transfer
from memory_agent.orders import Action, Order, PendingOrder, WorkerOrder
from memory_agent.planner import MigrationPlan, Move, PlanError
from nightjar_common.errors import (
    AbortedError,
    CancelledError,
    DeadlineExceededError,
    FailedPreconditionError,
    InvalidArgumentError,
    NightjarError,
    NotFoundError,
    ResourceExhaustedError,
)
from nightjar_common.types import DraftState

if TYPE_CHECKING:
    from memory_agent.metrics import AgentMetrics

log = logging.getLogger(__name__)

# Orders an engine holds queued. Operators give a few and the sidecar's directives are
# de-duplicated (at most one per action), so a full queue means a runaway client.
MAX_QUEUED_ORDERS = 32
# A sidecar directive is a judgement of the load at one decision; the sidecar repeats it
# while it holds. One that has not started within this long is stale and expires.
DIRECTIVE_TTL_S = 10.0
# At most one log line per this many seconds for refused directives (decision rate).
_REFUSAL_LOG_S = 60.0


class KVPool(Protocol):
    """The scheduler's KV block pool, as the agent needs it."""

    def free_blocks(self) -> int:
        """Blocks free for allocation within the usable pool."""
        ...

    def resize(self, num_blocks: int) -> MigrationPlan:
        """Make ids ``< num_blocks`` the usable pool. Growing hands the new ids out as free
        blocks; shrinking re-points every live block above the size at a free id below it
        (block tables included) and returns the plan whose copies the worker must run.
        Raises :class:`PlanError` (and changes nothing) when the live blocks do not fit."""
        ...

    def restore(self, plan: MigrationPlan, num_blocks: int) -> None:
        """Undo a shrink by ``plan`` whose copies did not run: every moved block back at
        its old id (which still holds its contents), the pool ``num_blocks`` again."""
        ...


class DraftDevice(Protocol):
    """The worker's draft weights, KV buffers and block tables. Each call either completes
    or raises with the device as it was before it (the agent relies on it to undo)."""

    def offload_draft(self) -> Transfer: ...

    def start_reload(self) -> Transfer:
        """Begin the reload; the copy may still be running when this returns."""
        ...

    @property
    def reload_is_async(self) -> bool:
        """True when :meth:`start_reload` returns before the copy has finished."""
        ...

    def finish_reload(self) -> Transfer:
        """Wait for the copy and verify it; :class:`ReloadError` if it does not match."""
        ...

    def abandon_reload(self) -> None:
        """After a reload failed at any point: the draft offloaded, its memory where an
        offloaded draft keeps it (under the KV buffer's top blocks, in virtual memory)."""
        ...

    def migrate(self, waves: tuple[tuple[Move, ...], ...], remap: Mapping[int, int]) -> None:
        """Copy KV blocks wave by wave, then re-point the worker's block tables (left as
        they were when a copy fails)."""
        ...


# A pool-side step an order still owes after its worker half (scheduler's thread).
Settle = Callable[["KVPool"], None]


@dataclasses.dataclass(slots=True, eq=False)  # a ticket is itself, never equal to another
class _Ticket:
    order: Order
    order_id: int
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    error: NightjarError | None = None
    # Time the order held the engine at step boundaries (pool half + worker half).
    held_s: float = 0.0
    # What the pool half changed, for undoing it: the pool's size before, a shrink's plan.
    pool_before: int = 0
    shrink: MigrationPlan | None = None
    # Set by the worker half when the order owes the pool a step (growing it over memory
    # the worker freed, or undoing the pool half): run at the next boundary, then the
    # order completes with ``outcome``.
    settle: Settle | None = None
    outcome: NightjarError | None = None

    def expired(self, now: float) -> bool:
        return self.order.deadline is not None and now >= self.order.deadline


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryStatus:
    draft_state: str
    draft_bytes: int
    draft_blocks: int
    kv_blocks: int
    free_kv_blocks: int
    capacity_blocks: int
    pending_action: str
    last_error: str
    offloads: int
    reloads: int
    failed_reloads: int
    migrated_blocks: int
    last_order_ms: float
    pending_orders: tuple[PendingOrder, ...] = ()
    queue_limit: int = MAX_QUEUED_ORDERS

    @property
    def draft_resident(self) -> bool:
        return self.draft_state == DraftState.RESIDENT.value


class MemoryAgent:
    """One per engine. Thread-safe: orders arrive from gRPC threads and the plugin; the
    pool half runs on the scheduler's thread and the worker half on the worker's."""

    def __init__(
        self,
        capacity_blocks: int,
        block_bytes: int,
        draft_bytes: int,
        compaction_supported: bool = True,
        offload_blocker: str = "",
        draft_blocks: int | None = None,
        max_queued: int = MAX_QUEUED_ORDERS,
    ) -> None:
        """``draft_blocks``: S_draft when the draft lives in the buffer's top blocks
        (draft_slot.py); otherwise the draft's bytes in blocks, rounded up."""
        self.metrics: AgentMetrics | None = None
        if capacity_blocks < 2 or block_bytes <= 0:
            raise ValueError("need a KV pool of at least 2 blocks and a positive block size")
        if max_queued < 1:
            raise ValueError("the order queue must hold at least one order")
        self.capacity_blocks = capacity_blocks
        self.block_bytes = block_bytes
        self.draft_bytes = draft_bytes
        self.compaction_supported = compaction_supported
        self.max_queued = max_queued
        # Why the draft can never be offloaded on this engine ("" when it can): its share of
        # the buffer is then KV from the start.
        self.offload_blocker = offload_blocker
        # S_draft in blocks: what offloading the draft is worth to the KV pool.
        if draft_blocks is None:
            draft_blocks = math.ceil(draft_bytes / block_bytes)
        self.draft_blocks = 0 if offload_blocker else min(draft_blocks, capacity_blocks - 2)
        # The usable pool starts without the draft's share (the draft is resident).
        self.kv_blocks = capacity_blocks - self.draft_blocks
        self._state = DraftState.RESIDENT
        self.pool: KVPool | None = None
        self._lock = threading.Lock()
        self._queue: collections.deque[_Ticket] = collections.deque()
        self._current: _Ticket | None = None  # pool half done, not yet complete
        self._next_id = 1
        self._reload_in_flight = False
        self._half_started = 0.0  # when the running half of the current order began
        self._refusal_logged = -math.inf
        self.last_error = ""
        self.offloads = self.reloads = self.failed_reloads = self.migrated_blocks = 0
        # (action, seconds it held the engine, error or "") of recent orders, oldest first.
        self.history: collections.deque[tuple[str, float, str]] = collections.deque(maxlen=64)

    @property
    def state(self) -> DraftState:
        return self._state

    @state.setter
    def state(self, state: DraftState) -> None:
        self._state = state
        if self.metrics is not None:
            self.metrics.draft_resident.set(1.0 if state is DraftState.RESIDENT else 0.0)

    def attach_metrics(self, metrics: AgentMetrics | None) -> None:
        """Count orders and follow the draft's state in ``metrics`` from now on."""
        self.metrics = metrics
        self.state = self._state  # the gauge starts at the current state
        self._queue_changed()

    # -- orders ---------------------------------------------------------------------------

    def submit(self, order: Order) -> _Ticket:
        """Queue an order for the next step boundary. Targets are checked now
        (INVALID_ARGUMENT), so are the queue's bound (RESOURCE_EXHAUSTED) and the order's
        deadline (DEADLINE_EXCEEDED); whether the order can run is checked when it runs."""
        self._check_target(order)
        if order.deadline is not None and order.deadline <= time.monotonic():
            raise DeadlineExceededError(f"{order.action.value}: its deadline has already passed")
        with self._lock:
            # A full queue first drops what has expired in it (its callers gave up).
            stale = self._take_expired() if len(self._queue) >= self.max_queued else []
            queued, ticket = len(self._queue), None
            if queued < self.max_queued:
                ticket = _Ticket(order, self._next_id)
                self._next_id += 1
                self._queue.append(ticket)
            self._queue_changed()
        self._expire(stale)
        if ticket is None:
            if self.metrics is not None:
                self.metrics.refused["queue_full"].inc()
            raise ResourceExhaustedError(
                f"{queued} memory orders are queued, the most this engine holds "
                f"({self.max_queued}): retry once they have run, or cancel some (CancelOrder)"
            )
        log.info(
            "nightjar memory: %s queued as order %d (%s%s)",
            order.action.value,
            ticket.order_id,
            order.source,
            f": {order.reason}" if order.reason else "",
        )
        return ticket

    def offer_directive(self, order: Order) -> None:
        """A sidecar directive: queued unless the same action is already queued or running,
        or the draft is already where the directive wants it (the sidecar then learns the
        state from the next step's context). It expires after :data:`DIRECTIVE_TTL_S`;
        a full queue drops it (counted, logged at most once a minute): it never raises
        into the scheduler."""
        with self._lock:
            busy = [t.order.action for t in self._queue]
            if self._current is not None:
                busy.append(self._current.order.action)
            wanted = {
                Action.OFFLOAD_DRAFT: DraftState.RESIDENT,
                Action.RELOAD_DRAFT: DraftState.OFFLOADED,
            }
        if order.action in busy or self.state is not wanted.get(order.action, self.state):
            return
        if order.deadline is None:
            order = dataclasses.replace(order, deadline=time.monotonic() + DIRECTIVE_TTL_S)
        try:
            self.submit(order)
        except NightjarError as exc:
            now = time.monotonic()
            if now - self._refusal_logged >= _REFUSAL_LOG_S:
                self._refusal_logged = now
                log.warning("nightjar memory: sidecar directive %s dropped: %s", order.action, exc)

    def wait(self, ticket: _Ticket, timeout: float) -> bool:
        """True once the order has ended (then ``ticket.error`` says whether it failed)."""
        return ticket.done.wait(timeout)

    def withdraw(self, ticket: _Ticket, error: NightjarError) -> bool:
        """Take ``ticket`` out of the queue unrun, failing it with ``error``; False when it
        is no longer queued (running or ended)."""
        with self._lock:
            if ticket not in self._queue:
                return False
            self._queue.remove(ticket)
            self._queue_changed()
        result = "expired" if isinstance(error, DeadlineExceededError) else "cancelled"
        self._end_unrun(ticket, error, result)
        return True

    def cancel(self, order_id: int) -> list[int]:
        """Withdraw queued order ``order_id`` (0: every queued order); the ids withdrawn.
        NOT_FOUND when no such order is queued, FAILED_PRECONDITION when it is running."""
        with self._lock:
            if order_id == 0:
                withdrawn = list(self._queue)
            else:
                withdrawn = [t for t in self._queue if t.order_id == order_id]
            if not withdrawn and order_id:
                current = self._current
                if current is not None and current.order_id == order_id:
                    raise FailedPreconditionError(
                        f"order {order_id} ({current.order.action.value}) is running at a "
                        "step boundary: it completes or is undone, it can no longer be cancelled"
                    )
                raise NotFoundError(
                    f"no queued order {order_id} (it ran, expired or was cancelled)"
                )
            for ticket in withdrawn:
                self._queue.remove(ticket)
            self._queue_changed()
        for ticket in withdrawn:
            error = CancelledError(
                f"{ticket.order.action.value} (order {ticket.order_id}) was cancelled before it ran"
            )
            self._end_unrun(ticket, error, "cancelled")
        return [t.order_id for t in withdrawn]

    def _check_target(self, order: Order) -> None:
        if order.action not in (Action.EXPAND_KV, Action.COMPACT_KV):
            return
        target = order.target_kv_blocks
        if not 2 <= target <= self.capacity_blocks:
            raise InvalidArgumentError(
                f"target_kv_blocks must be in [2, {self.capacity_blocks}] "
                f"(the KV buffer's capacity), got {target}"
            )

    def _queue_changed(self) -> None:
        if self.metrics is not None:
            self.metrics.queued.set(len(self._queue))

    # -- pool half (scheduler thread) -----------------------------------------------------

    def begin_step(self, pool: KVPool) -> WorkerOrder | None:
        """Settle the running order's pool-side debt, then run the next order's pool half;
        the worker half to send with this step. Never raises: an order that fails here has
        changed nothing and fails."""
        self.pool = pool
        self._settle(pool)
        with self._lock:
            if self._current is not None:
                return None
            expired, ticket = self._pop_runnable()
            self._current = ticket
        self._expire(expired)
        if ticket is None:
            return None
        self._half_started = time.perf_counter()
        ticket.pool_before, state_before = self.kv_blocks, self.state
        try:
            work = self._pool_half(ticket, pool)
        except NightjarError as exc:  # raised before anything changed
            self._complete_current(exc)
            return None
        except Exception as exc:  # a bug: the order fails, vLLM's scheduler goes on
            log.exception("nightjar memory: %s failed in its pool half", ticket.order.action)
            self.state = state_before
            self._complete_current(AbortedError(f"{ticket.order.action.value} failed: {exc}"))
            return None
        if work is None:
            self._complete_current(None)
            return None
        ticket.held_s += time.perf_counter() - self._half_started
        return work

    def _take_expired(self) -> list[_Ticket]:
        """Expired orders taken out of the queue (under the lock): a full queue makes room."""
        now = time.monotonic()
        expired = [t for t in self._queue if t.expired(now)]
        for ticket in expired:
            self._queue.remove(ticket)
        return expired

    def _expire(self, tickets: list[_Ticket]) -> None:
        for stale in tickets:
            error = DeadlineExceededError(
                f"{stale.order.action.value} (order {stale.order_id}) expired before the "
                "engine reached a step boundary: its caller's deadline passed; it did not run"
            )
            self._end_unrun(stale, error, "expired")

    def _pop_runnable(self) -> tuple[list[_Ticket], _Ticket | None]:
        """(expired orders taken out of the queue, the next order to run); under the lock."""
        now = time.monotonic()
        expired: list[_Ticket] = []
        while self._queue:
            ticket = self._queue.popleft()
            if not ticket.expired(now):
                self._queue_changed()
                return expired, ticket
            expired.append(ticket)
        self._queue_changed()
        return expired, None

    def _settle(self, pool: KVPool) -> None:
        """The pool-side step the running order owes after its worker half, if any."""
        with self._lock:
            ticket = self._current
            if ticket is None or ticket.settle is None:
                return
            settle, ticket.settle = ticket.settle, None
        self._half_started = time.perf_counter()
        error = ticket.outcome
        try:
            settle(pool)
        except Exception as exc:
            log.exception("nightjar memory: %s: the KV pool could not be settled", ticket.order)
            error = error or AbortedError(f"{ticket.order.action.value}: settling the pool: {exc}")
        self._complete_current(error)

    def _pool_half(self, ticket: _Ticket, pool: KVPool) -> WorkerOrder | None:
        order = ticket.order
        action = order.action
        if action is Action.OFFLOAD_DRAFT:
            self._require(DraftState.RESIDENT, "offload")
            # The pool grows once the draft's memory is the KV cache's (next boundary).
            self.state = DraftState.OFFLOADING
            return WorkerOrder(offload_draft=True)
        if action is Action.RELOAD_DRAFT:
            self._require(DraftState.OFFLOADED, "reload")
            limit = self.capacity_blocks - self.draft_blocks
            plan = MigrationPlan({}, [])
            if self.kv_blocks > limit:
                if not order.resize_kv:
                    raise FailedPreconditionError(
                        f"the KV pool ({self.kv_blocks} blocks) uses the draft's memory: "
                        f"compact it to {limit} first (compact_kv)"
                    )
                plan = self._resize(pool, limit)
                ticket.shrink = plan
            self.state = DraftState.RELOADING
            return self._worker_order(plan, reload_draft=True)
        target = order.target_kv_blocks
        if action is Action.EXPAND_KV:
            limit = self.capacity_blocks - (
                0 if self.state is DraftState.OFFLOADED else self.draft_blocks
            )
            if target < self.kv_blocks:
                raise InvalidArgumentError(
                    f"ExpandKv to {target} blocks would shrink the pool "
                    f"({self.kv_blocks} blocks): use CompactKv"
                )
            if target > limit:
                raise FailedPreconditionError(
                    f"cannot grow the KV pool to {target} blocks: {limit} is the limit while "
                    f"the draft is {self.state.value} ({self.draft_blocks} blocks are its)"
                )
            self._resize(pool, target)
            return None
        if target > self.kv_blocks:
            raise InvalidArgumentError(
                f"CompactKv to {target} blocks would grow the pool ({self.kv_blocks} blocks): "
                "use ExpandKv"
            )
        plan = self._resize(pool, target)
        ticket.shrink = plan
        return self._worker_order(plan) if plan.mapping else None

    def _require(self, state: DraftState, verb: str) -> None:
        if self.offload_blocker:
            raise FailedPreconditionError(f"cannot {verb}: {self.offload_blocker}")
        if self.draft_blocks <= 0:
            raise FailedPreconditionError(f"cannot {verb}: this engine has no draft weights")
        if self.state is not state:
            raise FailedPreconditionError(
                f"cannot {verb} a draft that is {self.state.value} (needs {state.value})"
            )

    def _resize(self, pool: KVPool, num_blocks: int) -> MigrationPlan:
        if num_blocks < self.kv_blocks and not self.compaction_supported:
            raise FailedPreconditionError(
                "this engine's KV layout (split kernel blocks) does not support compaction"
            )
        try:
            plan = pool.resize(num_blocks)
        except PlanError as exc:
            raise FailedPreconditionError(f"cannot shrink the KV pool: {exc}") from exc
        log.info(
            "nightjar memory: KV pool %d -> %d blocks (%d moved)",
            self.kv_blocks,
            num_blocks,
            len(plan.mapping),
        )
        self.kv_blocks = num_blocks
        self.migrated_blocks += len(plan.mapping)
        return plan

    def _grow_back(self, ticket: _Ticket, copied: bool) -> Settle | None:
        """Undoing the pool half of ``ticket``: the pool back to its size before. Blocks
        whose copies ran stay in their new homes (they hold their contents there); when
        the copies did not run, they go back to their old ids."""
        before, plan = ticket.pool_before, ticket.shrink
        if self.kv_blocks >= before:
            return None
        if copied or plan is None or not plan.mapping:
            return lambda pool: self._regrow(pool, before)

        def restore(pool: KVPool) -> None:
            pool.restore(plan, before)
            log.info(
                "nightjar memory: KV pool %d -> %d blocks (shrink undone)", self.kv_blocks, before
            )
            self.kv_blocks = before
            self.migrated_blocks -= len(plan.mapping)

        return restore

    def _regrow(self, pool: KVPool, num_blocks: int) -> None:
        self._resize(pool, num_blocks)

    @staticmethod
    def _worker_order(plan: MigrationPlan, reload_draft: bool = False) -> WorkerOrder:
        waves = tuple(tuple(wave) for wave in plan.waves)
        return WorkerOrder(waves, dict(plan.mapping), reload_draft=reload_draft)

    # -- worker half (worker thread) ------------------------------------------------------

    def worker_step(self, device: DraftDevice, work: WorkerOrder | None) -> None:
        """At the start of a step in the worker: finish a reload begun at the previous
        boundary, then carry out this step's order. Never raises (it runs inside vLLM's
        ``execute_model``): a failure is undone and fails the order."""
        try:
            if self._reload_in_flight:
                self._half_started = time.perf_counter()
                self._finish_reload(device)
            if work is None:
                return
            self._half_started = time.perf_counter()
            self._worker_half(device, work)
            current = self._current
            if current is not None:  # a reload still copying, or a pool step owed
                current.held_s += time.perf_counter() - self._half_started
        except Exception as exc:  # a bug in the agent itself: fail the order, serve on
            log.exception("nightjar memory: the worker half failed unexpectedly")
            self._reload_in_flight = False
            if self._current is not None and self._current.settle is None:
                self._complete_current(AbortedError(f"the worker half failed: {exc}"))

    def _worker_half(self, device: DraftDevice, work: WorkerOrder) -> None:
        ticket = self._current
        if ticket is None:  # cannot happen: a worker half travels only with a running order
            log.error("nightjar memory: a worker half arrived without its order; ignored")
            return
        if work.waves:
            try:
                device.migrate(work.waves, work.remap)
            except Exception as exc:
                if work.reload_draft:
                    self.state = DraftState.OFFLOADED
                self._fail_worker(ticket, f"copying {len(work.remap)} KV blocks", exc, False)
                return
        if work.offload_draft:
            self._offload(ticket, device)
        elif work.reload_draft:
            self._start_reload(ticket, device)
        else:
            self._complete_current(None)

    def _offload(self, ticket: _Ticket, device: DraftDevice) -> None:
        try:
            moved = device.offload_draft()
        except Exception as exc:
            self.state = DraftState.RESIDENT  # the device call undid itself
            self._fail_worker(ticket, "offloading the draft", exc, True)
            return
        self.state = DraftState.OFFLOADED
        self.offloads += 1
        log.info(
            "nightjar memory: draft offloaded (%d MiB in %.1f ms)",
            moved.bytes >> 20,
            moved.call_seconds * 1e3,
        )
        if ticket.order.resize_kv:
            capacity = self.capacity_blocks
            self._owe(ticket, lambda pool: self._regrow(pool, capacity), None)
        else:
            self._complete_current(None)

    def _start_reload(self, ticket: _Ticket, device: DraftDevice) -> None:
        try:
            device.start_reload()
        except Exception as exc:
            self._reload_failed(ticket, device, exc)
            return
        self._reload_in_flight = True
        if not device.reload_is_async:
            self._finish_reload(device)

    def _finish_reload(self, device: DraftDevice) -> None:
        self._reload_in_flight = False
        ticket = self._current
        try:
            moved = device.finish_reload()
        except Exception as exc:
            if ticket is not None:
                self._reload_failed(ticket, device, exc)
            return
        self.state = DraftState.RESIDENT
        self.reloads += 1
        log.info(
            "nightjar memory: draft reloaded and verified (%d MiB, verify %.1f ms)",
            moved.bytes >> 20,
            moved.call_seconds * 1e3,
        )
        self._complete_current(None)

    def _reload_failed(self, ticket: _Ticket, device: DraftDevice, exc: Exception) -> None:
        """Undo a reload: the draft offloaded, its memory back under the KV cache, the pool
        its old size (next boundary). Speculation stays off."""
        self.failed_reloads += 1
        self.state = DraftState.OFFLOADED
        error: NightjarError
        try:
            device.abandon_reload()
        except Exception as undo_exc:
            # The memory stays under the draft's range: the pool must not grow over it.
            log.exception("nightjar memory: undoing the failed reload failed")
            error = AbortedError(
                f"reload_draft failed ({exc}) and undoing it failed too ({undo_exc}): the "
                f"draft stays offloaded and the KV pool at {self.kv_blocks} blocks"
            )
            self._owe(ticket, None, error)
            return
        if isinstance(exc, ReloadError):  # the copy ran but does not verify
            log.error("nightjar memory: %s; speculation stays off", exc)
            error = FailedPreconditionError(str(exc))
        else:
            error = self._aborted(ticket, "reloading the draft", exc)
        self._owe(ticket, self._grow_back(ticket, copied=True), error)

    def _fail_worker(self, ticket: _Ticket, what: str, exc: Exception, copied: bool) -> None:
        """A device call failed (and undid itself): undo the pool half and fail the order."""
        self._owe(ticket, self._grow_back(ticket, copied), self._aborted(ticket, what, exc))

    def _aborted(self, ticket: _Ticket, what: str, exc: Exception) -> AbortedError:
        log.error("nightjar memory: %s failed: %s: %s; undone", ticket.order.action, what, exc)
        return AbortedError(
            f"{ticket.order.action.value} (order {ticket.order_id}) undone: {what} failed: "
            f"{exc}; the draft is {self.state.value} and the engine serves on as before"
        )

    def _owe(self, ticket: _Ticket, settle: Settle | None, error: NightjarError | None) -> None:
        """End the worker half: complete the order now, or at the next boundary once the
        pool step it owes has run."""
        if settle is None:
            self._complete_current(error)
            return
        with self._lock:
            ticket.outcome, ticket.settle = error, settle

    def _complete_current(self, error: NightjarError | None) -> None:
        with self._lock:
            ticket, self._current = self._current, None
        if ticket is not None:
            self._complete(ticket, error)

    def _complete(self, ticket: _Ticket, error: NightjarError | None) -> None:
        ticket.error = error
        self.last_error = str(error) if error else ""
        ticket.held_s += time.perf_counter() - self._half_started
        self.history.append((ticket.order.action.value, ticket.held_s, self.last_error))
        if self.metrics is not None:
            result = "failed" if error is not None else "ok"
            self.metrics.order_done(ticket.order.action, result, ticket.held_s)
        if error is not None:
            log.warning("nightjar memory: %s failed: %s", ticket.order.action.value, error)
        ticket.done.set()

    def _end_unrun(self, ticket: _Ticket, error: NightjarError, result: str) -> None:
        """An order that never ran (expired, cancelled): the engine's state is untouched."""
        ticket.error = error
        if self.metrics is not None:
            self.metrics.order_done(ticket.order.action, result, None)
        log.info("nightjar memory: %s", error)
        ticket.done.set()

    # -- views ----------------------------------------------------------------------------

    @property
    def draft_resident(self) -> bool:
        """Speculation is allowed only while this holds."""
        return self.state is DraftState.RESIDENT

    def status(self) -> MemoryStatus:
        now = time.monotonic()
        with self._lock:
            current = self._current
            tickets = ([current] if current is not None else []) + list(self._queue)
        orders = tuple(
            PendingOrder(
                order_id=t.order_id,
                action=t.order.action.value,
                source=t.order.source,
                running=t is current,
                expires_in_s=0.0
                if t is current or t.order.deadline is None
                else max(0.0, t.order.deadline - now),
            )
            for t in tickets
        )
        free = self.pool.free_blocks() if self.pool is not None else self.kv_blocks - 1
        return MemoryStatus(
            draft_state=self.state.value,
            draft_bytes=self.draft_bytes,
            draft_blocks=self.draft_blocks,
            kv_blocks=self.kv_blocks,
            free_kv_blocks=free,
            capacity_blocks=self.capacity_blocks,
            pending_action=",".join(o.action for o in orders),
            last_error=self.last_error,
            offloads=self.offloads,
            reloads=self.reloads,
            failed_reloads=self.failed_reloads,
            migrated_blocks=self.migrated_blocks,
            last_order_ms=1e3 * self.history[-1][1] if self.history else 0.0,
            pending_orders=orders,
            queue_limit=self.max_queued,
        )
