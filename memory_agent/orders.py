"""What the memory agent is ordered to do: the four actions, an order as the sidecar or an
operator gives it, the half of it the worker carries out, and an order as the agent's
status shows it while it waits or runs."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping

from memory_agent.planner import Move


class Action(enum.StrEnum):
    OFFLOAD_DRAFT = "offload_draft"
    RELOAD_DRAFT = "reload_draft"
    EXPAND_KV = "expand_kv"
    COMPACT_KV = "compact_kv"


@dataclasses.dataclass(frozen=True, slots=True)
class Order:
    action: Action
    # OFFLOAD_DRAFT: also grow the pool by the draft's blocks; RELOAD_DRAFT: compact first.
    resize_kv: bool = True
    # EXPAND_KV / COMPACT_KV: the pool size (blocks) to reach.
    target_kv_blocks: int = 0
    # "sidecar" or "operator", and why — for logs.
    source: str = "operator"
    reason: str = ""
    # time.monotonic() after which the order must not start (its caller's deadline);
    # None: it waits as long as it takes.
    deadline: float | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerOrder:
    """The worker's half of an order; travels to the worker with the step's batch."""

    # Block copies, wave by wave (nothing in a wave is both read and written).
    waves: tuple[tuple[Move, ...], ...] = ()
    # Old block id → new block id, for the worker's copies of the block tables.
    remap: Mapping[int, int] = dataclasses.field(default_factory=dict)
    offload_draft: bool = False
    reload_draft: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class PendingOrder:
    """An order queued for a step boundary, or running at one (the agent's status)."""

    order_id: int
    action: str
    source: str
    # True once its pool half has run: it completes or is undone, it can no longer be cancelled.
    running: bool
    # Seconds until it expires if still queued (0 when running or without a deadline).
    expires_in_s: float
