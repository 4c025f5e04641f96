"""A step holds the lock of the learner it changes, not one lock for the whole policy: an
engine of another learner goes on while one learner's lock is held (by a state read of
its engine, say), an engine of the same learner waits. And which learner that is, is the
policy's answer (LearnedState.learner_for): the one an engine's record updates."""

from __future__ import annotations

import itertools
import threading

import pytest

from nightjar_common.types import StepContext
from policy_server.policies import create_policy, learned_state, tentative_decisions
from policy_server.service import DecisionService


def decide_in_thread(service: DecisionService, engine: str, key: str) -> threading.Event:
    done = threading.Event()

    def run() -> None:
        service.run_step(StepContext(engine, 8, step_index=1, learner_key=key))
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


def test_a_held_learner_holds_up_its_own_engines_only() -> None:
    service = DecisionService("goodput", {"seed": 1})
    policy = service.active.learned
    locks = service.activation.learner_locks
    held = locks.of(policy.learner_for("a", "model-a"))
    # A learner key whose lock is another (64 locks: the first few keys find one).
    other = next(
        key
        for key in (f"model-{i}" for i in itertools.count())
        if locks.of(policy.learner_for("b", key)) is not held
    )
    with held:
        assert decide_in_thread(service, "b", other).wait(5.0)
        waiting = decide_in_thread(service, "a2", "model-a")
        assert not waiting.wait(0.3)
    assert waiting.wait(5.0)


def test_an_activation_waits_for_every_learner() -> None:
    service = DecisionService("goodput", {"seed": 1})
    held = service.activation.learner_locks.of(service.active.learned.learner_for("a", ""))
    swapped = threading.Event()

    def swap() -> None:
        service.swap("static", {"gamma": 2}, keep_state=False)
        swapped.set()

    with held:
        threading.Thread(target=swap, daemon=True).start()
        assert not swapped.wait(0.3)
    assert swapped.wait(5.0)
    assert service.run_step(StepContext("a", 8)).gamma == 2


@pytest.mark.parametrize("name", ["goodput", "nightjar"])
def test_an_engine_changes_the_learner_of_its_record(name: str) -> None:
    """Before its first step an engine's learner follows its key (shared) or its id;
    after, its record's, whatever key it sends: the lock taken is of the learner changed."""
    policy = create_policy(name, {"seed": 1})
    assert policy.learner_for("e", "k") == "shared:k"
    assert policy.learner_for("e", "") == "engine:e"
    policy.decide(StepContext("e", 8, learner_key="k"))
    assert policy.learner_for("e", "other") == "shared:k"
    assert create_policy(name, {"seed": 1, "share_learner": False}).learner_for("e", "k") == (
        "engine:e"
    )


@pytest.mark.parametrize("name", ["ucb", "dsd"])
def test_a_learner_table_policy_locks_per_learner_and_decides_tentatively(name: str) -> None:
    """dsd and ucb decide table entries on the live policy (TentativeDecisions): an
    engine's steps take its learner's lock only, and a table's candidates leave no entry
    behind that a step did not run."""
    policy = create_policy(name)
    assert tentative_decisions(policy) is not None
    assert learned_state(policy).learner_for("e", "k") == "shared:k"
    assert learned_state(policy).learner_for("f", "") == "engine:f"
    decided = policy.decide_candidates(StepContext("e", 8, learner_key="k"), [1, 8, 64])  # type: ignore[attr-defined]
    assert learned_state(policy).state()["engines"] == {}  # nothing left behind
    policy.commit(StepContext("e", 64, learner_key="k"), decided[2][1])  # type: ignore[attr-defined]
    assert learned_state(policy).state()["engines"] == {"e": "shared:k"}
