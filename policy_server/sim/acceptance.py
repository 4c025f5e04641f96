"""Acceptance model: per-request acceptance rates and the tokens a verify step yields.

Each request draws its own per-token acceptance rate α from a Beta distribution
whose mean is the workload's; a verify step with γ draft tokens then accepts a
truncated-geometric run (Leviathan et al.): P(k accepted) = α^k(1−α) for k < γ,
α^γ for k = γ, so E[tokens] = (1 − α^{γ+1}) / (1 − α) including the bonus token.

Workload means are calibrated from published mean accepted tokens per step
(``data/calibration/published_spec_decode_numbers.csv``, one cited source per row) by solving
(1 − α^{γ+1}) / (1 − α) = AL for α at the γ the source used. A mixed population
(``AcceptanceMix``, ``MIXES``) draws each request's category by weight first, then its α
from that category's model: greedy code beside creative writing in one batch.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

# One formula for the simulator and the policies that model it.
from policy_server.policies.models import expected_tokens

__all__ = [
    "EASY",
    "HARD",
    "MIXES",
    "WORKLOADS",
    "Acceptance",
    "AcceptanceMix",
    "AcceptanceModel",
    "AcceptanceSchedule",
    "accepted_run",
    "alpha_for_acceptance_length",
    "expected_tokens",
]


def alpha_for_acceptance_length(length: float, gamma: int) -> float:
    """Solve expected_tokens(α, γ) = length for α by bisection."""
    if not 1.0 <= length <= gamma + 1:
        raise ValueError(f"acceptance length {length} impossible with γ={gamma}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_tokens(mid, gamma) < length:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def accepted_run(rng: random.Random, alpha: float, gamma: int) -> int:
    """Draft tokens accepted in one verify step (0..γ)."""
    run = 0
    while run < gamma and rng.random() < alpha:
        run += 1
    return run


@dataclasses.dataclass(frozen=True, slots=True)
class AcceptanceModel:
    """Per-workload Beta(mean, concentration) distribution of per-request α."""

    name: str
    mean: float
    concentration: float = 20.0
    source: str = ""

    def sample_alpha(self, rng: random.Random) -> float:
        a = self.mean * self.concentration
        b = (1 - self.mean) * self.concentration
        return min(0.99, rng.betavariate(a, b))

    def at(self, arrival_s: float) -> AcceptanceModel:
        """The model of a request arriving at ``arrival_s`` (the same at every time)."""
        return self


@dataclasses.dataclass(frozen=True, slots=True)
class AcceptanceMix:
    """A population of request categories: a request is of a category with its weight's
    share, and draws its α from that category's model."""

    name: str
    parts: Sequence[tuple[float, AcceptanceModel]]

    def sample_alpha(self, rng: random.Random) -> float:
        weights = [weight for weight, _ in self.parts]
        category = rng.choices([model for _, model in self.parts], weights)[0]
        return category.sample_alpha(rng)

    def at(self, arrival_s: float) -> AcceptanceMix:
        """The mix of a request arriving at ``arrival_s`` (the same at every time)."""
        return self


@dataclasses.dataclass(frozen=True, slots=True)
class AcceptanceSchedule:
    """A request mix that changes over time: requests arriving from ``start_s`` on draw
    their α from that phase's model (a drift workload for adaptive policies)."""

    phases: Sequence[tuple[float, AcceptanceModel]]

    @property
    def name(self) -> str:
        return " → ".join(model.name for _, model in self.phases)

    def at(self, arrival_s: float) -> AcceptanceModel:
        current = self.phases[0][1]
        for start_s, model in self.phases:
            if arrival_s >= start_s:
                current = model
        return current


# Spec-Bench leaderboard, Vicuna-7B, A100, SpS with vicuna-68m: AL 2.28; EAGLE: AL 3.58
# (Spec-Bench drafts 5 tokens for SpS; EAGLE trees are approximated by a chain of 6).
WORKLOADS = {
    "chat-sps": AcceptanceModel(
        "chat-sps",
        alpha_for_acceptance_length(2.28, 5),
        source="Spec-Bench leaderboard, Vicuna-7B SpS (vicuna-68m), AL 2.28 at γ=5",
    ),
    "chat-eagle": AcceptanceModel(
        "chat-eagle",
        alpha_for_acceptance_length(3.58, 6),
        source="Spec-Bench leaderboard, Vicuna-7B EAGLE, AL 3.58 (chain of 6 approximation)",
    ),
}


# Where a request's α comes from: one model, a mix of categories, or a schedule over time.
Acceptance = AcceptanceModel | AcceptanceMix | AcceptanceSchedule


def _category(name: str, length: float, gamma: int, source: str) -> AcceptanceModel:
    """A category whose mean α gives the published acceptance length at the source's γ."""
    return AcceptanceModel(name, alpha_for_acceptance_length(length, gamma), source=source)


# The drift workload's two populations (sim/runs.py, DRIFT_PHASES): one a draft predicts
# well (α = 0.8, e.g. code edits, EAGLE-class drafts) and one it predicts badly (α = 0.3).
# The project's own pair, not published rows.
EASY = AcceptanceModel("easy", 0.8, source="drift workload, first half")
HARD = AcceptanceModel("hard", 0.3, source="drift workload, second half")

# Spec-Bench's leaderboard publishes per-category speed-ups only (its acceptance length is
# overall); the rows of published_spec_decode_numbers.csv with per-category acceptance are:
MIXES = {
    # vllm-project/speculators RFC #1135 (DSpark drafter, 8 tokens per block, AL with the
    # bonus token): HumanEval 4.57 (α ≈ 0.82), writing 2.64 (α ≈ 0.63); half each.
    "code-writing": AcceptanceMix(
        "code-writing",
        (
            (0.5, _category("code", 4.57, 8, "speculators RFC #1135, HumanEval AL 4.57 at 8")),
            (0.5, _category("writing", 2.64, 8, "speculators RFC #1135, writing AL 2.64 at 8")),
        ),
    ),
    # ggml-org/llama.cpp PR #22673 (MTP draft, n_max = 4): per-task accepted/drafted 0.81
    # (code_python) and 0.41 (translation), i.e. AL = 1 + 4 · rate (α ≈ 0.92 and 0.67).
    "code-translation": AcceptanceMix(
        "code-translation",
        (
            (0.5, _category("code", 1 + 4 * 0.81, 4, "llama.cpp PR #22673, code_python 0.81")),
            (0.5, _category("translation", 1 + 4 * 0.41, 4, "llama.cpp PR #22673, 0.41")),
        ),
    ),
    # Both of the drift workload's populations at once: the widest spread of α the
    # benchmark runs (the published mixes above differ by 0.19 and 0.25).
    "easy-hard": AcceptanceMix("easy-hard", ((0.5, EASY), (0.5, HARD))),
}
