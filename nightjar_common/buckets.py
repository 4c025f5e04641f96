"""Histogram buckets that more than one process exports, so their series aggregate."""

# γ values, as decided (sidecar) or run (plugin): exact up to 4, coarser above.
GAMMA_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)
