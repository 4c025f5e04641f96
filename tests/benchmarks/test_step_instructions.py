"""`make bench-instructions`' arithmetic and report (the count itself needs valgrind and
minutes: the target runs it)."""

from __future__ import annotations

import pytest

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
    text = render([(8, 412_345.6), (32, 187_654.3)], "valgrind-3.19.0")
    assert "`make bench-instructions`" in text and "valgrind-3.19.0" in text
    assert "| 8 steps | 412,346 |" in text and "| 32 steps | 187,654 |" in text


def test_the_counted_process_walks_the_table_case() -> None:
    assert main(["--walk", "300", "--refreshes", "32"]) == 0
