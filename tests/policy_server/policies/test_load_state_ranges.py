"""Every policy's load_state refuses values no policy could have learned, all or nothing
(issue 28: "Restore and load_state are all-or-nothing, for every policy").

Each case takes a state the policy learned (two engines), breaks one value of the last
engine or learner, and checks that load_state raises MalformedStateError (the service
answers INVALID_ARGUMENT) and that the policy's state is what it was. goodput's own
checks are in test_goodput_policy.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from nightjar_common.errors import InvalidArgumentError
from nightjar_common.types import StepContext, StepOutcome
from policy_server.policies.base import MalformedStateError
from policy_server.service import DecisionService

State = dict[str, Any]


def learned(policy: str) -> DecisionService:
    service = DecisionService(policy)
    for engine in ("e0", "e1"):
        for step in range(14):
            batch = 1 + step % 4
            ctx = StepContext(engine_id=engine, batch_size=batch, step_index=step)
            decision = service.run_step(ctx)
            gamma = decision.gamma
            service.report(
                StepOutcome(
                    decision_id=decision.decision_id,
                    engine_id=engine,
                    gamma=gamma,
                    step_seconds=0.02,
                    generated_tokens=batch + gamma * batch // 2,
                    drafted_tokens=gamma * batch,
                    accepted_tokens=gamma * batch // 2,
                )
            )
    return service


def last(mapping: dict[str, Any]) -> Any:
    return mapping[sorted(mapping)[-1]]


def first_value(mapping: dict[str, Any]) -> Any:
    return mapping[sorted(mapping)[0]]


def nightjar_schedule(state: State) -> dict[str, Any]:
    return first_value(last(state["engines"])["schedules"])


def nightjar_arms(state: State) -> dict[str, Any]:
    return first_value(last(state["learners"]))


def setter(get: Callable[[State], dict[str, Any]], key: str, value: Any) -> Callable[[State], None]:
    def apply(state: State) -> None:
        get(state)[key] = value

    return apply


def rekey(get: Callable[[State], dict[str, Any]], key: Any) -> Callable[[State], None]:
    def apply(state: State) -> None:
        table = get(state)
        table[key] = table.pop(sorted(table)[0])

    return apply


def nightjar_engine(state: State) -> dict[str, Any]:
    return last(state["engines"])


def ema_slot(state: State) -> dict[str, Any]:
    return first_value(last(state["slots"]))


def dsde_calibration(state: State) -> dict[str, Any]:
    return last(state["engines"])["calibration"]


def ucb_arms(state: State) -> dict[str, Any]:
    return first_value(last(state["learners"]))


CASES: list[tuple[str, str, Callable[[State], None]]] = [
    ("nightjar", "previous_gamma 99 > gamma_max", setter(nightjar_engine, "previous_gamma", 99)),
    ("nightjar", "previous_gamma -1", setter(nightjar_engine, "previous_gamma", -1)),
    ("nightjar", "previous_gamma 1.5", setter(nightjar_engine, "previous_gamma", 1.5)),
    ("nightjar", "rng -1", setter(nightjar_engine, "rng", -1)),
    ("nightjar", "rng 2^64", setter(nightjar_engine, "rng", 1 << 64)),
    ("nightjar", "learner not a string", setter(nightjar_engine, "learner", ["x"])),
    ("nightjar", "schedule block 0", setter(nightjar_schedule, "block", 0)),
    ("nightjar", "schedule block 10^6", setter(nightjar_schedule, "block", 10**6)),
    ("nightjar", "schedule block_length 3", setter(nightjar_schedule, "block_length", 3)),
    ("nightjar", "schedule bin 0", setter(nightjar_schedule, "bin", 0)),
    ("nightjar", "schedule round -3", setter(nightjar_schedule, "round", -3)),
    ("nightjar", "schedule explore 'yes'", setter(nightjar_schedule, "explore", "yes")),
    ("nightjar", "schedule context 0", rekey(lambda s: nightjar_engine(s)["schedules"], "0")),
    ("nightjar", "arm count -1", setter(nightjar_arms, "counts", [-1, 0, 0, 0, 0])),
    ("nightjar", "arm count 2^70", setter(nightjar_arms, "counts", [1 << 70, 0, 0, 0, 0])),
    ("nightjar", "arm mean -1", setter(nightjar_arms, "means", [-1.0, 0, 0, 0, 0])),
    ("nightjar", "arm mean 1e400", setter(nightjar_arms, "means", [float("inf"), 0, 0, 0, 0])),
    ("nightjar", "learner context -4", rekey(lambda s: last(s["learners"]), "-4")),
    ("ema", "candidate -5", setter(ema_slot, "candidates", [-5])),
    ("ema", "candidate 1000", setter(ema_slot, "candidates", [1000])),
    ("ema", "index out of range", setter(ema_slot, "index", 7)),
    ("ema", "ema infinite", setter(ema_slot, "ema", float("inf"))),
    ("ema", "batches -1", setter(ema_slot, "batches", -1)),
    ("ema", "tier -1", rekey(lambda s: last(s["slots"]), "-1")),
    ("dsde", "steps -1", setter(dsde_calibration, "steps", -1)),
    ("dsde", "max_accepted 10^400", setter(dsde_calibration, "max_accepted", 10**400)),
    ("dsde", "max_accepted 2^40", setter(dsde_calibration, "max_accepted", 1 << 40)),
    ("dsde", "disagreement_sum -1", setter(dsde_calibration, "disagreement_sum", -1.0)),
    ("dsde", "disagreement_max inf", setter(dsde_calibration, "disagreement_max", float("inf"))),
    ("dsde", "history a string", setter(lambda s: last(s["engines"]), "batch", "123")),
    ("dsde", "history negative", setter(lambda s: last(s["engines"]), "batch", [-1.0])),
    ("ucb", "count -1", setter(ucb_arms, "counts", [-1, 0, 0, 0, 0])),
    ("ucb", "sum -1", setter(ucb_arms, "sums", [-1.0, 0, 0, 0, 0])),
    ("ucb", "best inf", setter(ucb_arms, "best", float("inf"))),
    ("ucb", "bucket 3", rekey(lambda s: last(s["learners"]), "3")),
    ("ucb", "engine's learner not a string", setter(lambda s: s["engines"], "e1", 5)),
    ("dsd", "successes -1", setter(lambda s: last(s["learners"]), "successes", -1.0)),
    ("dsd", "failures inf", setter(lambda s: last(s["learners"]), "failures", float("inf"))),
]


@pytest.mark.parametrize(
    ("policy", "break_it"), [(p, fn) for p, _, fn in CASES], ids=[f"{p}: {w}" for p, w, _ in CASES]
)
def test_an_impossible_value_is_refused_and_nothing_changes(
    policy: str, break_it: Callable[[State], None]
) -> None:
    service = learned(policy)
    learner = service.active.policy
    before = learner.state()
    broken = copy.deepcopy(before)
    break_it(broken)
    assert broken != before
    with pytest.raises(MalformedStateError):
        learner.load_state(broken)
    assert learner.state() == before
    # Restore of a snapshot holding it: INVALID_ARGUMENT, the active policy kept.
    document = service.snapshot_document()
    document["policy"]["state"] = broken
    active = service.active
    with pytest.raises(InvalidArgumentError):
        service.restore_document(document)
    assert service.active is active and service.active.learned.state() == before


@pytest.mark.parametrize("policy", sorted({p for p, _, _ in CASES}))
def test_a_learned_state_loads_as_it_was(policy: str) -> None:
    service = learned(policy)
    state = service.active.learned.state()
    fresh = DecisionService(policy).active.policy
    fresh.load_state(state)
    assert fresh.state() == state
