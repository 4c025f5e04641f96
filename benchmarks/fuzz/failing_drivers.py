"""`make fuzz`'s failing-driver class (issue 54): memory orders against a virtual-memory
driver that fails.

Each case is a seeded sequence of requests arriving and finishing (each block written
with fresh KV) and memory orders (offload, reload, compact, expand to random sizes), on a
memory agent over the host's real virtual memory (tests/rigs/vmm_engine.py: the host
driver, vLLM's BlockPool, the worker's block tables). Before an order, with some chance,
the driver is armed to fail one of its next map calls with ENOMEM, or the KV copy is made
to fail once. After every order:

* nothing raised out of a step boundary (the worker half runs inside vLLM's
  ``execute_model``);
* an order whose driver call or copy failed ended ABORTED (FAILED_PRECONDITION, the
  status of an order that cannot run, only when the failure was not reached), one that
  did not fail ended ok or refused with INVALID_ARGUMENT / FAILED_PRECONDITION;
* every KV block reads back what was written, through worker tables that name the
  scheduler's blocks;
* the agent's pool is vLLM's pool, the draft's memory backs the draft's range exactly
  while the draft is resident, and a resident draft is bit-identical to the original;
* no order is left pending.

At the end the draft is brought back (requests finished, a reload without failures): a
later order runs.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

from benchmarks.fuzz.hardening import ClassResult

CHECKED = (
    "after each order: no exception out of a step boundary, ABORTED exactly when a driver "
    "call or copy failed, every KV block reads back, pool and mappings consistent with the "
    "draft's state, the draft bit-identical while resident; a later reload runs"
)
ORDERS_PER_CASE = 12


def run(quick: bool, seed: int) -> ClassResult:
    result = ClassResult(
        "failing drivers",
        "memory orders (offload, reload, compact, expand) on the host's real virtual memory "
        "with the driver failing a random map call (ENOMEM) or the KV copy failing, "
        "between requests that write KV",
    )
    result.checked = CHECKED
    undone = {"n": 0}
    agent_log = logging.getLogger("memory_agent")
    level = agent_log.level
    agent_log.setLevel(logging.CRITICAL)  # every order's failure is logged: thousands here
    try:
        for case in range(15 if quick else 300):
            rng = random.Random(f"{seed}:{case}")
            try:
                run_case(rng, result, f"case {case}", undone)
            except Exception as exc:  # a crash of the case is a failure, not the fuzzer's end
                result.fail(f"case {case}", f"raised {type(exc).__name__}: {exc}")
    finally:
        agent_log.setLevel(level)
    result.what += f" ({undone['n']:,} orders failed that way and were undone)"
    return result


def run_case(rng: random.Random, result: ClassResult, name: str, undone: dict[str, int]) -> None:
    from memory_agent.orders import Action, Order
    from tests.rigs.vmm_engine import VmmEngine

    engine = VmmEngine(seed=rng.randrange(1 << 30))
    try:
        serial = 0
        for index in range(ORDERS_PER_CASE):
            for _ in range(rng.randrange(3)):
                serial += 1
                churn(engine, rng, f"r{serial}")
            agent = engine.agent
            # Half the orders move the draft (what a driver call can fail), half anything.
            action = rng.choice(list(Action))
            if rng.random() < 0.5:
                resident = agent.draft_resident
                action = Action.OFFLOAD_DRAFT if resident else Action.RELOAD_DRAFT
            target = rng.randrange(2, agent.capacity_blocks + 1)
            order = Order(action, resize_kv=rng.random() < 0.8, target_kv_blocks=target)
            if check_order(engine, rng, order, result, f"{name}, order {index} ({action})"):
                undone["n"] += 1
        for req in list(engine.tables):
            engine.finish(req)
        if not engine.agent.draft_resident:
            error = engine.run(Order(Action.RELOAD_DRAFT))
            result.cases += 1
            if error is not None or not engine.agent.draft_resident:
                result.fail(name, f"the final reload did not run: {error}")
            elif engine.draft_state() != engine.draft_bytes:
                result.fail(name, "the draft differs after the final reload")
    finally:
        engine.close()


def churn(engine: Any, rng: random.Random, req_id: str) -> None:
    """A request arrives (holding up to 12 blocks) or one finishes."""
    free = engine.elastic.free_blocks()
    if engine.tables and (rng.random() < 0.4 or free == 0 or not engine.free_rows):
        engine.finish(rng.choice(sorted(engine.tables)))
    elif free:
        engine.add_request(req_id, rng.randrange(1, min(12, free) + 1))


def check_order(
    engine: Any, rng: random.Random, order: Any, result: ClassResult, case: str
) -> bool:
    """Run ``order`` (perhaps with a failure injected) and check what it left; True when
    an injected failure ended it."""
    from nightjar_common.errors import (
        AbortedError,
        FailedPreconditionError,
        InvalidArgumentError,
    )
    from vllm_client_patch import worker_memory

    failed_before = engine.driver.failed
    if rng.random() < 0.5:
        engine.driver.arm(rng.randrange(1, 7))
    copy_failed = {"n": 0}
    restore_copy = None
    if rng.random() < 0.15:
        restore_copy = _fail_next_copy(worker_memory, copy_failed)
    result.cases += 1
    try:
        error = engine.run(order)
    except (InvalidArgumentError, FailedPreconditionError):  # refused at submit
        result.refused += 1
        return False
    except Exception as exc:
        result.fail(case, f"a step boundary raised {type(exc).__name__}: {exc}")
        return False
    finally:
        engine.driver.fail_at = None  # an armed call not reached is disarmed
        if restore_copy is not None:
            restore_copy()
    failed = engine.driver.failed > failed_before or copy_failed["n"] > 0
    if failed and not isinstance(error, AbortedError):
        result.fail(case, f"a driver call or copy failed, the order ended {error!r}")
    if not failed and error is not None:
        if isinstance(error, (InvalidArgumentError, FailedPreconditionError)):
            result.refused += 1
        else:
            result.fail(case, f"no failure injected, the order ended {error!r}")
    for problem in invariants(engine):
        result.fail(case, problem)
    return failed


def _fail_next_copy(module: Any, counter: dict[str, int]) -> Callable[[], None]:
    """Make the worker's next KV copy fail once; returns the undo."""
    real = module.migrate

    def failing(*args: Any, **kwargs: Any) -> Any:
        module.migrate = real
        counter["n"] += 1
        raise RuntimeError("KV copy failed (injected)")

    module.migrate = failing
    return lambda: setattr(module, "migrate", real)


def invariants(engine: Any) -> list[str]:
    from memory_agent.vmm import Residence

    agent = engine.agent
    found = list(engine.problems())
    if agent.kv_blocks != engine.pool.num_gpu_blocks:
        found.append(f"agent pool {agent.kv_blocks} != vLLM's {engine.pool.num_gpu_blocks}")
    resident = agent.draft_resident
    if (engine.memory.residence is Residence.DRAFT) != resident:
        found.append(f"draft {agent.state.value} but its memory backs {engine.memory.residence}")
    if resident and agent.kv_blocks > agent.capacity_blocks - agent.draft_blocks:
        found.append(f"pool {agent.kv_blocks} grew over the resident draft's blocks")
    if resident and engine.draft_state() != engine.draft_bytes:
        found.append("the resident draft differs from the original")
    if agent.status().pending_orders:
        found.append(f"orders left pending: {agent.status().pending_action}")
    return found
