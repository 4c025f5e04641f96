"""Request arrivals: real traces (Azure LLM conv format, generic CSV/JSONL) and synthetic
Poisson/gamma processes with piecewise rate schedules."""

from __future__ import annotations

import csv
import dataclasses
import datetime
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True, slots=True)
class RequestSpec:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


class TraceError(ValueError):
    """A trace file that cannot be read as requests."""


def _parse_time(text: str) -> float:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    # Azure traces: "2023-11-16 18:15:46.6805900" (7 fractional digits, no zone).
    head, _, frac = text.partition(".")
    stamp = datetime.datetime.strptime(head, "%Y-%m-%d %H:%M:%S")
    return stamp.replace(tzinfo=datetime.UTC).timestamp() + (float(f"0.{frac}") if frac else 0.0)


def _normalise(rows: Iterable[tuple[float, int, int]], origin: str) -> list[RequestSpec]:
    specs = sorted(rows)
    if not specs:
        raise TraceError(f"{origin}: no requests")
    start = specs[0][0]
    out = []
    for t, prompt, output in specs:
        if prompt < 1 or output < 1:
            raise TraceError(f"{origin}: token counts must be >= 1 (got {prompt}, {output})")
        out.append(RequestSpec(t - start, prompt, output))
    return out


# Column names accepted for (time, prompt tokens, output tokens), first match wins.
TIME_COLUMNS = ("TIMESTAMP", "timestamp", "arrival_time", "time")
PROMPT_COLUMNS = ("ContextTokens", "input_tokens", "prompt_tokens", "input_len")
OUTPUT_COLUMNS = ("GeneratedTokens", "output_tokens", "completion_tokens", "output_len")


def _pick(record: dict[str, object], names: Sequence[str], origin: str) -> object:
    for name in names:
        if name in record:
            return record[name]
    raise TraceError(f"{origin}: none of the columns {list(names)} present")


def read_trace(path: str | Path) -> list[RequestSpec]:
    """Read an Azure-format or generic CSV, or a JSONL trace; arrivals start at 0 s."""
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    try:
        with path.open(newline="") as fh:
            if path.suffix in (".jsonl", ".json"):
                records: Iterable[dict[str, object]] = (json.loads(ln) for ln in fh if ln.strip())
            else:
                records = csv.DictReader(fh)
            for number, record in enumerate(records, start=1):
                origin = f"{path}:{number}"
                try:
                    rows.append(
                        (
                            _parse_time(str(_pick(record, TIME_COLUMNS, origin))),
                            int(str(_pick(record, PROMPT_COLUMNS, origin))),
                            int(str(_pick(record, OUTPUT_COLUMNS, origin))),
                        )
                    )
                except ValueError as exc:
                    if isinstance(exc, TraceError):
                        raise
                    raise TraceError(f"{origin}: {exc}") from exc
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from exc
    return _normalise(rows, str(path))


def scale_to_qps(specs: Sequence[RequestSpec], qps: float) -> list[RequestSpec]:
    """Compress or stretch arrival times so the trace's mean rate is `qps`."""
    span = specs[-1].arrival_s - specs[0].arrival_s
    if span <= 0 or len(specs) < 2:
        return list(specs)
    factor = (len(specs) - 1) / (qps * span)
    return [dataclasses.replace(s, arrival_s=s.arrival_s * factor) for s in specs]


def window(specs: Sequence[RequestSpec], start_s: float, seconds: float) -> list[RequestSpec]:
    """The slice of a trace in [start, start + seconds), re-based to start at 0."""
    return [
        dataclasses.replace(s, arrival_s=s.arrival_s - start_s)
        for s in specs
        if start_s <= s.arrival_s < start_s + seconds
    ]


@dataclasses.dataclass(frozen=True, slots=True)
class RatePhase:
    seconds: float
    qps: float


def synthetic(
    phases: Sequence[RatePhase],
    lengths: Sequence[RequestSpec],
    seed: int,
    burstiness: float = 1.0,
) -> list[RequestSpec]:
    """Arrivals with a piecewise-constant rate: Poisson (burstiness 1) or gamma
    inter-arrivals (shape 1/burstiness, > 1 is burstier); lengths resampled from `lengths`."""
    rng = random.Random(seed)
    out: list[RequestSpec] = []
    t0 = 0.0
    for phase in phases:
        t = t0
        while phase.qps > 0:
            shape = 1.0 / burstiness
            t += rng.gammavariate(shape, 1.0 / (shape * phase.qps))
            if t >= t0 + phase.seconds:
                break
            pick = lengths[rng.randrange(len(lengths))]
            out.append(RequestSpec(t, pick.prompt_tokens, pick.output_tokens))
        t0 += phase.seconds
    return out


SCHEDULES = {
    "low": [RatePhase(120, 1.0)],
    "high": [RatePhase(120, 8.0)],
    "step": [RatePhase(60, 1.0), RatePhase(60, 8.0)],
    "burst": [RatePhase(40, 1.0), RatePhase(20, 12.0), RatePhase(60, 1.0)],
}
