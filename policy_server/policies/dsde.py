"""DSDE: a speculation length per sequence from the stability of draft/target disagreement,
capped per batch.

After DSDE (Yang et al., "DSDE: Dynamic Speculative Decoding with KLD Stability for
Real-World Serving", arXiv:2509.01083), section III:

- a calibration phase (the engine's first ``calibration_steps`` steps, run at the largest
  feasible γ) gives SL_max = SL_A,max · (1 + μ_KLD,pre / (KLD_pre,max + ε)) (eq. 1), with
  SL_A,max the most tokens any request accepted in one step (here over every step since,
  as the paper calibrates each generation);
- per sequence, the weighted variance of its recent KL divergences (weights δ^{i−1},
  δ = 0.85, i = 1 the latest; eqs. 5–7) over a short window (10 steps) against a long one
  (30): WVIR = Var_w(short) / Var_w(long) (eq. 4); SF = exp(2 · μ_KLD,last) − 1 (eq. 3);
  ŜL = (1 − SF · WVIR) · (SL_max − SL_min) + SL_min, or SL_min when SF · WVIR > 1
  (eqs. 2, 8), SL_min = 2;
- the batch cap SL_cap = the mean of the batch's ŜL (eqs. 9–11): the drafter runs to it,
  and each request verifies min(ŜL_i, SL_cap).

Deviations (docs/POLICIES.md, "dsde"): lengths are rounded to whole tokens and bounded by
the engine's feasible γ (so SL_min is min(2, that)); calibration is per engine, not per
generation; where the engine sends no KL divergence for a request
(``RequestSignals.kl_divergence`` None), its disagreement is the proxy 1 / (1 + a), a the
tokens it accepted at its last verification; where it sends no per-request signals at all,
the batch is one sequence whose signal is the mean proxy of the step's requests. Nothing
here is learned across engines: the state is per engine (and per request).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

from nightjar_common.types import BinType, Choice, RequestSignals, StepContext, StepOutcome
from policy_server.policies.base import (
    CheckpointedDecide,
    MalformedStateError,
    ParamsPolicy,
    PolicyError,
    StatePerEngine,
    count_limit,
    feasible_gamma_max,
    parse_params,
)

STATE_SCHEMA = "dsde/1"
EPSILON = 1e-6
# Per-request histories an engine keeps (requests of its latest steps): bounded, so that
# a client cannot make the server hold an unbounded number.
MAX_REQUESTS = 4096
# The most tokens one request may have accepted in a step (a step's token counts are
# checked against 2^31).
MAX_ACCEPTED = 1 << 31


@dataclasses.dataclass(frozen=True, slots=True)
class DsdeParams:
    gamma_max: int = 7
    # SL_min: the least speculation length a sequence is given (the paper's 2).
    sl_min: int = 2
    short_window: int = 10
    long_window: int = 30
    # δ of the weights δ^{i-1} (i = 1: the latest step).
    decay: float = 0.85
    calibration_steps: int = 10

    def __post_init__(self) -> None:
        if not 1 <= self.gamma_max <= 64:
            raise PolicyError("gamma_max must be in 1..64")
        if not 0 <= self.sl_min <= self.gamma_max:
            raise PolicyError("sl_min must be in 0..gamma_max")
        if not 2 <= self.short_window <= self.long_window <= 1024:
            raise PolicyError("windows must satisfy 2 <= short_window <= long_window <= 1024")
        if not 0 < self.decay <= 1:
            raise PolicyError("decay must be in (0, 1]")
        if not 0 <= self.calibration_steps <= 100_000:
            raise PolicyError("calibration_steps must be in 0..100000")


@dataclasses.dataclass(slots=True)
class Calibration:
    """Eq. 1's statistics of an engine's first steps."""

    steps: int = 0
    max_accepted: int = 0
    disagreement_sum: float = 0.0
    disagreement_count: int = 0
    disagreement_max: float = 0.0

    def sl_max(self) -> float:
        mean = self.disagreement_sum / self.disagreement_count if self.disagreement_count else 0.0
        return self.max_accepted * (1.0 + mean / (self.disagreement_max + EPSILON))


@dataclasses.dataclass(slots=True)
class EngineRecord:
    calibration: Calibration
    # The batch as one sequence (engines that send no per-request signals).
    batch: collections.deque[float]
    requests: dict[str, collections.deque[float]]


class DsdePolicy(ParamsPolicy[DsdeParams], CheckpointedDecide, StatePerEngine):
    """decide() changes nothing (histories grow in observe): checkpoints are empty."""

    name: ClassVar[str] = "dsde"
    state_schema: ClassVar[str] = STATE_SCHEMA
    # Reads StepContext.requests and StepOutcome.request_accepts (the simulator builds
    # them only for policies that say so).
    reads_request_signals: ClassVar[bool] = True

    def __init__(self, params: Mapping[str, Any] | None = None) -> None:
        self._params = parse_params(DsdeParams, params, self.name)
        self._engines: dict[str, EngineRecord] = {}

    # -- Policy protocol -------------------------------------------------------------

    def decide(self, ctx: StepContext) -> Choice:
        top = feasible_gamma_max(ctx, self.gamma_max)
        if top == 0:
            return Choice(gamma=0, bin_type=BinType.FORCED)
        engine = self._engines.get(ctx.engine_id)
        if engine is None or engine.calibration.steps < self._params.calibration_steps:
            return Choice(gamma=top, bin_type=BinType.EXPLORE)  # calibrating at full length
        sl_max = min(float(top), engine.calibration.sl_max())
        if not ctx.requests:
            gamma = self._length(engine.batch, (), sl_max, top)
            return Choice(gamma=gamma, bin_type=BinType.EXPLOIT)
        lengths = [
            self._length(engine.requests.get(r.request_id, ()), (disagreement(r),), sl_max, top)
            for r in ctx.requests
        ]
        cap = min(top, round(sum(lengths) / len(lengths)))
        return Choice(
            gamma=cap,
            bin_type=BinType.EXPLOIT,
            request_gammas=tuple(
                (r.request_id, min(length, cap))
                for r, length in zip(ctx.requests, lengths, strict=True)
            ),
        )

    def observe(self, ctx: StepContext, choice: Choice, outcome: StepOutcome) -> None:
        p = self._params
        engine = self._engines.get(ctx.engine_id)
        if engine is None:
            engine = self._engines[ctx.engine_id] = EngineRecord(
                Calibration(), collections.deque(maxlen=p.long_window), {}
            )
        signals = [disagreement(r) for r in ctx.requests]
        if outcome.request_accepts:
            batch_signal = sum(1.0 / (1.0 + a) for a in outcome.request_accepts) / len(
                outcome.request_accepts
            )
            engine.batch.append(batch_signal)
        calibration = engine.calibration
        if calibration.steps < p.calibration_steps:
            calibration.steps += 1
        # Eq. 1's statistics from every step, not the first few alone: the paper calibrates
        # each generation, and an engine's first steps (often one request, which may accept
        # nothing) would otherwise fix SL_max for its whole life (docs/POLICIES.md, "dsde").
        calibration.max_accepted = max(calibration.max_accepted, *outcome.request_accepts, 0)
        seen = signals or list(engine.batch)[-1:]
        calibration.disagreement_sum += sum(seen)
        calibration.disagreement_count += len(seen)
        calibration.disagreement_max = max(calibration.disagreement_max, *seen, 0.0)
        if not ctx.requests:
            return
        # The requests of this step keep their histories; others are dropped (finished).
        kept: dict[str, collections.deque[float]] = {}
        for request, signal in zip(ctx.requests[:MAX_REQUESTS], signals, strict=False):
            history = engine.requests.get(request.request_id)
            if history is None:
                history = collections.deque(maxlen=p.long_window)
            history.append(signal)
            kept[request.request_id] = history
        engine.requests = kept

    # -- LearnedState protocol ---------------------------------------------------------

    def checkpoint(self, ctx: StepContext) -> object:
        return None  # decide() changes nothing

    def restore(self, ctx: StepContext, saved: object) -> None:
        return None

    def state(self, engine_id: str | None = None) -> dict[str, Any]:
        if engine_id is None:
            shown = self._engines
        else:  # found directly (UNOWNED finds none: the state is per engine)
            record = self._engines.get(engine_id)
            shown = {} if record is None else {engine_id: record}
        return {
            "schema": STATE_SCHEMA,
            "engines": {
                eid: {
                    "calibration": dataclasses.asdict(e.calibration),
                    "batch": list(e.batch),
                    "requests": {rid: list(h) for rid, h in e.requests.items()},
                }
                for eid, e in shown.items()
            },
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("schema") != STATE_SCHEMA:
            raise PolicyError(f"state schema {state.get('schema')!r} is not {STATE_SCHEMA}")
        window = self._params.long_window
        try:
            engines = {
                str(eid): EngineRecord(
                    _calibration_from_json(e["calibration"]),
                    _history(e["batch"], window),
                    {
                        str(rid): _history(h, window)
                        for rid, h in list(dict(e["requests"]).items())[:MAX_REQUESTS]
                    },
                )
                for eid, e in dict(state["engines"]).items()
            }
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise MalformedStateError(f"malformed dsde state: {exc!r}") from exc
        self._engines = engines  # only once all of it is checked

    def reset(self, engine_id: str | None = None) -> None:
        if engine_id is None:
            self._engines.clear()
        else:
            self._engines.pop(engine_id, None)

    # -- internals ----------------------------------------------------------------------

    def _length(
        self, history: Iterable[float], latest: Sequence[float], sl_max: float, top: int
    ) -> int:
        """ŜL (eq. 8) of a sequence whose disagreement so far is ``history`` and whose
        last verification's is ``latest`` (empty: the newest of the history), in whole
        tokens within 0..top."""
        p = self._params
        values = [*history, *latest][-p.long_window :]
        sl_min = min(p.sl_min, top)
        if not values:
            return max(sl_min, min(top, round(sl_max)))  # nothing seen: the longest
        scale = math.exp(2.0 * values[-1]) - 1.0
        long_variance = weighted_variance(values, p.decay)
        short_variance = weighted_variance(values[-p.short_window :], p.decay)
        # Both windows constant (0/0): their volatility is as alike as it can be, WVIR = 1.
        # With the proxy a request that rejects every draft sends 1.0 each step; 0 here gave
        # it the longest length (docs/POLICIES.md, "dsde").
        ratio = short_variance / long_variance if long_variance > 0 else 1.0
        penalty = scale * ratio
        if penalty > 1.0:
            return sl_min
        length = (1.0 - penalty) * (max(sl_max, sl_min) - sl_min) + sl_min
        return max(sl_min, min(top, round(length)))


def disagreement(request: RequestSignals) -> float:
    """μ_KLD,last of a request: the KL divergence its engine measured at its last
    verification, or the proxy 1 / (1 + accepted tokens) where none was measured."""
    if request.kl_divergence is not None:
        return request.kl_divergence
    accepted = request.recent_accepts[-1] if request.recent_accepts else 0
    return 1.0 / (1.0 + accepted)


def weighted_variance(values: Sequence[float], decay: float) -> float:
    """Eqs. 5–7: the variance of ``values`` (oldest first) with weights decay^{i−1}, i = 1
    the newest."""
    weights = _weights(len(values), decay)
    total = sum(weights)
    mean = sum(w * v for w, v in zip(weights, values, strict=True)) / total
    return sum(w * (v - mean) ** 2 for w, v in zip(weights, values, strict=True)) / total


@functools.lru_cache(maxsize=256)
def _weights(count: int, decay: float) -> tuple[float, ...]:
    """decay^{i−1} for i = count … 1, oldest first: the same few windows every step."""
    return tuple(decay**i for i in range(count - 1, -1, -1))


def _history(values: Any, window: int) -> collections.deque[float]:
    if not isinstance(values, list):
        raise TypeError(f"a disagreement history must be a list, got {values!r}")
    history = collections.deque((float(v) for v in values), maxlen=window)
    if not all(math.isfinite(v) and v >= 0 for v in history):
        raise ValueError("disagreements must be finite and >= 0")
    return history


def _calibration_from_json(data: Mapping[str, Any]) -> Calibration:
    calibration = Calibration(
        steps=int(data["steps"]),
        max_accepted=int(data["max_accepted"]),
        disagreement_sum=float(data["disagreement_sum"]),
        disagreement_count=int(data["disagreement_count"]),
        disagreement_max=float(data["disagreement_max"]),
    )
    numbers = (calibration.disagreement_sum, calibration.disagreement_max)
    counts = (calibration.steps, calibration.disagreement_count)
    if not all(0 <= c <= count_limit() for c in counts):
        raise ValueError(f"calibration counts must be in 0..{count_limit()}")
    # SL_A,max: tokens one request accepted in one step, at most a step's tokens (2^31,
    # what outcomes are checked against); beyond, SL_max would overflow a float.
    if not 0 <= calibration.max_accepted <= MAX_ACCEPTED:
        raise ValueError(f"max_accepted must be in 0..{MAX_ACCEPTED}")
    if not all(math.isfinite(x) and x >= 0 for x in numbers):
        raise ValueError("calibration sums must be finite and >= 0")
    return calibration
