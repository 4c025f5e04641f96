"""Durable state (issue 14 part 5), with real processes: a snapshot writer SIGKILLed at
random moments leaves the old or the new complete snapshot, which a fresh server restores
(removing the killed writers' temporary files); a state directory that cannot be written,
or a disk that fills during a write, is logged and counted and stops no decision."""

from __future__ import annotations

from pathlib import Path

from benchmarks.durability import disk_fills_mid_write, kill_loop, state_dir_is_a_file


def test_sigkill_during_snapshot_writes_leaves_the_old_or_the_new_snapshot(
    tmp_path: Path,
) -> None:
    result = kill_loop(tmp_path, iterations=8, engines=60)
    assert result.bad == []
    assert result.old + result.new == result.kills == 8
    assert result.writes_journaled >= 8
    assert result.restored_identical
    assert result.leftovers_after_start == 0


def test_a_state_directory_that_is_a_file_fails_snapshots_not_decisions(tmp_path: Path) -> None:
    result = state_dir_is_a_file(tmp_path, decisions=100)
    assert result.snapshot_code == "FAILED_PRECONDITION"
    assert result.failures_counted >= 2  # the RPC's and the periodic ones
    assert result.last_success_unchanged and result.logged
    assert result.decisions_during == 100 and result.serving
    assert result.passed


def test_a_disk_full_during_a_write_keeps_the_previous_snapshot(tmp_path: Path) -> None:
    result = disk_fills_mid_write(tmp_path)
    assert result.snapshot_code == "FAILED_PRECONDITION"
    assert result.previous_intact and result.temp_files_left == 0
    assert result.failures_counted >= 1 and result.last_success_unchanged
    assert result.logged and result.serving and result.decisions_during > 0
    assert result.passed
