"""A deterministic, plausible step result for tests that drive the service."""

from __future__ import annotations

from nightjar_common.types import StepOutcome


def step_outcome(decision_id: str, engine_id: str, gamma: int, batch: int) -> StepOutcome:
    """Half the drafts accepted; the step's time grows with the tokens it verifies, so
    speculation pays at small batches and costs at large ones."""
    accepted = gamma * batch // 2
    return StepOutcome(
        decision_id=decision_id,
        engine_id=engine_id,
        gamma=gamma,
        step_seconds=0.01 + 0.0004 * batch * (1 + gamma),
        generated_tokens=batch + accepted,
        drafted_tokens=gamma * batch,
        accepted_tokens=accepted,
    )
