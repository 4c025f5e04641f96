"""The batch-size table: γ by batch size, in the shape of vLLM's dynamic-SD schedule
(``num_speculative_tokens_per_batch_size = [[start_bs, end_bs, K], ...]``).

One lookup serves the sidecar's ``table`` policy and the client's fail-open fallback, so
an engine whose sidecar is down runs exactly what ``table`` would have answered.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from nightjar_common.types import StepContext

# γ falling as the batch grows, as for a draft about 4× cheaper than its target: a safe
# default where nothing is known, which speculates too little for a cheaper draft and too
# much for a dearer one (docs/POLICIES.md, "Warm start").
DEFAULT_SCHEDULE: tuple[tuple[int, int, int], ...] = ((1, 8, 3), (9, 24, 1), (25, 1 << 20, 0))
# More rows than any real schedule; bounds what a client can make the server hold.
MAX_SCHEDULE_ROWS = 1024
# Batch sizes up to this are looked up in a dense array; rows beyond it are scanned.
DENSE_LIMIT = 4096

Row = tuple[int, int, int]


class ScheduleError(ValueError):
    """A schedule that is not a list of disjoint [start_bs, end_bs, gamma] rows."""


def check_schedule(schedule: Sequence[Sequence[int]], default_gamma: int) -> list[Row]:
    """The schedule's rows, sorted; :class:`ScheduleError` naming the first bad row."""
    if len(schedule) > MAX_SCHEDULE_ROWS:
        raise ScheduleError(f"schedule has {len(schedule)} rows, more than {MAX_SCHEDULE_ROWS}")
    rows: list[Row] = []
    for row in schedule:
        if (
            not isinstance(row, list | tuple)
            or len(row) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in row)
        ):
            raise ScheduleError(f"schedule rows must be [start_bs, end_bs, gamma], got {row!r}")
        start, end, gamma = row
        if start < 1 or end < start:
            raise ScheduleError(f"schedule row {row}: need 1 <= start_bs <= end_bs")
        if not 0 <= gamma <= 64:
            raise ScheduleError(f"schedule row {row}: gamma must be in 0..64")
        rows.append((start, end, gamma))
    rows.sort()
    for (_, prev_end, _), (start, _, _) in itertools.pairwise(rows):
        if start <= prev_end:
            raise ScheduleError(f"schedule ranges overlap at batch size {start}")
    if not 0 <= default_gamma <= 64:
        raise ScheduleError(f"default_gamma must be in 0..64, got {default_gamma}")
    return rows


class BatchSizeTable:
    """γ by batch size; ``default_gamma`` where no row covers it."""

    def __init__(self, schedule: Sequence[Sequence[int]], default_gamma: int = 0) -> None:
        self.rows = check_schedule(schedule, default_gamma)
        self.default_gamma = default_gamma
        dense_limit = min(DENSE_LIMIT, max((end for _, end, _ in self.rows), default=0))
        self._dense = [self._scan(b) for b in range(dense_limit + 1)]

    @property
    def gamma_max(self) -> int:
        return max([g for _, _, g in self.rows] + [self.default_gamma])

    def gamma_for(self, batch_size: int) -> int:
        if 0 <= batch_size < len(self._dense):
            return self._dense[batch_size]
        return self._scan(batch_size)

    def gamma_for_step(self, ctx: StepContext) -> int:
        """The table's γ for a step, within what the engine can run (0 while the draft is
        not resident, at most its ``max_gamma``)."""
        if not ctx.draft_resident:
            return 0
        gamma = self.gamma_for(ctx.batch_size)
        return min(gamma, ctx.max_gamma) if ctx.max_gamma > 0 else gamma

    def _scan(self, batch_size: int) -> int:
        for start, end, gamma in self.rows:
            if start <= batch_size <= end:
                return gamma
        return self.default_gamma
