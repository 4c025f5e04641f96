"""`make bench-instructions`' arithmetic and report (the count itself needs valgrind and
minutes: the target runs it)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks import step_instructions
from benchmarks.rpc_report import TableWalk
from benchmarks.step_instructions import (
    HookRow,
    ThreadCounts,
    collected,
    main,
    part_totals,
    per_step,
    render,
    render_hooks,
    thread_totals,
    walk_steps,
)

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
    rows = [
        (8, TableWalk.BATCH, 412_345.6),
        (32, TableWalk.BATCH, 187_654.3),
        (32, TableWalk.NAMED, 320_000.4),
        (32, TableWalk.PER_REQUEST, 501_000.0),
    ]
    text = render(rows, "v")
    assert "`make bench-instructions`" in text and "v's callgrind" in text
    assert "| 8 steps | 412,346 |" in text and "| 32 steps | 187,654 |" in text
    assert "| 32 steps, every request named, the per-request mode off | 320,000 |" in text
    assert (
        "| 32 steps, every request named, the per-request mode (the same walk) | 501,000 |" in text
    )
    # The mode's own work: its row less the same walk's with the mode off.
    assert "own work: 181,000 instructions a step" in text
    assert "own work" not in render(rows[:2], "v")


def test_the_counted_process_walks_the_table_case() -> None:
    assert main(["--walk", "300", "--refreshes", "32"]) == 0


def test_the_counted_process_walks_the_kind_of_walk_it_is_told(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    walked = []
    real = step_instructions.measure_tables

    def measure(samples: int, warm: int, refresh: int, kind: TableWalk, alone: bool) -> Any:
        walked.append((kind, alone))
        return real(samples, warm, refresh, kind, alone)

    monkeypatch.setattr(step_instructions, "measure_tables", measure)
    for kind in ("PER_REQUEST", "NAMED"):
        assert main(["--walk", "300", "--refreshes", "32", "--kind", kind]) == 0
    assert main(["--walk", "300", "--refreshes", "32"]) == 0
    assert main(["--walk", "300", "--refreshes", "32", "--kind", "NAMED", "--inputs-only"]) == 0
    assert walked == [
        (TableWalk.PER_REQUEST, False),
        (TableWalk.NAMED, False),
        (TableWalk.BATCH, False),
        (TableWalk.NAMED, True),
    ]


def _callgrind_part(directory: Path, thread: int, total: int) -> Path:
    path = directory / f"callgrind.out-{thread:02d}"
    path.write_text(f"version: 1\npart: 1\nthread: {thread}\nsummary: {total}\ntotals: {total}\n")
    return path


def test_the_hooks_count_is_the_main_threads_and_the_rest_is_the_other_threads(
    tmp_path: Path,
) -> None:
    parts = [_callgrind_part(tmp_path, t, n) for t, n in ((1, 900), (2, 70), (3, 30))]
    assert thread_totals(parts) == ThreadCounts(900, 100)
    with pytest.raises(RuntimeError, match="main thread"):
        thread_totals(parts[1:])


def test_the_hooks_section_shows_each_revision_and_the_change_from_the_first() -> None:
    rows = [HookRow("abc1234", 60_000.4, 9_000.0, 2, 1), HookRow("this tree", 39_000.0, 11.0, 0, 0)]
    text = "\n".join(render_hooks(rows))
    assert "| abc1234 | 60,000 | 9,000 | 2 / 1 |" in text
    assert "| this tree | 39,000 | 11 | 0 / 0 |" in text
    assert "60,000 → 39,000 instructions a step (35% fewer than at abc1234)" in text
    assert "fewer" not in "\n".join(render_hooks(rows[1:]))
    assert "### The plugin's hook" in render([(32, TableWalk.BATCH, 1.0)], "v", rows)


def test_the_counted_hook_process_steps_the_controller_against_a_sidecar(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks.rpc import sidecar

    monkeypatch.setattr(step_instructions, "HOOK_WARM", 5)
    with sidecar("uds") as target:
        assert main(["--hook", "40", "--target", target]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report) == {"table_misses", "fallbacks"}
    assert 0 <= report["fallbacks"] <= report["table_misses"] <= 40


def _dumped_part(directory: Path, part: int, total: int) -> Path:
    path = directory / f"callgrind.out.{part}"
    path.write_text(f"version: 1\npart: {part}\nsummary: {total}\ntotals: {total}\n")
    return path


def test_the_walks_parts_are_read_in_the_order_callgrind_dumped_them(tmp_path: Path) -> None:
    files = [_dumped_part(tmp_path, p, n) for p, n in ((10, 5), (2, 300), (1, 40))]
    (tmp_path / "callgrind.out.x").write_text("version: 1\n")  # no count: not a part
    assert part_totals(sorted(tmp_path.iterdir())) == [40, 300, 5]
    assert part_totals(files[:1]) == [5]


def test_each_batch_sizes_step_is_its_long_walks_extra_count_over_the_extra_steps() -> None:
    steps = step_instructions.WALK_LONG - step_instructions.WALK_SHORT
    # The switch's part, then short and long walks per size, then the exit's part.
    parts = [999, 1_000, 1_000 + 300 * steps, 2_000, 2_000 + 600 * steps, 10**9]
    assert walk_steps(parts, (32, 64)) == ((32, 300.0), (64, 600.0))
    with pytest.raises(RuntimeError, match="parts"):
        walk_steps(parts[:4], (32, 64))


def test_the_walks_table_adds_the_controllers_count_at_its_batch() -> None:
    walks = ((32, 150_000.0), (64, 300_000.0))
    rows = [HookRow("abc1234", 60_000.0, 9_000.0, 0, 0, walks), HookRow("x", 1.0, 1.0, 0, 0)]
    text = "\n".join(render_hooks(rows))
    assert "| code | walks, batch 32 | walks, batch 64 | hook and walks, batch 32 |" in text
    assert "| abc1234 | 150,000 | 300,000 | 210,000 |" in text
    assert "| x |" not in text.split("#### The scheduler's per-request walks")[1]
    assert "#### The scheduler" not in "\n".join(render_hooks(rows[1:]))


def test_the_walks_count_where_vllm_and_their_driver_are(tmp_path: Path) -> None:
    assert not step_instructions.walks_counted(tmp_path)  # a revision without the driver
    if importlib.util.find_spec("vllm") is not None:
        assert step_instructions.walks_counted(Path(step_instructions.__file__).parents[1])


def test_the_walks_alone_are_counted_at_the_baseline_first_then_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trees: list[tuple[Path, bool]] = []

    def count(tree: Path) -> tuple[tuple[int, float], ...]:
        trees.append((tree, (tree / "Makefile").exists()))
        return ((32, 1_000.0 * len(trees)),)

    monkeypatch.setattr(step_instructions, "count_walks", count)
    assert step_instructions.walks_lines("HEAD") == [
        "HEAD, batch 32: 1,000",
        "this tree, batch 32: 2,000",
    ]
    (baseline, extracted), (here, _) = trees
    assert extracted and baseline != Path.cwd() and here == Path.cwd()
    assert step_instructions.walks_lines(None) == ["this tree, batch 32: 3,000"]


def test_a_walks_step_is_counted_less_its_own_building_of_contexts_and_outcomes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = {  # (steps, inputs only) -> the process's count
        (step_instructions.SHORT, False): 9_000_000,
        (step_instructions.LONG, False): 13_000_000,
        (step_instructions.SHORT, True): 5_000_000,
        (step_instructions.LONG, True): 6_000_000,
    }

    def count(steps: int, refresh: int, kind: TableWalk, inputs_only: bool = False) -> int:
        return counts[(steps, inputs_only)]

    monkeypatch.setattr(step_instructions, "count", count)
    steps = step_instructions.LONG - step_instructions.SHORT
    assert step_instructions.walk_step(32, TableWalk.NAMED) == 3_000_000 / steps


def test_the_walks_own_building_asks_no_client_or_sidecar(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from benchmarks import rpc
    from policy_server.sim.sources import TableSource

    def refuse(*args: Any) -> None:
        raise AssertionError("the walk's own building asked the protocol")

    monkeypatch.setattr(TableSource, "decide", refuse)
    monkeypatch.setattr(TableSource, "report", refuse)
    rpc.measure_tables(50, 10, 32, TableWalk.PER_REQUEST, inputs_only=True)
    with pytest.raises(AssertionError, match="asked the protocol"):
        rpc.measure_tables(50, 10, 32, TableWalk.PER_REQUEST)
