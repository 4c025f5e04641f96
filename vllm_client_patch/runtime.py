"""How this engine runs speculation, read from its vLLM configuration at start.

What a γ costs depends on it: vLLM's model drafters (draft model, EAGLE, MTP) run their
first pass at γ = 0 too, to keep the drafter's KV cache in step; the V2 model runner's
draft-model speculator (``StandaloneARSpeculator``, vLLM ≥ 0.33) drafts Γmax tokens every
step and the runner drops those past the step's γ, so there a smaller γ saves verification
only. The sidecar's step-time model prices a step at max(γ, ``min_draft_passes``) draft
passes (StepContext.min_draft_passes); the runtime itself is shown to operators.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from nightjar_common.types import EngineRuntime

# Methods whose V2 speculator drafts Γmax tokens whatever the step's γ (the contract stage
# checks that its propose() still ignores the γ it is given).
_DRAFTS_IN_FULL_ON_V2 = frozenset({"draft_model"})


@dataclasses.dataclass(frozen=True, slots=True)
class SpeculationRuntime:
    runtime: EngineRuntime
    # Draft passes a step runs whatever its γ (0..Γmax).
    min_draft_passes: int


def request_gammas_note(runtime: EngineRuntime) -> str:
    """What the start-up line says of per-request γ on this engine: under async scheduling
    the drafts never reach the scheduler, so a request's γ only shortens its next draft
    slots (a path not yet run on a GPU), and the default policy plans none for it
    (EngineRuntime.request_gammas_applied, which the sidecar reads from every context)."""
    if runtime.request_gammas_applied:
        return "per-request γ applied (drafts cut per request)"
    return (
        "per-request γ not applied under async scheduling: the default policy plans per "
        "batch for this engine (a policy forcing per-request γ shortens only draft slots)"
    )


def describe(vllm_config: Any) -> SpeculationRuntime:
    """The engine's runner, scheduling and method, and the draft passes a step always runs."""
    import vllm

    spec = vllm_config.speculative_config
    gamma_max = int(spec.num_speculative_tokens or 0) if spec is not None else 0
    method = str(spec.method) if spec is not None else ""
    runner = "v2" if getattr(vllm_config, "use_v2_model_runner", False) else "v1"
    runtime = EngineRuntime(
        engine_version=str(getattr(vllm, "__version__", "")),
        model_runner=runner,
        async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
        method=method,
    )
    if spec is None or not spec.uses_draft_kv_cache():
        passes = 0  # n-gram and other model-free proposers cost nothing at γ = 0
    elif runner == "v2" and method in _DRAFTS_IN_FULL_ON_V2:
        passes = gamma_max
    else:
        passes = min(1, gamma_max)
    return SpeculationRuntime(runtime, passes)
