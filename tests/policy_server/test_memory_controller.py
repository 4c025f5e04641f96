"""Elastic-memory controller over scripted step sequences (docs/MEMORY.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from nightjar_common.types import DraftState, StepContext
from policy_server.memory import (
    OFFLOAD,
    RELOAD,
    MemoryController,
    MemoryParams,
    MemoryParamsError,
)

TOTAL = 1000  # τ_low = 10 % → scarce below 100 free blocks


def ctx(free: int, waiting: int = 0, resident: bool = True, total: int = TOTAL) -> StepContext:
    return StepContext(
        engine_id="e",
        batch_size=32,
        num_waiting=waiting,
        free_kv_blocks=free,
        total_kv_blocks=total,
        draft_resident=resident,
    )


def controller(**overrides: object) -> MemoryController:
    params = {
        "enabled": True,
        "t_persist": 5,
        "draft_blocks": 200,
        "cooldown_steps": 20,
        "order_timeout_steps": 50,
        **overrides,
    }
    return MemoryController(MemoryParams(**params))  # type: ignore[arg-type]


def test_expands_only_after_t_persist_scarce_steps_with_gamma_zero() -> None:
    mc = controller()
    for _ in range(4):
        assert not mc.step(ctx(free=50), gamma=0).action
    assert not mc.step(ctx(free=50), gamma=1).action  # speculating: the streak restarts
    assert not mc.step(ctx(free=150), gamma=0).action  # not scarce: restarts too
    directives = [mc.step(ctx(free=50), gamma=0) for _ in range(5)]
    assert [d.action for d in directives] == ["", "", "", "", OFFLOAD]
    assert directives[-1].target_kv_blocks == TOTAL + 200
    # From the order on, speculation is off until a reload is verified.
    assert not mc.speculation_allowed(ctx(free=50))
    assert not mc.step(ctx(free=50), gamma=0).action  # not re-issued while pending
    mc.step(ctx(free=250, resident=False, total=TOTAL + 200), gamma=0)
    assert mc.engines["e"].state is DraftState.OFFLOADED


def offloaded(mc: MemoryController) -> None:
    for _ in range(5):
        mc.step(ctx(free=50), gamma=0)
    mc.step(ctx(free=250, resident=False, total=1200), gamma=0)
    assert mc.engines["e"].state is DraftState.OFFLOADED


def test_contracts_only_with_an_empty_queue_and_room_after_the_cooldown() -> None:
    mc = controller()
    offloaded(mc)
    big = ctx(free=500, resident=False, total=1200)
    # Within the cooldown nothing happens however roomy the pool is.
    assert not any(mc.step(big, 0).action for _ in range(18))
    assert not mc.step(ctx(free=500, waiting=3, resident=False, total=1200), 0).action
    assert not mc.step(ctx(free=300, resident=False, total=1200), 0).action  # 300 < 200 + 120
    directives = [mc.step(big, 0) for _ in range(5)]
    assert directives[-1].action == RELOAD and directives[-1].target_kv_blocks == 1000
    assert not mc.speculation_allowed(ctx(free=500))  # reloading: γ = 0 until verified
    mc.step(ctx(free=300), gamma=0)  # the engine reports the draft resident again
    assert mc.engines["e"].state is DraftState.RESIDENT
    assert mc.speculation_allowed(ctx(free=300))


def test_no_thrashing_when_conditions_flip_every_step() -> None:
    mc = controller(t_persist=1, cooldown_steps=100)
    resident, total = True, TOTAL
    for step in range(1000):
        scarce = step % 2 == 0
        c = ctx(free=50 if scarce else 900, resident=resident, total=total)
        directive = mc.step(c, gamma=0)
        if directive.action == OFFLOAD:
            resident, total = False, directive.target_kv_blocks
        elif directive.action == RELOAD:
            resident, total = True, directive.target_kv_blocks
    assert 2 <= mc.engines["e"].transitions <= 1000 // 100 + 1


def test_an_order_not_carried_out_is_issued_again_after_the_timeout() -> None:
    mc = controller()
    for _ in range(5):
        mc.step(ctx(free=50), gamma=0)
    assert mc.engines["e"].state is DraftState.OFFLOADING
    actions = [mc.step(ctx(free=50), gamma=0).action for _ in range(60)]
    assert actions.count(OFFLOAD) == 1  # once the timeout passed, the trigger re-armed


def test_disabled_or_unknown_draft_size_never_orders() -> None:
    for mc in (controller(enabled=False), controller(draft_blocks=0)):
        assert not any(mc.step(ctx(free=10), gamma=0).action for _ in range(100))
    with pytest.raises(MemoryParamsError, match="tau_low"):
        MemoryParams(tau_low=1.5)


def test_the_server_attaches_directives_and_shows_memory_state(
    make_server: Any, tmp_path: Path
) -> None:
    """A real sidecar: scarce γ=0 steps → an offload directive on the wire, then γ=0 forced
    while the draft is away; state in GetState and in the metrics."""
    import json
    import subprocess
    import sys

    from nightjar_proto.v1 import admin_pb2, policy_pb2

    from tests.policy_server.test_server import context, scrape

    memory = {"enabled": True, "t_persist": 3, "draft_blocks": 200, "cooldown_steps": 1}
    server = make_server(
        "--policy", "static", "--params", '{"gamma": 0}', "--memory", json.dumps(memory)
    )
    scarce: dict[str, Any] = {"free_kv_blocks": 50, "total_kv_blocks": TOTAL}
    engine = server.engine()
    # A directive is decided as the engine reports a step it ran (the ran step rides on
    # its next table request) and comes with the next table: the third scarce γ=0 step
    # run orders the offload, on the fourth table.
    actions = [
        engine.decide(context(step_index=i, **scarce)).memory_directive.action for i in range(4)
    ]
    offload = policy_pb2.MemoryDirective.OFFLOAD_DRAFT_EXPAND_KV
    assert actions == [0, 0, 0, offload]

    def draft_state() -> dict[str, float]:
        samples = scrape(server.metrics_port)["nightjar_memory_draft_state"]
        return {s.labels["state"]: s.value for s in samples if s.labels["engine"] == "e"}

    assert draft_state()["offloading"] == 1
    state = json.loads(server.admin.GetState(admin_pb2.GetStateRequest(), timeout=5).memory_json)
    assert state["engines"]["e"]["state"] == "offloading"
    # The static policy would say γ=0 anyway; switch to γ=3 and it is still held at 0.
    server.admin.SwapPolicy(
        admin_pb2.SwapPolicyRequest(name="static", params_json='{"gamma": 3}'),
        metadata=server.auth,
        timeout=5,
    )
    held = engine.decide(context(step_index=4, **scarce))
    assert held.gamma == 0 and held.reason == "forced"
    # The engine reports the draft offloaded and the pool grown; with room and an empty
    # queue the sidecar orders the reload (three steps run so, on the next table) and
    # holds γ = 0 until the engine reports the draft resident again — then the policy's
    # γ = 3 is back.
    roomy: dict[str, Any] = {
        "free_kv_blocks": 900,
        "total_kv_blocks": TOTAL + 200,
        "draft_resident": False,
    }
    replies = [engine.decide(context(step_index=5 + i, **roomy)) for i in range(4)]
    reload = policy_pb2.MemoryDirective.COMPACT_KV_RELOAD_DRAFT
    assert [r.memory_directive.action for r in replies] == [0, 0, 0, reload]
    assert {r.gamma for r in replies} == {0}
    assert draft_state()["reloading"] == 1
    back: dict[str, Any] = {"free_kv_blocks": 700, "total_kv_blocks": TOTAL, "draft_resident": True}
    assert engine.decide(context(step_index=9, **back)).gamma == 3
    # The engine's own report moved the state: the gauge follows it, one state at a time,
    # once the engine reports the step it ran.
    assert engine.report().skipped == 0
    engine.close()
    assert draft_state() == {"resident": 1, "offloading": 0, "offloaded": 0, "reloading": 0}
    state = json.loads(server.admin.GetState(admin_pb2.GetStateRequest(), timeout=5).memory_json)
    assert state["engines"]["e"]["state"] == "resident"
    assert state["engines"]["e"]["transitions"] == 2  # offloaded, then resident again
    samples = scrape(server.metrics_port)["nightjar_memory_directives"]
    assert any(s.labels["action"] == "offload_draft_expand_kv" and s.value == 1 for s in samples)
    assert any(s.labels["action"] == "compact_kv_reload_draft" and s.value == 1 for s in samples)
    command = [
        sys.executable,
        "-m",
        "policy_server.cli",
        "--uds",
        str(tmp_path / "x"),
        "--memory",
        '{"tau_low": 3}',
    ]
    bad = subprocess.run(command, capture_output=True, text=True)
    assert bad.returncode == 2 and "tau_low" in bad.stderr
