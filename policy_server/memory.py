"""Elastic-memory controller: when to offload the draft model and when to bring it back.

The Nightjar paper's §5 (arXiv:2512.22420). Per engine, from the step contexts the plugin sends:

* **Expand** — speculation is off (the policy chose γ = 0) *and* free KV blocks stay
  below τ_low for T_persist consecutive steps: tell the memory agent to offload the
  draft's weights and grow the KV pool by the draft's size in blocks.
* **Contract** — the waiting queue is empty *and* free blocks exceed S_draft + τ_low for
  T_persist consecutive steps: compact the pool by S_draft blocks and reload the draft.

A directive is issued once and then awaited: the engine's next contexts say whether the
draft is resident and how big the pool is. From the moment an offload is ordered until a
reload is verified (the context says the draft is resident again), only γ = 0 is
allowed. A cooldown after every transition keeps the two triggers from thrashing, and an
order the engine has not carried out after ``order_timeout_steps`` may be issued again.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from nightjar_common.types import DraftState, MemoryDirective, StepContext
from policy_server.policies.base import PolicyError

OFFLOAD = "offload_draft_expand_kv"
RELOAD = "compact_kv_reload_draft"


class MemoryParamsError(PolicyError):
    """Memory-controller parameters out of range."""


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryParams:
    enabled: bool = False
    # Free-block threshold as a fraction of the pool (the paper's best: 10 %).
    tau_low: float = 0.10
    # Consecutive steps a trigger condition must hold.
    t_persist: int = 32
    # KV blocks the draft's weights are worth (S_draft); 0 = cannot offload.
    draft_blocks: int = 0
    # Steps after a completed transition during which no new one starts.
    cooldown_steps: int = 512
    # Steps to wait for the engine to carry out an order before issuing it again.
    order_timeout_steps: int = 256

    def __post_init__(self) -> None:
        if not 0 < self.tau_low < 1:
            raise MemoryParamsError(f"tau_low must be in (0, 1), got {self.tau_low}")
        for name in ("t_persist", "cooldown_steps", "order_timeout_steps"):
            if getattr(self, name) < 1:
                raise MemoryParamsError(f"{name} must be >= 1")
        if self.draft_blocks < 0:
            raise MemoryParamsError("draft_blocks must be >= 0")


@dataclasses.dataclass(slots=True)
class EngineMemory:
    """One engine's view: what the controller ordered and what the engine reported."""

    state: DraftState = DraftState.RESIDENT
    streak: int = 0
    since_transition: int = 1 << 30
    since_order: int = 0
    transitions: int = 0

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"state": self.state.value}


class MemoryController:
    def __init__(self, params: MemoryParams) -> None:
        self.params = params
        self.engines: dict[str, EngineMemory] = {}

    def observe(self, ctx: StepContext) -> None:
        """Take in the draft state the engine reports (before deciding the step's γ: a
        verified reload allows speculation in the very step that reports it)."""
        if self.params.enabled and self.params.draft_blocks > 0:
            self._observe(self.engines.setdefault(ctx.engine_id, EngineMemory()), ctx)

    def speculation_allowed(self, ctx: StepContext) -> bool:
        """False while the draft is (about to be) away: the policy must pick γ = 0."""
        memory = self.engines.get(ctx.engine_id)
        return ctx.draft_resident and (memory is None or memory.state is DraftState.RESIDENT)

    def step(self, ctx: StepContext, gamma: int) -> MemoryDirective:
        """Account one decided step; the directive to attach to its decision (or none)."""
        if not self.params.enabled or self.params.draft_blocks <= 0:
            return MemoryDirective()
        memory = self.engines.setdefault(ctx.engine_id, EngineMemory())
        memory.since_transition += 1
        memory.since_order += 1
        self._observe(memory, ctx)
        threshold = self.params.tau_low * ctx.total_kv_blocks
        if memory.state is DraftState.RESIDENT:
            scarce = gamma == 0 and ctx.free_kv_blocks < threshold
            return self._maybe_order(memory, scarce, OFFLOAD, ctx.total_kv_blocks, ctx)
        if memory.state is DraftState.OFFLOADED:
            roomy = (
                ctx.num_waiting == 0 and ctx.free_kv_blocks > self.params.draft_blocks + threshold
            )
            return self._maybe_order(memory, roomy, RELOAD, ctx.total_kv_blocks, ctx)
        if memory.since_order > self.params.order_timeout_steps:
            # The engine has not carried the order out: fall back and allow a new one.
            memory.state = DraftState.RESIDENT if ctx.draft_resident else DraftState.OFFLOADED
        return MemoryDirective()

    def _observe(self, memory: EngineMemory, ctx: StepContext) -> None:
        """Move on when the engine reports an ordered transition as done."""
        if memory.state is DraftState.OFFLOADING and not ctx.draft_resident:
            self._transition(memory, DraftState.OFFLOADED)
        elif memory.state is DraftState.RELOADING and ctx.draft_resident:
            self._transition(memory, DraftState.RESIDENT)
        elif memory.state is DraftState.RESIDENT and not ctx.draft_resident:
            memory.state = DraftState.OFFLOADED  # offloaded by an operator
        elif memory.state is DraftState.OFFLOADED and ctx.draft_resident:
            memory.state = DraftState.RESIDENT  # reloaded by an operator

    def _transition(self, memory: EngineMemory, state: DraftState) -> None:
        memory.state, memory.since_transition, memory.streak = state, 0, 0
        memory.transitions += 1

    def _maybe_order(
        self, memory: EngineMemory, condition: bool, action: str, total: int, ctx: StepContext
    ) -> MemoryDirective:
        memory.streak = memory.streak + 1 if condition else 0
        if memory.streak < self.params.t_persist:
            return MemoryDirective()
        if memory.since_transition < self.params.cooldown_steps:
            return MemoryDirective()
        memory.streak, memory.since_order = 0, 0
        blocks = self.params.draft_blocks
        if action == OFFLOAD:
            memory.state = DraftState.OFFLOADING
            low = math.ceil(self.params.tau_low * total)
            reason = (
                f"{self.params.t_persist} steps with γ=0 and free blocks "
                f"{ctx.free_kv_blocks} < τ_low {low}"
            )
            return MemoryDirective(OFFLOAD, total + blocks, reason)
        memory.state = DraftState.RELOADING
        reason = (
            f"{self.params.t_persist} steps with an empty queue and free blocks "
            f"{ctx.free_kv_blocks} > S_draft {blocks} + τ_low"
        )
        return MemoryDirective(RELOAD, total - blocks, reason)

    def state(self, engine_id: str | None = None) -> dict[str, Any]:
        engines = {e: m.as_dict() for e, m in self.engines.items() if engine_id in (None, e)}
        return {"params": dataclasses.asdict(self.params), "engines": engines}
