"""Plain data types shared by policies, the server and the client.

These mirror the nightjar.v1 wire messages but carry no gRPC or protobuf
dependency, so the algorithms can be used (and tested) on their own.

The per-step types an engine builds on its own thread every step (StepContext,
RequestSignals, StepOutcome, RanStep) are plain slotted dataclasses, as vLLM's per-step
outputs are: a frozen one's construction sets each field through object.__setattr__ and
costs four times as much. They are values all the same: nothing changes one once built.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class BinType(enum.StrEnum):
    """How a decision's γ was chosen."""

    EXPLORE = "explore"
    EXPLOIT = "exploit"
    # Non-learning policies (static, off, table).
    FIXED = "fixed"
    # Only one γ was feasible (e.g. the draft model is not resident).
    FORCED = "forced"


@dataclass(frozen=True, slots=True)
class EngineRuntime:
    """How an engine runs speculation (StepContext.runtime): shown to operators; what it
    means for the step time reaches the policy as ``min_draft_passes``."""

    engine_version: str = ""
    # vLLM's model runner, "v1" or "v2".
    model_runner: str = ""
    async_scheduling: bool = False
    # The speculative method: draft_model, eagle, eagle3, mtp, ngram, ...
    method: str = ""

    @property
    def request_gammas_applied(self) -> bool:
        """Whether a per-request γ runs as the policy plans it. Under async scheduling the
        drafts never reach the scheduler: the plugin can only shorten the next step's draft
        slots (verification, not drafting), a path never run on a GPU, so a policy that
        chooses per-request plans by itself does not plan for such an engine
        (docs/VLLM_PLUGIN.md, "Per-request γ")."""
        return not self.async_scheduling


@dataclass(slots=True)
class RequestSignals:
    request_id: str
    context_tokens: int = 0
    recent_accepts: tuple[int, ...] = ()
    kl_divergence: float | None = None
    draft_entropy: float | None = None


@dataclass(slots=True)
class StepContext:
    """What a policy may look at before one decoding step of one engine."""

    engine_id: str
    batch_size: int
    step_index: int = 0
    num_waiting: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    max_draft_lag_tokens: int = 0
    draft_resident: bool = True
    # None = unknown: the policy uses the γ it last chose for this engine.
    previous_gamma: int | None = None
    # 0 = no engine-side limit beyond the policy's own Γmax.
    max_gamma: int = 0
    learner_key: str = ""
    requests: tuple[RequestSignals, ...] = ()
    # Tokens in the decode batch's context (KV read by the step); 0 = unknown.
    context_tokens: int = 0
    # Draft passes the engine runs in a step whatever γ is (vLLM's model drafters: 1; the
    # V2 runner's draft model drafts Γmax always).
    min_draft_passes: int = 0
    # How the engine runs speculation; None = not said.
    runtime: EngineRuntime | None = None


@dataclass(slots=True)
class StepOutcome:
    """What one decided step achieved."""

    decision_id: str
    engine_id: str
    gamma: int
    step_seconds: float
    generated_tokens: int
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    # Accepted draft tokens of each request that verified drafts (any order; () = the
    # engine sent the batch totals only).
    request_accepts: tuple[int, ...] = ()
    # Prefill tokens computed in the same step (chunked prefill); 0 = none or unknown.
    prefill_tokens: int = 0
    # γ drafted during the step (the next decision's, in vLLM); None = ``gamma``.
    draft_gamma: int | None = None
    # The request of each entry of ``request_accepts`` (sent to a policy that reads
    # per-request signals); () = unlabelled.
    request_ids: tuple[str, ...] = ()

    @property
    def drafted_gamma(self) -> int:
        """γ whose draft passes ``step_seconds`` includes."""
        return self.gamma if self.draft_gamma is None else self.draft_gamma

    @property
    def goodput(self) -> float:
        """Generated tokens per second of step wall time (the Nightjar reward)."""
        return self.generated_tokens / self.step_seconds


@dataclass(frozen=True, slots=True)
class Choice:
    """A policy's answer for one step, before the server stamps ids and versions."""

    gamma: int
    bin_type: BinType
    exploration_probability: float = 0.0
    request_gammas: tuple[tuple[str, int], ...] = ()

    @property
    def exploration(self) -> bool:
        return self.bin_type is BinType.EXPLORE


@dataclass(frozen=True, slots=True)
class MemoryDirective:
    action: str = ""  # "", "offload_draft_expand_kv", "compact_kv_reload_draft"
    target_kv_blocks: int = 0
    reason: str = ""


class DraftState(enum.StrEnum):
    """Where the draft model's weights are, as the sidecar and the memory agent track it."""

    RESIDENT = "resident"
    OFFLOADING = "offloading"  # ordered, not yet reported done
    OFFLOADED = "offloaded"
    RELOADING = "reloading"  # ordered, reload not yet verified


@dataclass(frozen=True, slots=True)
class GammaTable:
    """The policy's γ for a range of batch sizes, for steps starting in one speculation
    state or in either (nightjar.v1.7 GammaTable; v1.9 any_speculation_state; v1.10
    exploit_gammas)."""

    table_id: str
    policy_name: str
    policy_version: str
    first_batch_size: int
    gammas: tuple[int, ...]
    exploring: tuple[bool, ...]
    speculation_off: bool
    step_index: int
    valid_steps: int
    valid_ms: float
    memory_directive: MemoryDirective = field(default_factory=MemoryDirective)
    # FIXED or FORCED when every entry is (a non-learning policy, a draft not resident);
    # None: each entry is EXPLORE (exploring) or EXPLOIT.
    reason: BinType | None = None
    # Per-request γ (each capped by the step's entry) and whether the policy reads
    # per-request signals, as Decision.
    request_gammas: tuple[tuple[str, int], ...] = ()
    reads_request_signals: bool = False
    # The entries serve steps in either speculation state (the policy prices no catch-up).
    any_speculation_state: bool = False
    # Per entry, the γ a step runs once the entry's exploration ran (the entry's own where
    # it does not explore, -1 where it has none: the step asks again); () = none (v1.10).
    exploit_gammas: tuple[int, ...] = ()

    def covers(self, batch_size: int) -> bool:
        return 0 <= batch_size - self.first_batch_size < len(self.gammas)


@dataclass(slots=True)
class RanStep:
    """A step an engine ran from a table: "<table_id>.<n>", its context and the γ run."""

    decision_id: str
    context: StepContext
    gamma: int
    # The step ran its exploring entry's exploit γ (GammaTable.exploit_gammas).
    exploited: bool = False

    @property
    def table_id(self) -> str:
        return self.decision_id.rpartition(".")[0]
