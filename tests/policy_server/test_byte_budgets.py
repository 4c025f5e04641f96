"""Byte budgets of what the sidecar holds for clients (issue 54 item 3).

Each structure is filled past its budget and must refuse or evict, not grow: pending
decisions per engine and of all engines (their contexts), kept decision tables, what a
stream reads ahead, the per-request plan cache; decision ids past their length are
refused. The estimates are counts and lengths (engines.context_bytes), checked here
against the budgets they enforce and the gauge that shows them.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nightjar_proto.v1 import policy_pb2

from nightjar_common.errors import ConfigError
from nightjar_common.types import RanStep, RequestSignals, StepContext, StepOutcome
from nightjar_common.validation import MAX_DECISION_ID_LENGTH
from policy_server.config import ServerConfig
from policy_server.decision_log import DecisionLog
from policy_server.engines import Bounds, context_bytes
from policy_server.grpc_server import Received, _StreamInbox, received
from policy_server.policies import per_request
from policy_server.service import DecisionService

REQUESTS = 400


def context(engine_id: str, requests: int = REQUESTS, step: int = 0) -> StepContext:
    signals = tuple(
        RequestSignals(f"{engine_id}-{step}-{i}-".ljust(120, "x"), 900, (1, 2, 0, 3))
        for i in range(requests)
    )
    return StepContext(
        engine_id=engine_id,
        learner_key=f"m@{engine_id}",
        batch_size=max(requests, 8),
        step_index=step,
        requests=signals,
    )


def ran_step(service: DecisionService, ctx: StepContext) -> RanStep:
    table = service.table_step([], [], ctx).table
    assert table is not None
    return RanStep(
        f"{table.table_id}.1", ctx, table.gammas[ctx.batch_size - table.first_batch_size]
    )


def run_unreported(service: DecisionService, engine_id: str, steps: int) -> list[str]:
    """``steps`` steps run and never reported; the skipped reasons."""
    reasons = []
    for step in range(steps):
        result = service.table_step([ran_step(service, context(engine_id, step=step))], [], None)
        reasons.append(result.skipped_reason)
    return reasons


def sample(service: DecisionService, name: str, **labels: str) -> float:
    value = service.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_context_bytes_grow_with_requests_ids_and_accepts() -> None:
    small, large = context_bytes(context("e", 10)), context_bytes(context("e", 1000))
    assert large > 50 * small > 0
    wider = StepContext(
        engine_id="e", batch_size=1, requests=(RequestSignals("r" * 200, 1, (1,) * 200),)
    )
    narrow = StepContext(engine_id="e", batch_size=1, requests=(RequestSignals("r", 1, ()),))
    assert context_bytes(wider) > context_bytes(narrow) + 200 + 200 * 4


def test_an_engines_pending_contexts_stay_within_its_byte_budget() -> None:
    size = context_bytes(context("e"))
    budget = 3 * size + size // 2  # room for three contexts, not four
    service = DecisionService("goodput", bounds=Bounds(max_pending_bytes_per_engine=budget))
    assert run_unreported(service, "e", 10) == [""] * 10
    shard = service.engines.get("e")
    assert shard is not None
    assert len(shard.pending) == 3 and shard.pending_bytes <= budget
    assert service.engines.pending_bytes == shard.pending_bytes
    assert sample(service, "nightjar_evictions_total", kind="pending") == 7
    assert sample(service, "nightjar_bytes_held", structure="pending") == shard.pending_bytes
    # Reported, the held ones release their bytes.
    for decision_id, pending in list(shard.pending.items()):
        step = pending.ctx
        outcome = StepOutcome(decision_id, "e", 0, 0.01, step.batch_size, 0, 0)
        assert service.table_step([], [outcome], None).skipped == 0
    assert shard.pending_bytes == 0 == service.engines.pending_bytes


def test_a_context_larger_than_the_engines_budget_is_refused_naming_the_setting() -> None:
    size = context_bytes(context("e"))
    service = DecisionService("goodput", bounds=Bounds(max_pending_bytes_per_engine=size - 1))
    reason = run_unreported(service, "e", 1)[0]
    assert "max_pending_bytes_per_engine" in reason and "not learned from" in reason
    shard = service.engines.get("e")
    assert shard is not None and not shard.pending and shard.pending_bytes == 0
    assert sample(service, "nightjar_byte_budget_refusals_total", structure="pending") == 1
    assert sample(service, "nightjar_table_steps_total", result="refused") == 1


def test_all_engines_pending_contexts_stay_within_the_sidecars_budget() -> None:
    size = context_bytes(context("a"))
    budget = 4 * size + size // 2
    service = DecisionService("goodput", bounds=Bounds(max_pending_bytes=budget))
    run_unreported(service, "a", 3)
    run_unreported(service, "b", 1)
    assert service.engines.pending_bytes <= budget
    # A third engine finds room for no context: refused, the others' kept.
    reason = run_unreported(service, "c", 1)[0]
    assert "max_pending_bytes in the server's config file" in reason
    assert service.engines.pending_bytes <= budget
    # An engine holding some makes room by evicting its own oldest, not others'.
    assert run_unreported(service, "a", 2) == ["", ""]
    shard_b = service.engines.get("b")
    assert shard_b is not None and len(shard_b.pending) == 1
    assert service.engines.pending_bytes <= budget


def test_an_evicted_engines_bytes_are_released() -> None:
    service = DecisionService("goodput", bounds=Bounds(max_engines=1))
    run_unreported(service, "a", 2)
    assert service.engines.pending_bytes > 0 and service.engines.table_bytes > 0
    run_unreported(service, "b", 1)
    shard = service.engines.get("b")
    assert shard is not None and "a" not in service.engines
    assert service.engines.pending_bytes == shard.pending_bytes
    assert service.engines.table_bytes == shard.table_bytes


def test_decision_ids_past_their_length_are_refused() -> None:
    service = DecisionService("goodput")
    step = ran_step(service, context("e", 0))
    long_id = f"{step.table_id}.1" + "9" * (MAX_DECISION_ID_LENGTH + 1)
    result = service.table_step([RanStep(long_id, step.context, step.gamma)], [], None)
    assert result.malformed == 1 and "more than the 128" in result.skipped_reason
    outcome = StepOutcome(long_id, "e", 0, 0.01, 8, 0, 0)
    result = service.table_step([], [outcome], None)
    assert result.malformed == 1 and "more than the 128" in result.skipped_reason
    shard = service.engines.get("e")
    assert shard is not None and not shard.pending


def test_an_engines_kept_tables_stay_within_their_byte_budget() -> None:
    service = DecisionService("goodput", bounds=Bounds(max_table_bytes_per_engine=4096))
    for step in range(20):
        assert service.table_step([], [], context("e", 0, step)).table is not None
    shard = service.engines.get("e")
    assert shard is not None
    assert 1 <= len(shard.tables) < 20 and sum(shard.kept_sizes.values()) <= 4096
    assert len(shard.known_tables) == 20  # still remembered: their steps are learned from
    assert service.engines.table_bytes == shard.table_bytes
    assert sample(service, "nightjar_bytes_held", structure="tables") == shard.table_bytes


def test_a_stream_reads_ahead_no_more_than_its_byte_budget() -> None:
    pulled = 0
    full = 0
    request = received(
        policy_pb2.StepRequest(seq=1, ran_steps=[policy_pb2.RanStep(decision_id="x" * 100)])
    )

    async def sent() -> AsyncIterator[Received]:
        nonlocal pulled
        for _ in range(100):
            pulled += 1
            yield request

    def count() -> None:
        nonlocal full
        full += 1

    async def run() -> None:
        inbox = _StreamInbox(sent(), max_queue_bytes=3 * request.size, on_full=count)
        for _ in range(10):
            await asyncio.sleep(0)
        assert pulled == 3 and inbox.queued_bytes == 3 * request.size and full == 1
        await inbox.next()
        for _ in range(10):
            await asyncio.sleep(0)
        assert pulled == 4 and inbox.queued_bytes == 3 * request.size
        inbox.close()

    asyncio.run(run())


def test_the_plan_cache_holds_no_more_than_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    budget = 2 << 20
    monkeypatch.setattr(per_request, "PLAN_CACHE_BYTES", budget)
    cache = per_request._PlanCache[tuple[int, int], per_request.PlanRows](
        lambda rows: rows.caps.nbytes + rows.verified.nbytes
    )
    for batch in range(200, 260):
        cache.get((batch, 8), functools.partial(per_request._plan_rows, batch, 8))
    assert 0 < cache.held <= budget
    # One search larger than the whole budget is computed and not kept.
    held = cache.held
    big = cache.get((60_000, 8), lambda: per_request._plan_rows(60_000, 8))
    assert big.caps.nbytes > budget and cache.held == held
    assert per_request.plan_cache_bytes() >= 0


def test_the_plan_cache_keeps_every_size_a_busy_engine_moves_over() -> None:
    """A batch moving over 1..100 requests and back finds every search cached the
    second time (within the bytes, at a default Γmax)."""
    made: list[int] = []
    cache = per_request._PlanCache[tuple[int, int], per_request.PlanRows](
        lambda rows: rows.caps.nbytes + rows.verified.nbytes
    )

    def make(batch: int) -> per_request.PlanRows:
        made.append(batch)
        return per_request._plan_rows(batch, 4)

    sizes = [*range(1, 101), *range(100, 0, -1)]
    for batch in sizes:
        cache.get((batch, 4), functools.partial(make, batch))
    assert made == list(range(1, 101))


def test_the_decision_logs_queue_holds_no_more_than_its_bytes(tmp_path: Path) -> None:
    release = threading.Event()
    log = DecisionLog(tmp_path / "decisions.jsonl", max_queue_bytes=1000)

    def slow() -> dict[str, str]:  # the writer waits here: the disk is slow
        release.wait(30)
        return {"kind": "slow"}

    log.write(slow, 400)
    log.write({"kind": "a"}, 400)
    log.write({"kind": "b"}, 400)  # 1,200 bytes queued would be past the budget
    assert log.dropped == 1 and log.queued_bytes == 800
    release.set()
    log.flush()
    assert log.queued_bytes == 0 and log.written == 2
    log.close()


def test_a_sidecar_counts_the_bytes_its_decision_log_holds(tmp_path: Path) -> None:
    release = threading.Event()
    log = DecisionLog(tmp_path / "decisions.jsonl")
    service = DecisionService("goodput", decision_log=log)

    def slow() -> dict[str, str]:  # the writer waits here: the disk is slow
        release.wait(30)
        return {"kind": "slow"}

    log.write(slow, 400)
    assert run_unreported(service, "e", 1) == [""]
    held = sample(service, "nightjar_bytes_held", structure="decision_log")
    assert held >= 400 + context_bytes(context("e"))
    release.set()
    log.flush()
    assert sample(service, "nightjar_bytes_held", structure="decision_log") == 0
    log.close()


@pytest.mark.parametrize(
    "setting",
    [
        "max_pending_bytes_per_engine",
        "max_pending_bytes",
        "max_table_bytes_per_engine",
        "max_stream_queue_bytes",
    ],
)
def test_a_byte_budget_below_one_is_refused_naming_it(setting: str, tmp_path: Path) -> None:
    config = ServerConfig(uds=str(tmp_path / "s.sock")).merged({setting: 0}, origin="test")
    with pytest.raises(ConfigError, match=setting):
        config.validate()
    if setting != "max_stream_queue_bytes":
        with pytest.raises(ValueError, match=setting):
            Bounds(**{setting: 0})
