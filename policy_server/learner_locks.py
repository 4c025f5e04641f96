"""Locks of the active policy's state, one per learner.

Engines that share a learner key share what the policy learned, so their steps are
serialised; engines of other learners are not (a state read of one engine, or a step of
another learner on another thread, does not hold them up). A fixed set of locks, a
learner's chosen by its id's hash: a bounded number whatever the learners, and two learners
that land on one lock only wait for each other. What changes the whole policy (activation,
reset, eviction, the part of the state no engine owns) holds all of them.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

STRIPES = 64


class LearnerLocks:
    def __init__(self, stripes: int = STRIPES) -> None:
        self._locks = tuple(threading.Lock() for _ in range(stripes))

    def of(self, learner: str) -> threading.Lock:
        """The lock of ``learner`` (LearnedState.learner_for)."""
        return self._locks[hash(learner) % len(self._locks)]

    @contextlib.contextmanager
    def every(self) -> Iterator[None]:
        """All of them, taken in one order (so two holders of all cannot deadlock)."""
        with contextlib.ExitStack() as held:
            for lock in self._locks:
                held.enter_context(lock)
            yield
