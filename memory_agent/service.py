"""The memory-agent gRPC service (nightjar.v1.MemoryAgentService) on a Unix socket.

Operators inspect the agent and force its actions here. A mutating call queues an order
for the engine's next step boundary and waits for it — at most the call's deadline, capped
at :data:`MAX_WAIT_S`. The order carries that deadline: if no boundary comes in time (an
engine with no requests reaches none), or the caller goes away, it is withdrawn and never
runs (DEADLINE_EXCEEDED); once running it completes, and the call returns the status with
it in ``pending_orders``. CancelOrder withdraws queued orders. Mutating calls need the
admin token when one is configured, as on the sidecar's AdminService; the token file is
re-read when it changes (rotation without a restart). Health reports SERVING for the
service while the agent is up.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from nightjar_proto.v1 import memory_pb2, memory_pb2_grpc

from memory_agent.agent import MemoryAgent, MemoryStatus
from memory_agent.orders import Action, Order
from nightjar_common import decode_guard, reflection, uds
from nightjar_common.admin_token import AdminTokenFile, check_admin_token
from nightjar_common.errors import CancelledError, DeadlineExceededError, NightjarError, status_of

log = logging.getLogger(__name__)

MEMORY_SERVICE = memory_pb2.DESCRIPTOR.services_by_name["MemoryAgentService"].full_name
MAX_WAIT_S = 30.0
# Of the caller's deadline, kept back to answer before it passes.
REPLY_MARGIN_S = 0.05
# Ordering calls that may wait for a boundary at once (one server thread each); one more
# is refused (RESOURCE_EXHAUSTED). The server has threads beyond these, so GetStatus and
# CancelOrder always answer.
MAX_WAITING_CALLS = 4


def status_to_pb(status: MemoryStatus) -> memory_pb2.MemoryStatus:
    return memory_pb2.MemoryStatus(
        draft_resident=status.draft_resident,
        draft_state=status.draft_state,
        total_kv_blocks=status.kv_blocks,
        free_kv_blocks=status.free_kv_blocks,
        draft_bytes=status.draft_bytes,
        draft_kv_blocks=status.draft_blocks,
        kv_capacity_blocks=status.capacity_blocks,
        pending_action=status.pending_action,
        last_error=status.last_error,
        offloads=status.offloads,
        reloads=status.reloads,
        failed_reloads=status.failed_reloads,
        migrated_blocks=status.migrated_blocks,
        last_order_ms=status.last_order_ms,
        pending_orders=[
            memory_pb2.PendingOrder(**dataclasses.asdict(order)) for order in status.pending_orders
        ],
        queue_limit=status.queue_limit,
    )


class MemoryAgentServicer(memory_pb2_grpc.MemoryAgentServiceServicer):  # type: ignore[misc]
    def __init__(self, agent: MemoryAgent, admin_token: str | AdminTokenFile | None) -> None:
        self.agent = agent
        self._token = admin_token
        self._waiting = threading.BoundedSemaphore(MAX_WAITING_CALLS)

    def GetStatus(self, request: Any, context: grpc.ServicerContext) -> Any:
        return status_to_pb(self.agent.status())

    def OffloadDraft(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._order(context, lambda: Order(Action.OFFLOAD_DRAFT, request.expand_kv))

    def ReloadDraft(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._order(context, lambda: Order(Action.RELOAD_DRAFT, request.compact_kv))

    def ExpandKv(self, request: Any, context: grpc.ServicerContext) -> Any:
        target = request.target_kv_blocks
        return self._order(context, lambda: Order(Action.EXPAND_KV, target_kv_blocks=target))

    def CompactKv(self, request: Any, context: grpc.ServicerContext) -> Any:
        target = request.target_kv_blocks
        return self._order(context, lambda: Order(Action.COMPACT_KV, target_kv_blocks=target))

    def CancelOrder(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            check_admin_token(context, self._token)
            cancelled = self.agent.cancel(request.order_id)
        except NightjarError as exc:
            context.abort(status_of(exc), str(exc))
        return memory_pb2.CancelOrderResponse(
            cancelled_order_ids=cancelled, status=status_to_pb(self.agent.status())
        )

    def _order(self, context: grpc.ServicerContext, make: Callable[[], Order]) -> Any:
        if not self._waiting.acquire(blocking=False):
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{MAX_WAITING_CALLS} ordering calls already wait for a step boundary: retry "
                "once they have returned, or cancel their orders (CancelOrder)",
            )
        try:
            return self._queue_and_wait(context, make)
        finally:
            self._waiting.release()

    def _queue_and_wait(self, context: grpc.ServicerContext, make: Callable[[], Order]) -> Any:
        remaining = context.time_remaining()
        wait = MAX_WAIT_S if remaining is None else min(MAX_WAIT_S, remaining - REPLY_MARGIN_S)
        try:
            check_admin_token(context, self._token)
            # The order must not start once its caller has stopped waiting for it.
            order = dataclasses.replace(make(), deadline=time.monotonic() + max(0.0, wait))
            ticket = self.agent.submit(order)
        except NightjarError as exc:
            context.abort(status_of(exc), str(exc))
        # A caller that goes away (cancelled, disconnected) takes its queued order along.
        gone = CancelledError(f"{order.action.value}: its caller went away before it ran")

        def on_done() -> None:  # any end of the call; a no-op once the order ran
            self.agent.withdraw(ticket, gone)

        context.add_callback(on_done)
        if not self.agent.wait(ticket, max(0.0, wait)):
            expired = DeadlineExceededError(
                f"{order.action.value}: no step boundary within {wait:.1f} s (an idle engine "
                "reaches none): the order was withdrawn and will not run"
            )
            if self.agent.withdraw(ticket, expired):
                context.abort(status_of(expired), str(expired))
            # Running already: it completes; the status shows it in pending_orders.
        elif ticket.error is not None:
            context.abort(status_of(ticket.error), str(ticket.error))
        return status_to_pb(self.agent.status())


def serve(
    agent: MemoryAgent,
    uds_path: str,
    admin_token: str | AdminTokenFile | None = None,
    mode: int = uds.DEFAULT_MODE,
) -> grpc.Server:
    """Start the service on ``unix:uds_path`` (a few threads: operators, not the hot path;
    at most :data:`MAX_WAITING_CALLS` of them wait for step boundaries).

    ``admin_token``: a token, or the file it is read from (re-read when it changes).
    The socket file gets ``mode`` (group-writable by default: operators' tools in the
    engine's group connect). Raises SocketPathError when a live server already listens
    on the path (nightjar_common/uds.py).
    """
    uds.claim(uds_path)
    server = grpc.server(
        futures.ThreadPoolExecutor(
            max_workers=MAX_WAITING_CALLS + 4, thread_name_prefix="nightjar-memory"
        ),
        options=[("grpc.so_reuseport", 0)],
        interceptors=[decode_guard.DecodeGuard()],
    )
    memory_pb2_grpc.add_MemoryAgentServiceServicer_to_server(
        MemoryAgentServicer(agent, admin_token), server
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((MEMORY_SERVICE, health.SERVICE_NAME), server)
    uds.bind(server, uds_path, mode)
    server.start()
    for name in ("", MEMORY_SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("nightjar memory agent listening on unix:%s (mode %04o)", uds_path, mode)
    return server
