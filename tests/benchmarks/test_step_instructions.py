"""`make bench-instructions`' arithmetic and report (the count itself needs valgrind and
minutes: the target runs it)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import step_instructions
from benchmarks.step_instructions import collected, main, per_step, render

CALLGRIND_LOG = """==24001== Events    : Ir
==24001== Collected : 2713510891
==24001==
==24001== I   refs:      2,713,510,891
"""


def test_the_count_is_read_from_callgrinds_summary_and_a_missing_one_is_an_error() -> None:
    assert collected(CALLGRIND_LOG) == 2_713_510_891
    with pytest.raises(RuntimeError, match="no instruction count"):
        collected("==1== valgrind: failed to start tool 'callgrind'\n")


def test_a_step_is_the_longer_walks_extra_count_over_its_extra_steps() -> None:
    assert per_step(1_000_000, 1_600_000, 2_000) == 300.0
    with pytest.raises(RuntimeError):  # a longer walk that counted less: a broken run
        per_step(1_600_000, 1_000_000, 2_000)


def test_the_report_names_its_target_and_every_period() -> None:
    text = render([(8, False, 412_345.6), (32, False, 187_654.3), (32, True, 501_000.0)], "v")
    assert "`make bench-instructions`" in text and "v's callgrind" in text
    assert "| 8 steps | 412,346 |" in text and "| 32 steps | 187,654 |" in text
    assert "| 32 steps, the per-request mode (every request named) | 501,000 |" in text


def test_the_counted_process_walks_the_table_case() -> None:
    assert main(["--walk", "300", "--refreshes", "32"]) == 0


def test_the_counted_process_walks_the_per_request_case_with_requests_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    walked = []
    real = step_instructions.measure_tables

    def measure(samples: int, warm: int, refresh: int, per_request: bool = False) -> Any:
        walked.append(per_request)
        return real(samples, warm, refresh, per_request)

    monkeypatch.setattr(step_instructions, "measure_tables", measure)
    assert main(["--walk", "300", "--refreshes", "32", "--per-request"]) == 0
    assert main(["--walk", "300", "--refreshes", "32"]) == 0
    assert walked == [True, False]
