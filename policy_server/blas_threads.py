"""NumPy's BLAS held to one thread in the sidecar.

NumPy's OpenBLAS keeps a pool of one thread per core and splits a matrix product across
it once the product is large enough, as a per-request plan's is (thousands of requests
by a few features). Between products its threads spin on their cores, waiting for the
next: cores a node's engines need, and the cores that run the sidecar's own event loop
and the engines' clients. The sidecar's products are small; one thread does each without
the hand-off. docs/BENCHMARKS.md ("Isolation") has what the pool cost other engines.
"""

from __future__ import annotations

# Imported for its BLAS: a limit reaches only the libraries already loaded.
import numpy  # noqa: F401
from threadpoolctl import threadpool_info, threadpool_limits

BLAS_THREADS = 1


def limit_blas_threads(threads: int = BLAS_THREADS) -> list[str]:
    """Hold every BLAS library loaded in this process to ``threads`` threads; each
    library's name and the threads it had, for the log."""
    before = [info for info in threadpool_info() if info["user_api"] == "blas"]
    threadpool_limits(limits=threads, user_api="blas")
    return [f"{info['internal_api']} {info['num_threads']}" for info in before]
