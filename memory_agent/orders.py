"""What the memory agent is ordered to do: the four actions, an order as the sidecar or an
operator gives it, and the half of it the worker carries out."""

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


@dataclasses.dataclass(frozen=True, slots=True)
class WorkerOrder:
    """The worker's half of an order; travels to the worker with the step's batch."""

    # Block copies, wave by wave (nothing in a wave is both read and written).
    waves: tuple[tuple[Move, ...], ...] = ()
    # Old block id → new block id, for the worker's copies of the block tables.
    remap: Mapping[int, int] = dataclasses.field(default_factory=dict)
    offload_draft: bool = False
    reload_draft: bool = False
