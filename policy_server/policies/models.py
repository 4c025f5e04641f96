"""Online models of the two things that decide goodput: draft acceptance and step time.

Goodput of a step with γ draft tokens per request is B·E(α, γ) / t(B, γ): B requests each
gain E(α, γ) = (1 − α^{γ+1}) / (1 − α) tokens (accepted drafts + the bonus token; Leviathan
et al., arXiv:2211.17192) in a step that takes t(B, γ). Both factors are shared by every
batch size, so they are learned once per learner from every step instead of per (B, γ)
arm:

- ``AcceptanceModel``: the per-token acceptance rate α, from exponentially forgotten
  success/failure counts (exact for per-request accepts, moment-matched otherwise), with a
  Beta-like posterior to sample from;
- ``StepTimeModel``: ridge regression with exponential forgetting of the step's wall time
  on a few features of the forward pass (tokens B·(γ+1) + prefill through a piecewise-linear
  basis, draft passes γ and γ·B, attention over the batch's context), weighted for relative
  error, with its posterior covariance for Thompson sampling;
- ``LocalCorrection``: the regression's mean residual per (batch-size octave, γ) where the
  engine has run, for the curve shapes its few features cannot express.

Pure numpy, no engine or gRPC knowledge. The state of both is plain JSON for snapshots.

The two models and the local correction are one module: they share the feature map and
the forgetting arithmetic of the step-time regression.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

# Hinges of the piecewise-linear basis over forward-pass tokens: the GEMMs of a decoder are
# flat (memory-bound) up to a knee and linear above it; the knee depends on the model and
# the accelerator, so the basis has one every octave and the fit places it.
TOKEN_KNOTS = (32, 64, 128, 256, 512, 1024, 2048, 4096)
TOKEN_SCALE = 256.0
CONTEXT_SCALE = 65536.0
FEATURES = 1 + 1 + len(TOKEN_KNOTS) + 2 + 2
# The step-time fit in use is at most this much engine time old: the count bound alone lets
# a fit made before the batch filled up price the large batch for seconds of engine time
# (the 3σ surprise test misses it where long prefill steps set σ), while a solve per quarter
# second of engine time costs nothing (docs/POLICIES.md, "Prices of the decision path").
REFIT_MS = 250.0


def expected_tokens(alpha: float, gamma: int) -> float:
    """E[accepted drafts + bonus] of one request in one verify step (truncated geometric)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def expected_accepted(alpha: float, gamma: int) -> float:
    """E[accepted drafts] of one request drafting γ tokens: Σ_{k=1..γ} α^k."""
    return expected_tokens(alpha, gamma) - 1.0


_KNOTS = np.array(TOKEN_KNOTS, dtype=np.float64)
# Features that depend on the batch shape alone; the last two scale with the context.
SHAPE_FEATURES = FEATURES - 2


@functools.lru_cache(maxsize=8192)
def shape_features(
    batch_size: int, gamma_top: int, prefill_tokens: int = 0, min_draft_passes: int = 0
) -> FloatArray:
    """Rows γ = 0..gamma_top of the context-free features: cached, because a decision
    needs them for every γ and batch shapes repeat (a read-only array)."""
    gamma = np.arange(gamma_top + 1, dtype=np.float64)
    tokens = batch_size * (gamma + 1.0) + prefill_tokens
    x = np.empty((len(gamma), SHAPE_FEATURES))
    _fill_shape(x, tokens, np.maximum(gamma, min_draft_passes), batch_size)
    x.flags.writeable = False
    return x


def _fill_shape(x: FloatArray, tokens: FloatArray, passes: FloatArray, batch_size: int) -> None:
    """Columns 0..SHAPE_FEATURES-1 of ``x``: intercept, forward-pass tokens through the
    piecewise-linear basis, and draft passes (launch-bound per pass, plus a per-request
    part)."""
    x[:, 0] = 1.0
    x[:, 1] = tokens / TOKEN_SCALE
    x[:, 2 : 2 + len(TOKEN_KNOTS)] = np.maximum(0.0, tokens[:, None] - _KNOTS) / TOKEN_SCALE
    x[:, SHAPE_FEATURES - 2] = passes
    x[:, SHAPE_FEATURES - 1] = passes * batch_size / 64.0


def verify_features(
    batch_size: int,
    draft_passes: FloatArray,
    verified: FloatArray,
    attention_gamma: FloatArray,
    context_tokens: int = 0,
    prefill_tokens: int = 0,
) -> FloatArray:
    """Feature rows of steps whose requests verify their own γ_i ≤ the drafted cap (the
    goodput policy's per-request mode), a row per entry of ``verified`` (Σγ_i): the
    drafter runs ``draft_passes`` (per row) over the batch, the target verifies B + Σγ_i
    tokens, and the extra query tokens re-read the KV ``attention_gamma`` times
    (γ̄ = Σ context_i·γ_i / Σ context_i).
    With every γ_i = γ a row is step_features(B, γ)'s: the regression needs no new feature,
    only these two sums in place of B·γ and γ."""
    x = verify_shape(batch_size, draft_passes, verified, prefill_tokens)
    return with_attention(x, attention_gamma, context_tokens)


def verify_shape(
    batch_size: int, draft_passes: FloatArray, verified: FloatArray, prefill_tokens: int = 0
) -> FloatArray:
    """verify_features' rows with the shape columns filled and the attention ones not
    (with_attention fills them): what does not depend on the requests' contexts."""
    x = np.empty((len(verified), FEATURES))
    _fill_shape(x, batch_size + verified + prefill_tokens, draft_passes, batch_size)
    return x


def with_attention(x: FloatArray, attention_gamma: FloatArray, context_tokens: int) -> FloatArray:
    """Fill the attention columns of verify_shape's rows ``x`` in place; ``x``."""
    context = context_tokens / CONTEXT_SCALE
    x[:, -2] = context
    x[:, -1] = context * attention_gamma
    return x


@functools.lru_cache(maxsize=512)
def _stacked_shape_features(
    batch_sizes: tuple[int, ...], gamma_top: int, prefill_tokens: int, min_draft_passes: int
) -> FloatArray:
    """``shape_features`` of each batch size, stacked: cached, because an engine's tables
    cover the same ranges of sizes again and again (a read-only array)."""
    shape = np.stack(
        [shape_features(b, gamma_top, prefill_tokens, min_draft_passes) for b in batch_sizes]
    )
    shape.flags.writeable = False
    return shape


def step_features(
    batch_size: int,
    gamma: int,
    prefill_tokens: int = 0,
    context_tokens: int = 0,
    draft_gamma: int | None = None,
    min_draft_passes: int = 0,
) -> FloatArray:
    """The regression features of one step (the row ``predict_ms_many`` evaluates for γ): the
    shape features, then attention, which reads the batch's KV once per query token.

    ``draft_gamma``: γ of the draft passes the step ran, when not ``gamma`` (the target
    verified one decision's drafts while the drafter proposed the next's; a decision runs
    both with its own γ, which is what ``predict_ms_many`` prices). ``min_draft_passes``: the
    passes the engine's drafter runs even at γ = 0 (StepContext.min_draft_passes). Without
    it a γ = 0 step on vLLM looks one draft pass cheaper than it is, and γ = 0 wins where
    it is behind (docs/POLICIES.md, "Step time is one smooth function")."""
    drafted = max(gamma if draft_gamma is None else draft_gamma, min_draft_passes)
    tokens = batch_size * (gamma + 1) + prefill_tokens
    context = context_tokens / CONTEXT_SCALE
    return np.array(
        [
            1.0,
            tokens / TOKEN_SCALE,
            *(max(0.0, tokens - knot) / TOKEN_SCALE for knot in TOKEN_KNOTS),
            drafted,
            drafted * batch_size / 64.0,
            context,
            context * gamma,
        ]
    )


def predict_ms_many(
    weights: FloatArray,
    batch_sizes: Sequence[int],
    gamma_top: int,
    prefill_tokens: int = 0,
    context_tokens: int = 0,
    min_draft_passes: int = 0,
) -> FloatArray:
    """Step milliseconds for γ = 0..gamma_top under ``weights``, one row per batch size
    (cached shape features, one stacked product, the two context terms). Every row equals
    the one its size alone gives (numpy's stacked product computes each row's as the
    product of that row alone; a reshaped 2-D product would not), so a decision does not
    depend on how many sizes were asked with it (a table prices 17;
    tests/policy_server/policies/test_goodput_candidates.py)."""
    shape = _stacked_shape_features(tuple(batch_sizes), gamma_top, prefill_tokens, min_draft_passes)
    context = context_tokens / CONTEXT_SCALE
    ms: FloatArray = shape @ weights[:SHAPE_FEATURES]
    # Attention re-reads the KV once per verified query token: γ, not the draft passes
    # (step_features' last column), so one row per size broadcast down the rows.
    ms += context * (weights[-2] + weights[-1] * _gammas(gamma_top))
    return ms


@functools.lru_cache(maxsize=64)
def _gammas(gamma_top: int) -> FloatArray:
    """γ = 0..gamma_top as floats (a read-only array)."""
    gammas = np.arange(gamma_top + 1, dtype=np.float64)
    gammas.flags.writeable = False
    return gammas


@dataclasses.dataclass(slots=True)
class AcceptanceModel:
    """Per-token acceptance α from forgotten counts of accepted (S) and rejected (F) drafts.

    A request that drafted γ and accepted k contributes k successes and one failure when
    k < γ: the MLE of a truncated geometric is S / (S + F). When the engine reports only
    batch totals the failures are estimated from the current α (one EM step per outcome).
    """

    successes: float
    failures: float
    # Forgetting per observed step: counts are multiplied by it before each update.
    decay: float
    # The product of the decays applied since the fleet's evidence was folded in: what it
    # is worth now (fleet_stats.py; not state: reset to 1 wherever it is marked or loaded).
    forgotten: float = 1.0

    @classmethod
    def with_prior(cls, alpha: float, weight: float, decay: float) -> AcceptanceModel:
        return cls(alpha * weight, (1.0 - alpha) * weight, decay)

    @property
    def alpha(self) -> float:
        total = self.successes + self.failures
        return self.successes / total if total > 0 else 0.5

    @property
    def weight(self) -> float:
        return self.successes + self.failures

    def observe(
        self,
        gamma: int,
        drafted: int,
        accepted: int,
        request_accepts: Sequence[int] = (),
        verified: Sequence[int] = (),
    ) -> None:
        """``verified``: the γ each entry of ``request_accepts`` verified where requests
        verified their own (() = ``gamma`` each): a request that accepted all of a shorter
        γ_i was not rejected."""
        if gamma <= 0 or drafted <= 0:
            return
        self.successes *= self.decay
        self.failures *= self.decay
        self.forgotten *= self.decay
        if request_accepts:
            self.successes += sum(request_accepts)
            if verified:
                # Failures (k < γ_i) counted in C (map): every request of a step passes here.
                if len(verified) != len(request_accepts):
                    raise ValueError("verified needs one γ per entry of request_accepts")
                self.failures += sum(map(operator.lt, request_accepts, verified))
            else:  # a generator: a map over a partial counted no fewer instructions here
                self.failures += sum(1 for k in request_accepts if k < gamma)
            return
        requests = drafted / gamma
        self.successes += accepted
        self.failures += requests * (1.0 - self.alpha**gamma)

    def sample(self, normal: float) -> float:
        """α from the posterior's normal approximation, given a standard normal draw."""
        alpha = self.alpha
        spread = math.sqrt(alpha * (1.0 - alpha) / (self.weight + 2.0))
        return min(0.995, max(0.0, alpha + spread * normal))

    def to_json(self) -> dict[str, float]:
        return {"successes": self.successes, "failures": self.failures}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], decay: float) -> AcceptanceModel:
        model = cls(float(data["successes"]), float(data["failures"]), decay)
        if not (math.isfinite(model.weight) and model.successes >= 0 and model.failures >= 0):
            raise ValueError("acceptance counts must be finite and >= 0")
        return model


@dataclasses.dataclass(slots=True)
class Fit:
    """A solved regression: the weights and the Cholesky factor of their posterior
    covariance σ²(A + ρI)⁻¹ (what Thompson sampling draws with). The factor is computed on
    the first draw: most decisions draw none (the exploration cap prices a draw only where
    the point estimate has a near-tie)."""

    weights: FloatArray
    _factor: FloatArray | None = None
    # Until then, what it is factored from: A + ρI, σ² and the eigenvalue floor.
    _unfactored: tuple[FloatArray, float, float] | None = None

    @property
    def factor(self) -> FloatArray:
        if self._factor is None:
            assert self._unfactored is not None
            self._factor = _posterior_root(*self._unfactored)
            self._unfactored = None
        return self._factor

    def sample(self, normals: FloatArray) -> FloatArray:
        """Weights drawn from the posterior, given standard normals."""
        drawn: FloatArray = self.weights + self.factor @ normals
        return drawn


def _posterior_root(regularized: FloatArray, noise_variance: float, floor: float) -> FloatArray:
    """The Cholesky factor of σ²·(A + ρI)⁻¹, or where that is too ill-conditioned, the
    square root its eigendecomposition gives."""
    try:
        covariance = np.linalg.inv(regularized)
        root = cast(FloatArray, np.linalg.cholesky(noise_variance * covariance))
    except np.linalg.LinAlgError:
        root = _eigen_posterior(regularized, floor, noise_variance)[1]
    return root


def _eigen_posterior(
    regularized: FloatArray, floor: float, noise_variance: float
) -> tuple[FloatArray, FloatArray]:
    """The covariance (A + ρI)⁻¹ and a square root of σ² times it, from the eigenvectors of
    the symmetric A + ρI (eigenvalues >= ρ, floored at ``floor``): for matrices too
    ill-conditioned for inv or Cholesky (steps with huge token counts, found by fuzzing)."""
    values, vectors = np.linalg.eigh(regularized)
    inverse = 1.0 / np.maximum(values, floor)
    covariance = (vectors * inverse) @ vectors.T
    return covariance, vectors * np.sqrt(noise_variance * inverse)


class StepTimeModel:
    """Step wall time (ms) as a weighted ridge regression with exponential forgetting.

    Keeps the forgotten weighted normal equations (A = Σ λ^{n−i} w_i x_i x_iᵀ,
    b = Σ λ^{n−i} w_i x_i y_i). Step-time noise grows with the step (a 10-second prefill
    step is off by a second where a 60 ms decode step is off by a few ms), so each step
    weighs w = 1/y, the weight of a noise variance proportional to the step's time.
    Unweighted, the long steps' residuals set σ² and every posterior draw swung by hundreds
    of milliseconds, which kept Thompson sampling trying long γ at large batches after the
    decode steps had settled them; weighting by 1/y² (relative error) let the many short
    steps bend the fit there (docs/POLICIES.md, "Step time is one smooth function"). The
    ridge ρ keeps the covariance bounded in directions the recent steps did not excite
    (plain RLS with forgetting winds up there); it is scaled by the mean weight, so that it
    shrinks alike whatever the engine's step times. The weighted residual variance σ² is
    tracked with the same forgetting. A decision uses the fit of at most
    ``refit_every`` observations ago (a solve costs tens of microseconds; the weights move
    little in a few steps), or of ``refit_ms`` of observed step time ago, or of the last
    surprising one (a residual beyond 3σ: the batch moved where the fit had no data). The
    fit in use is part of the state, so a restored policy decides exactly as the original.
    """

    def __init__(
        self, decay: float, ridge: float, refit_every: int = 8, refit_ms: float = REFIT_MS
    ) -> None:
        self.decay = decay
        self.ridge = ridge
        self.refit_every = refit_every
        self.refit_ms = refit_ms
        self.gram = np.zeros((FEATURES, FEATURES))
        self.moment = np.zeros(FEATURES)
        # Forgotten count, sum of weights, sum of weighted squared residuals (against the
        # fit in use).
        self.count = 0.0
        self.weight_sum = 0.0
        self.squared_error = 0.0
        self._fit: Fit | None = None
        # Observations since that fit, and their summed step time.
        self._stale = 0
        self._stale_ms = 0.0
        # Decays since the fleet's evidence was folded in (AcceptanceModel.forgotten).
        self.forgotten = 1.0

    def observe(self, x: FloatArray, milliseconds: float) -> None:
        """Add one step: ``x`` its feature row, ``milliseconds`` its wall time."""
        weight = 1.0 / max(milliseconds, 1e-3)
        self._stale += 1
        self._stale_ms += milliseconds
        if self.refit_ms > 0 and self._stale_ms >= self.refit_ms:
            self._stale = self.refit_every
        if self._fit is not None:
            residual = milliseconds - float(self._fit.weights @ x)
            squared = weight * residual * residual
            if self.count >= 3.0 and squared > 9.0 * self.noise_variance:
                self._stale = self.refit_every
            self.squared_error = self.decay * self.squared_error + squared
        self.gram *= self.decay
        self.forgotten *= self.decay
        outer = x[:, None] * x  # np.outer's product, without its argument handling
        outer *= weight
        self.gram += outer
        self.moment *= self.decay
        self.moment += weight * milliseconds * x
        self.count = self.decay * self.count + 1.0
        self.weight_sum = self.decay * self.weight_sum + weight

    def fit(self) -> Fit:
        """The fit decisions use: refreshed after ``refit_every`` new observations."""
        if self._fit is None or self._stale >= self.refit_every:
            self._fit = self.solve()
            self._stale = 0
            self._stale_ms = 0.0
        return self._fit

    def solve(self) -> Fit:
        """A fit of every observation so far (changes nothing: views and tests use it)."""
        mean_weight = self.weight_sum / self.count if self.count > 0 else 1.0
        regularized = self.gram.copy()
        regularized.flat[:: FEATURES + 1] += self.ridge * mean_weight  # A + ρI
        floor = max(self.ridge * mean_weight, 1e-300)
        try:
            # The weights alone: the covariance is only needed for a draw's factor, which
            # most refits never make (a solve costs a third less than inverting).
            weights = cast(FloatArray, np.linalg.solve(regularized, self.moment))
        except np.linalg.LinAlgError:
            covariance, root = _eigen_posterior(regularized, floor, self.noise_variance)
            return Fit(covariance @ self.moment, root)
        return Fit(weights, _unfactored=(regularized, self.noise_variance, floor))

    @property
    def mean_ms(self) -> float:
        """Forgotten mean of the observed step times, weighted as the fit weighs them (the
        intercept feature is 1)."""
        return float(self.moment[0] / self.gram[0, 0]) if self.gram[0, 0] > 0 else 0.0

    @property
    def noise_variance(self) -> float:
        if self.count < 3.0:
            return 1.0
        return max(self.squared_error / self.count, 1e-6)

    def to_json(self) -> dict[str, Any]:
        fit = None
        if self._fit is not None:
            fit = {
                "weights": self._fit.weights.tolist(),
                "factor": self._fit.factor.tolist(),
                "stale": self._stale,
                "stale_ms": self._stale_ms,
            }
        return {
            "gram": self.gram.tolist(),
            "moment": self.moment.tolist(),
            "count": self.count,
            "weight_sum": self.weight_sum,
            "squared_error": self.squared_error,
            "fit": fit,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], decay: float, ridge: float) -> StepTimeModel:
        model = cls(decay, ridge)
        model.gram = _finite_array(data["gram"], (FEATURES, FEATURES), "gram")
        model.moment = _finite_array(data["moment"], (FEATURES,), "moment")
        model.count = float(data["count"])
        model.weight_sum = float(data["weight_sum"])
        model.squared_error = float(data["squared_error"])
        counters = (model.count, model.weight_sum, model.squared_error)
        if not all(math.isfinite(c) and c >= 0 for c in counters):
            raise ValueError("step-time model counters must be finite and >= 0")
        fit = data.get("fit")
        if fit is not None:
            model._fit = Fit(
                _finite_array(fit["weights"], (FEATURES,), "weights"),
                _finite_array(fit["factor"], (FEATURES, FEATURES), "factor"),
            )
            model._stale = int(fit["stale"])
            # Absent from states written before the time bound: counted from the restore.
            model._stale_ms = float(fit.get("stale_ms", 0.0))
            if not (math.isfinite(model._stale_ms) and model._stale_ms >= 0):
                raise ValueError("step-time model: fit.stale_ms must be finite and >= 0")
        return model


# Octaves a state may name: batch sizes below 2^65.
MAX_OCTAVE = 64


def batch_octave(batch_size: int) -> int:
    """The cell of a batch size in ``LocalCorrection``: 1, 2–3, 4–7, 8–15, …"""
    return max(batch_size, 1).bit_length() - 1


@dataclasses.dataclass(frozen=True, slots=True)
class BatchRows:
    """The batch sizes one decision prices, a row each, with what the correction needs of
    them (its offsets are per octave): each row's octave, the first size of each octave
    present, and the runs of consecutive rows of one octave as (position of the octave
    among the firsts, the run's slice of rows) — one run per octave for a table's range."""

    sizes: tuple[int, ...]
    octaves: tuple[int, ...]
    firsts: tuple[int, ...]
    runs: tuple[tuple[int, slice], ...]


@functools.lru_cache(maxsize=1024)
def batch_rows(sizes: tuple[int, ...]) -> BatchRows:
    """The rows of ``sizes``: cached, because an engine's tables cover the same ranges."""
    octaves = tuple(batch_octave(b) for b in sizes)
    firsts: dict[int, int] = {}
    for size, octave in zip(sizes, octaves, strict=True):
        firsts.setdefault(octave, size)
    position = {octave: i for i, octave in enumerate(firsts)}
    runs: list[tuple[int, slice]] = []
    start = 0
    for row in range(1, len(octaves) + 1):
        if row == len(octaves) or octaves[row] != octaves[start]:
            runs.append((position[octaves[start]], slice(start, row)))
            start = row
    return BatchRows(sizes, octaves, tuple(firsts.values()), tuple(runs))


class LocalCorrection:
    """What the pooled step-time regression gets wrong where the engine actually runs.

    The regression shares a few features across every batch size: that is what lets each
    step inform every (B, γ), and what lets it extrapolate to a batch size it has not seen.
    A real engine's curve has shapes those features cannot express, enough to rank two γ at
    one batch size the wrong way round (docs/POLICIES.md, "Where the engine runs, its own
    residuals"). Per (batch-size octave, γ) this keeps forgotten sums of decode steps' times
    y and feature rows x, so the cell's mean residual under any weights w is
    (Σy − w·Σx) / (n + k): exact for the fit in use (no stale residuals while the fit
    moves), for a Thompson draw of w as well, and shrunk toward 0 by k pseudo-steps where
    the cell has few steps. Cells never run add nothing: there the regression extrapolates
    alone.
    """

    def __init__(self, decay: float, prior_steps: float, gamma_max: int) -> None:
        self.decay = decay
        self.prior_steps = prior_steps
        self.gamma_max = gamma_max
        # Octave → rows γ = 0..Γmax of [n, Σy, Σx...], forgotten on each row's own updates
        # (a block per octave: a decision reads its row set in one product).
        self.blocks: dict[int, FloatArray] = {}
        # Octave → its γ never run, as last asked for (every table asks): a cell once run
        # stays run (its count is scaled only by its own updates, which add 1 each).
        self._unrun: dict[int, tuple[int, ...]] = {}
        # Octave → per γ, the decays of the cell since the fleet's evidence was folded in
        # (AcceptanceModel.forgotten); a cell absent or never updated since: 1.
        self.forgotten: dict[int, FloatArray] = {}

    def observe(self, batch_size: int, gamma: int, x: FloatArray, milliseconds: float) -> None:
        if not 0 <= gamma <= self.gamma_max:
            return
        octave = batch_octave(batch_size)
        block = self.blocks.get(octave)
        if block is None:
            block = self.blocks[octave] = np.zeros((self.gamma_max + 1, 2 + FEATURES))
        row = block[gamma]
        if row[0] == 0.0:  # the cell's first run
            self._unrun.pop(octave, None)
        forgotten = self.forgotten.get(octave)
        if forgotten is None:
            forgotten = self.forgotten[octave] = np.ones(self.gamma_max + 1)
        forgotten[gamma] *= self.decay
        row *= self.decay
        row[0] += 1.0
        row[1] += milliseconds
        row[2:] += x

    def unrun(self, octave: int, gamma_top: int) -> tuple[int, ...]:
        """The γ in 0..gamma_top no decode step of ``octave`` has run at (as forgotten)."""
        unrun = self._unrun.get(octave)
        if unrun is None:
            block = self.blocks.get(octave)
            counts = [0.0] * (self.gamma_max + 1) if block is None else block[:, 0].tolist()
            unrun = self._unrun[octave] = tuple(g for g, n in enumerate(counts) if n == 0)
        if gamma_top >= self.gamma_max:
            return unrun
        return tuple(g for g in unrun if g <= gamma_top)

    def misfit(self, weights: FloatArray, batch_size: int) -> float:
        """How far the regression under ``weights`` is off the decode steps run in this
        batch size's octave: the largest |Σy − w·Σx| / w·Σx over its cells (0 if none ran)."""
        block = self.blocks.get(batch_octave(batch_size))
        if block is None:
            return 0.0
        rows = block[block[:, 0] > 0]
        if not len(rows):
            return 0.0
        total = rows[:, 1]
        predicted = rows[:, 2:] @ weights
        # A prediction near zero or below is as wrong as it gets: bounded at 10x.
        return float(np.max(np.abs(total - predicted) / np.maximum(predicted, 0.1 * total)))

    def offsets_ms(
        self,
        weights: FloatArray,
        batch_size: int,
        gamma_top: int,
        noise_variance: float = 0.0,
        normals: FloatArray | None = None,
        unrun_line: bool = False,
    ) -> FloatArray:
        """Milliseconds to add to the regression's prediction for γ = 0..gamma_top. With
        ``normals``, a draw from the mean's posterior: the regression's residual variance
        is relative (σ²·y, see StepTimeModel), so the mean of n steps near ȳ has variance
        σ²·ȳ / (n + k). ``unrun_line``: a cell never run takes the line in γ through the
        run cells' offsets (``_unrun_line``) instead of nothing."""
        octave = batch_octave(batch_size)
        block = self.blocks.get(octave)
        if block is None:
            return np.zeros(gamma_top + 1)
        # The line reads every run cell of the octave, also those above gamma_top.
        rows = block if unrun_line else block[: gamma_top + 1]
        count, total = rows[:, 0], rows[:, 1]
        pseudo = count + self.prior_steps
        offsets: FloatArray = (total - rows[:, 2:] @ weights) / pseudo
        if unrun_line:
            self._unrun_line(octave, count, offsets)
            top = gamma_top + 1
            count, total, pseudo, offsets = count[:top], total[:top], pseudo[:top], offsets[:top]
        if normals is not None:
            mean_ms = total / np.maximum(count, 1e-12)  # 0 where the row never ran
            offsets += np.sqrt(noise_variance * mean_ms / pseudo) * normals[: gamma_top + 1]
        return offsets

    def _unrun_line(self, octave: int, count: FloatArray, offsets: FloatArray) -> None:
        """Fill, in place, the offsets (γ = 0..Γmax) of ``octave``'s cells never run from
        the count-weighted least-squares line in γ through its run cells' offsets, where
        two or more cells ran. Why: the pooled regression's cost per γ can be off within
        one octave (one batch size whose steps cost the same at any γ bends the slope the
        others share), and the run cells' residuals then slope with γ; an unrun cell
        priced at the bare regression sits off that slope, where neither the draws nor the
        trials (the best γ and its neighbours only) reach it (docs/POLICIES.md, "Served
        saturation")."""
        unrun = self.unrun(octave, self.gamma_max)
        ran = np.flatnonzero(count > 0)
        if not unrun or len(ran) < 2:
            return
        weight, run = count[ran], offsets[ran]
        centre = float(weight @ ran) / float(weight.sum())
        mean = float(weight @ run) / float(weight.sum())
        spread = ran - centre
        slope = float(weight @ (spread * (run - mean))) / float(weight @ (spread * spread))
        offsets[list(unrun)] = mean + slope * (np.asarray(unrun) - centre)

    def to_json(self) -> list[list[float]]:
        """One row per (octave, γ) that ran: [octave, γ, n, Σy, Σx...]."""
        return [
            [octave, gamma, *row.tolist()]
            for octave, block in sorted(self.blocks.items())
            for gamma, row in enumerate(block)
            if row[0] > 0
        ]

    @classmethod
    def from_json(
        cls, data: Any, decay: float, prior_steps: float, gamma_max: int
    ) -> LocalCorrection:
        model = cls(decay, prior_steps, gamma_max)
        for entry in data:
            octave, gamma = int(entry[0]), int(entry[1])
            row = _finite_array(entry[2:], (2 + FEATURES,), "correction row")
            valid = 0 <= octave <= MAX_OCTAVE and 0 <= gamma <= gamma_max
            if not (valid and row[0] >= 0 and row[1] >= 0):
                raise ValueError(
                    f"correction rows need octave in 0..{MAX_OCTAVE}, γ in 0..{gamma_max}, "
                    "counts >= 0"
                )
            block = model.blocks.setdefault(octave, np.zeros((gamma_max + 1, 2 + FEATURES)))
            block[gamma] = row
        return model


def _finite_array(data: Any, shape: tuple[int, ...], name: str) -> FloatArray:
    array = np.asarray(data, dtype=np.float64)
    if array.shape != shape or not np.isfinite(array).all():
        raise ValueError(f"step-time model: {name} must be finite with shape {shape}")
    return array
