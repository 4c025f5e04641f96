"""c_prefill(L_max, B): the switching cost of re-enabling speculation, from a profiled table.

When γ goes from 0 to > 0 the draft model must first process every token it
missed (its KV cache is stale). The Nightjar paper measures T_SD − T_base
prefill time over a grid of lag lengths × batch sizes (its Table 3) and looks
it up; we load such a grid from a CSV file and interpolate bilinearly,
clamping outside the grid.

File format (CSV with header): ``lag_tokens,batch_size,c_prefill_ms`` — one row
per grid point; every (lag, batch) combination of the grid must be present.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
from dataclasses import dataclass
from pathlib import Path

from nightjar_common.files import read_regular_file

REQUIRED_COLUMNS = ("lag_tokens", "batch_size", "c_prefill_ms")
# A profiled grid is a few hundred rows; far larger is no table of ours.
MAX_BYTES = 16 << 20


class PrefillCostError(ValueError):
    """The c_prefill table file is missing, malformed or not a full grid."""


@dataclass(frozen=True, slots=True)
class PrefillCostTable:
    lags: tuple[float, ...]
    batch_sizes: tuple[float, ...]
    # seconds[i][k] = c_prefill at lags[i], batch_sizes[k]
    seconds: tuple[tuple[float, ...], ...]

    @classmethod
    def from_csv(cls, path: str | Path) -> PrefillCostTable:
        path = Path(path)
        try:
            # A parameter a client may set names it: one reader with Restore's guards.
            text = read_regular_file(path, MAX_BYTES).decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise PrefillCostError(f"cannot read c_prefill table {path}: {exc}") from exc
        try:
            with io.StringIO(text, newline="") as fh:
                reader = csv.DictReader(fh)
                missing = [c for c in REQUIRED_COLUMNS if c not in (reader.fieldnames or [])]
                if missing:
                    raise PrefillCostError(f"{path}: missing column(s) {missing}")
                points: dict[tuple[float, float], float] = {}
                for line, row in enumerate(reader, start=2):
                    try:
                        lag, bs, ms = (float(row[c]) for c in REQUIRED_COLUMNS)
                    except (TypeError, ValueError) as exc:
                        raise PrefillCostError(f"{path}:{line}: not a number ({exc})") from exc
                    if not all(map(math.isfinite, (lag, bs, ms))) or lag < 0 or bs < 1 or ms < 0:
                        raise PrefillCostError(f"{path}:{line}: values out of range")
                    points[(lag, bs)] = ms / 1000.0
        except csv.Error as exc:
            raise PrefillCostError(f"{path}: not a CSV table ({exc})") from exc
        if not points:
            raise PrefillCostError(f"{path}: no rows")
        lags = tuple(sorted({lag for lag, _ in points}))
        sizes = tuple(sorted({bs for _, bs in points}))
        try:
            grid = tuple(tuple(points[(lag, bs)] for bs in sizes) for lag in lags)
        except KeyError as exc:
            raise PrefillCostError(f"{path}: grid point {exc.args[0]} missing") from exc
        return cls(lags, sizes, grid)

    def seconds_at(self, lag_tokens: float, batch_size: float) -> float:
        """Bilinear interpolation of the cost (seconds), clamped to the grid's edges."""
        i0, i1, wi = _bracket(self.lags, lag_tokens)
        k0, k1, wk = _bracket(self.batch_sizes, batch_size)
        g = self.seconds
        low = g[i0][k0] * (1 - wk) + g[i0][k1] * wk
        high = g[i1][k0] * (1 - wk) + g[i1][k1] * wk
        return low * (1 - wi) + high * wi


def _bracket(axis: tuple[float, ...], x: float) -> tuple[int, int, float]:
    """Indices around x on a sorted axis and x's weight toward the upper one."""
    if x <= axis[0]:
        return 0, 0, 0.0
    if x >= axis[-1]:
        last = len(axis) - 1
        return last, last, 0.0
    hi = bisect.bisect_right(axis, x)
    lo = hi - 1
    return lo, hi, (x - axis[lo]) / (axis[hi] - axis[lo])
