"""The goodput policy's per-sequence mode: per-request acceptance and a γ per request.

With ``per_request`` on (goodput.py), each engine keeps forgotten counts of the drafts
each recent request accepted and had rejected (``RequestRecord``), labelled by
StepOutcome.request_ids. A request's α is those counts shrunk to the learner's pooled α
by ``prior_weight`` pseudo-tokens (a Beta prior centred on the pooled estimate), so a
young request follows the pooled estimate and an old one its own.

The plan of a step (``best_plan``): the drafter runs the cap γ over the batch and request
i verifies its own γ_i ≤ γ. The k-th draft of request i adds α_i^k expected tokens,
decreasing in k, so for a cap and a number S of verified drafts the most tokens come from
the S largest α_i^k with k ≤ cap (a prefix of each request's chain). The step time depends
on the plan only through the cap and two sums, S and Σ context_i·γ_i (models.
verify_features), so every (cap, S) is priced in one product and the plan with the best
predicted goodput Σ E(α_i, γ_i) / t wins: O(Γ²·B) per decision.

Pure numpy; nothing of engines or the wire.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
import numpy.typing as npt

from policy_server.policies.models import FloatArray, verify_shape, with_attention

# Requests an engine keeps records of, whatever the idle bound: a client cannot make the
# server hold an unbounded number (as dsde).
MAX_REQUESTS = 4096
# What a record costs at most (its dict entry, RequestRecord and a request id of the
# longest length the sidecar accepts, 256): MAX_REQUESTS of them are ~1.9 MB an engine.
RECORD_BYTES = 200 + 256

IntArray = npt.NDArray[np.intp]


@dataclasses.dataclass(frozen=True, eq=False)
class PlanRows:
    """The rows a plan search prices for ``batch`` requests and caps up to ``top``: cap
    c = 0..top, each with S = 0..B·c verified drafts, by cap, then S (read-only arrays).
    Shared by every search of the same batch size and top (``plan_rows``), and by what is
    cached of their features (``plan_features``)."""

    batch: int
    top: int
    caps: IntArray
    verified: FloatArray

    @functools.cached_property
    def uniform(self) -> IntArray:
        """Each cap's last row: every request verifying the cap (a batch γ)."""
        ends: IntArray = np.flatnonzero(np.diff(self.caps, append=self.top + 1))
        return ends


# (the rows' caps and Σγ_i, the rows' γ̄) → predicted step ms per row, switch cost included.
PlanPricer = Callable[[PlanRows, FloatArray], FloatArray]


# Searches cached: an engine's batch size moves by a request or two a step, so the sizes
# around it recur, over as wide a range as a busy engine's batch sweeps (a hundred sizes
# and more); a size's rows grow as B·top² (its features 14 floats each), so the bytes
# below bound the large ones.
PLAN_ROWS_CACHED = 128
# Bytes the cached searches may hold together (rows and their shape features): at B≈4,000
# and Γmax 16 one search's are ~70 MB, so a count alone held gigabytes. One larger than
# this is computed for its decision and not kept.
PLAN_CACHE_BYTES = 128 << 20

K = TypeVar("K")
V = TypeVar("V")


class _PlanCache(Generic[K, V]):
    """Least recently used entries within PLAN_ROWS_CACHED entries and PLAN_CACHE_BYTES
    (an entry's ``nbytes``); thread-safe (engines decide on several threads)."""

    def __init__(self, nbytes: Callable[[V], int]) -> None:
        self._nbytes = nbytes
        self._entries: collections.OrderedDict[K, tuple[V, int]] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.held = 0

    def get(self, key: K, make: Callable[[], V]) -> V:
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                return found[0]
        value = make()
        size = self._nbytes(value)
        if size > PLAN_CACHE_BYTES:
            return value
        with self._lock:
            if key not in self._entries:
                self._entries[key] = (value, size)
                self.held += size
            while len(self._entries) > PLAN_ROWS_CACHED or self.held > PLAN_CACHE_BYTES:
                self.held -= self._entries.popitem(last=False)[1][1]
        return value


_ROWS: _PlanCache[tuple[int, int], PlanRows] = _PlanCache(
    lambda rows: rows.caps.nbytes + rows.verified.nbytes
)
_SHAPES: _PlanCache[tuple[int, int, int], FloatArray] = _PlanCache(lambda shape: shape.nbytes)


def plan_cache_bytes() -> int:
    """Bytes the cached plan searches hold (nightjar_bytes_held{structure="plan_cache"})."""
    return _ROWS.held + _SHAPES.held


def plan_rows(batch: int, top: int) -> PlanRows:
    return _ROWS.get((batch, top), lambda: _plan_rows(batch, top))


def _plan_rows(batch: int, top: int) -> PlanRows:
    sizes = 1 + batch * np.arange(top + 1, dtype=np.intp)
    caps = np.repeat(np.arange(top + 1, dtype=np.intp), sizes)
    verified = (np.arange(caps.size) - (np.cumsum(sizes) - sizes)[caps]).astype(np.float64)
    caps.flags.writeable = verified.flags.writeable = False
    return PlanRows(batch, top, caps, verified)


def plan_features(
    rows: PlanRows, min_draft_passes: int, attention: FloatArray, context_tokens: int
) -> FloatArray:
    """models.verify_features of ``rows`` (bit for bit), the drafter running the cap or
    ``min_draft_passes``, whichever is more: the shape columns are cached per rows."""
    shape = _shape_features(rows, min_draft_passes).copy()
    return with_attention(shape, attention, context_tokens)


def _shape_features(rows: PlanRows, min_draft_passes: int) -> FloatArray:
    key = (rows.batch, rows.top, min_draft_passes)
    return _SHAPES.get(key, lambda: _make_shape_features(rows, min_draft_passes))


def _make_shape_features(rows: PlanRows, min_draft_passes: int) -> FloatArray:
    passes = np.maximum(rows.caps, min_draft_passes).astype(np.float64)
    shape = verify_shape(rows.batch, passes, rows.verified)
    shape.flags.writeable = False
    return shape


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """One request's forgotten accepted (successes) and rejected (failures) drafts."""

    successes: float
    failures: float
    # The engine's observed-step count when the request was last in a step.
    last_seen: int


@dataclasses.dataclass(frozen=True, slots=True)
class Plan:
    """A step's γ per request (in the context's order) under ``cap``, and its predicted
    goodput (tokens per ms) under the estimate it was searched with, beside the best
    batch γ's (every request verifying one cap) under the same estimate."""

    cap: int
    gammas: tuple[int, ...]
    goodput: float
    batch_goodput: float

    @property
    def uniform(self) -> bool:
        """Whether every request verifies the cap (a plain batch γ)."""
        return all(g == self.cap for g in self.gammas)


def shrunk_alpha(record: RequestRecord | None, pooled: float, prior_weight: float) -> float:
    """A request's α: its counts with ``prior_weight`` pseudo-tokens at the pooled α."""
    if record is None:
        return pooled
    weight = record.successes + record.failures + prior_weight
    return (record.successes + prior_weight * pooled) / weight


def observe_requests(
    records: dict[str, RequestRecord],
    outcomes: Iterable[tuple[str, int, int]],
    decay: float,
    step: int,
) -> None:
    """Add (request id, accepted, γ it verified) outcomes: k successes, one failure when
    k < γ (the truncated geometric's MLE, as the pooled model counts), forgotten by
    ``decay`` per observation of that request. Each record observed moves to the end:
    ``records`` stay in the order last seen (what ``prune`` relies on)."""
    for request_id, accepted, gamma in outcomes:
        record = records.pop(request_id, None)
        if record is None:
            record = RequestRecord(0.0, 0.0, step)
        record.successes = decay * record.successes + accepted
        record.failures = decay * record.failures + (1.0 if accepted < gamma else 0.0)
        record.last_seen = step
        records[request_id] = record


def touch(records: dict[str, RequestRecord], request_ids: Iterable[str], step: int) -> None:
    """Mark requests of a step as seen (one that verified no draft is still running),
    moved to the end as ``observe_requests`` moves them; one seen at ``step`` already (its
    outcome observed) stays where it is."""
    for request_id in request_ids:
        record = records.get(request_id)
        if record is not None and record.last_seen != step:
            del records[request_id]
            record.last_seen = step
            records[request_id] = record


def prune(records: dict[str, RequestRecord], step: int, idle_steps: int) -> None:
    """Drop, in place, the records not seen in the last ``idle_steps`` steps (finished
    requests leave), and the least recently seen beyond MAX_REQUESTS. Records are in the
    order last seen, so those are the first ones: a step's pruning costs what it drops,
    not what the engine holds."""
    dropped: list[str] = []
    excess = len(records) - MAX_REQUESTS
    for request_id, record in records.items():
        if len(dropped) >= excess and step - record.last_seen <= idle_steps:
            break
        dropped.append(request_id)
    for request_id in dropped:
        del records[request_id]


def best_plan(
    alphas: Sequence[float], contexts: Sequence[int], top: int, price: PlanPricer
) -> Plan:
    """The plan (cap ≤ ``top``, γ_i ≤ cap) of the best predicted goodput; ties go to the
    smaller cap and the fewer verified drafts."""
    batch = len(alphas)
    top = top if batch else 0
    gains = _gains(alphas, top)
    # Flattened (request, depth - 1) by decreasing gain; stable, so ties keep the order.
    order = np.argsort(-gains, axis=None, kind="stable")
    requests, depths = np.divmod(order, max(top, 1))
    # Row c of ``kept``: a column for S = 0, then the drafts cap c allows (depth ≤ c).
    kept = np.ones((top + 1, order.size + 1), dtype=bool)
    np.less(depths, np.arange(top + 1)[:, None], out=kept[:, 1:])
    # A draft's gain and its request's context as one complex number: a complex sum adds
    # the two parts apart, so one running sum makes both.
    drafts = np.zeros(order.size + 1, dtype=np.complex128)
    drafts.real[1:] = gains.ravel()[order]
    drafts.imag[1:] = np.asarray(contexts, dtype=np.float64)[requests]
    # Running sums along each row, a dropped draft adding 0 (which leaves a sum as it is):
    # each cap's sums over its S largest gains, bit for bit as summed cap by cap. The kept
    # cells, read row-major, come by cap, then by S (what the tie order needs).
    sums = np.cumsum(np.where(kept, drafts, 0.0), axis=1)[kept]
    rows = plan_rows(batch, top)
    total_context = float(sum(contexts))
    attention = sums.imag / total_context if total_context > 0 else rows.verified / max(batch, 1)
    goodput = (batch + sums.real) / price(rows, attention)
    row = int(goodput.argmax())
    cap = int(rows.caps[row])
    counts = np.bincount(requests[kept[cap, 1:]][: int(rows.verified[row])], minlength=batch)
    # A cap's last row verifies all its drafts: the batch γ of that cap.
    batch_goodput = float(goodput[rows.uniform].max())
    return Plan(cap, tuple(counts.tolist()), float(goodput[row]), batch_goodput)


def batch_tokens(alphas: Sequence[float], top: int) -> list[float]:
    """Per γ = 0..``top``, the expected tokens (accepted drafts + bonus) per request of a
    batch γ over requests of these α: the mean of their truncated geometrics."""
    mean_gains = _gains(alphas, top).mean(axis=0)
    tokens: list[float] = (1.0 + np.concatenate(([0.0], np.cumsum(mean_gains)))).tolist()
    return tokens


def _gains(alphas: Sequence[float], top: int) -> FloatArray:
    """α_i^k for k = 1..top: what the k-th draft of request i adds (a row per request)."""
    gains: FloatArray = np.asarray(alphas, dtype=np.float64)[:, None] ** np.arange(1, top + 1)
    return gains


def records_to_json(records: Mapping[str, RequestRecord]) -> dict[str, list[float]]:
    return {rid: [r.successes, r.failures, r.last_seen] for rid, r in records.items()}


def trim_records(engines: Mapping[str, Any], excess_bytes: int) -> int:
    """Drop, in place, from engines' parts of a state as written (``requests`` of
    records_to_json, ``observed_steps``), the records seen least recently (in steps of
    their engine) until their JSON adds up to ``excess_bytes``; how many were dropped.
    A request that comes back starts from the pooled acceptance, as a new one does."""
    aged: list[tuple[int, str, str, int]] = []
    for engine_id, engine in engines.items():
        now = engine.get("observed_steps", 0)
        for request_id, record in engine.get("requests", {}).items():
            # "<id>":[s,f,n] and a comma, as compact JSON writes it.
            size = len(json.dumps(request_id)) + len(json.dumps(record, separators=(",", ":")))
            aged.append((now - record[2], engine_id, request_id, size + 2))
    aged.sort(key=lambda item: item[0], reverse=True)
    dropped = saved = 0
    for _, engine_id, request_id, size in aged:
        if saved >= excess_bytes:
            break
        del engines[engine_id]["requests"][request_id]
        dropped, saved = dropped + 1, saved + size
    return dropped


def records_from_json(data: Any, observed_steps: int) -> dict[str, RequestRecord]:
    """Records of a state, checked: counts finite and >= 0, seen no later than now; in
    the order last seen (``prune``'s)."""
    records: list[tuple[str, RequestRecord]] = []
    for rid, (successes, failures, last_seen) in list(dict(data).items())[:MAX_REQUESTS]:
        record = RequestRecord(float(successes), float(failures), int(last_seen))
        counts = (record.successes, record.failures)
        if not all(math.isfinite(c) and c >= 0 for c in counts):
            raise ValueError("request counts must be finite and >= 0")
        if not 0 <= record.last_seen <= observed_steps:
            raise ValueError(f"a request's last step must be in 0..{observed_steps}")
        records.append((str(rid), record))
    return dict(sorted(records, key=lambda item: item[1].last_seen))
