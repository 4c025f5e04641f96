"""Prometheus metrics of the memory agent (``nightjar_memory_agent_*``).

Orders are rare (one per offload, reload or resize), so the agent updates these directly
(:meth:`MemoryAgent.attach_metrics`). In vLLM the plugin builds them file-backed
(``vllm_client_patch/metrics.py``) once the scheduler has the agent in service, so that
vLLM's own ``/metrics`` serves them; here they are plain prometheus_client objects,
registered nowhere.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from memory_agent.orders import Action

# How long an order held the engine at step boundaries: a resize without copies takes
# µs, a draft offload or a block migration ms, a synchronous reload up to seconds.
ORDER_BUCKETS = (1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0, 5.0)
# How an order ended: carried out, failed (and undone), expired unrun (its caller's
# deadline passed while it was queued) or cancelled unrun.
RESULTS = ("ok", "failed", "expired", "cancelled")
# Why an order was refused before it was queued.
REFUSALS = ("queue_full",)


class AgentMetrics:
    def __init__(self) -> None:
        orders = Counter(
            "nightjar_memory_agent_orders",
            "Memory orders by action and how they ended (ok|failed|expired|cancelled).",
            ["action", "result"],
            registry=None,
        )
        # Every series exported from zero, so that increase() sees the first failure.
        self.orders = {
            (action.value, result): orders.labels(action.value, result)
            for action in Action
            for result in RESULTS
        }
        refused = Counter(
            "nightjar_memory_agent_orders_refused",
            "Memory orders refused before they were queued, by reason (queue_full).",
            ["reason"],
            registry=None,
        )
        self.refused = {reason: refused.labels(reason) for reason in REFUSALS}
        self.queued = Gauge(
            "nightjar_memory_agent_queued_orders",
            "Memory orders waiting for a step boundary (bounded; the running one not counted).",
            registry=None,
            multiprocess_mode="mostrecent",
        )
        self.order_seconds = Histogram(
            "nightjar_memory_agent_order_seconds",
            "Time an order held the engine at step boundaries.",
            buckets=ORDER_BUCKETS,
            registry=None,
        )
        self.draft_resident = Gauge(
            "nightjar_memory_agent_draft_resident",
            "1 while the draft model is resident (speculation possible), else 0.",
            registry=None,
            multiprocess_mode="mostrecent",
        )

    def order_done(self, action: Action, result: str, held_s: float | None) -> None:
        """``held_s``: None for an order that never ran (expired, cancelled)."""
        self.orders[action.value, result].inc()
        if held_s is not None:
            self.order_seconds.observe(held_s)
