"""NumPy's BLAS held to one thread in the sidecar (blas_threads.py)."""

from __future__ import annotations

import re
from typing import Any

from threadpoolctl import threadpool_info, threadpool_limits

from policy_server.blas_threads import limit_blas_threads


def blas_threads() -> list[int]:
    return [info["num_threads"] for info in threadpool_info() if info["user_api"] == "blas"]


def test_every_blas_pool_is_held_to_one_thread_and_what_it_had_is_reported() -> None:
    with threadpool_limits(limits=3, user_api="blas"):  # a pool of several, as on a node
        assert blas_threads(), "NumPy loads a BLAS library"
        assert set(blas_threads()) == {3}
        had = limit_blas_threads()
        assert set(blas_threads()) == {1}
    assert had and all(entry.endswith(" 3") for entry in had)


def test_the_started_sidecar_holds_its_blas_to_one_thread(make_server: Any) -> None:
    server = make_server()  # serving: its startup lines are logged
    line = re.search(r"BLAS held to (\d+) thread \(had: ([^)]*)\)", server.log())
    assert line is not None, server.log()
    assert line.group(1) == "1"
    # NumPy was loaded before the limit: a library was found and held, not "none loaded".
    assert re.fullmatch(r"(\w+ \d+)(, \w+ \d+)*", line.group(2)), line.group(2)
