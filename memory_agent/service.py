"""The memory-agent gRPC service (nightjar.v1.MemoryAgentService) on a Unix socket.

Operators inspect the agent and force its actions here. A mutating call queues an order
for the engine's next step boundary and waits for it — at most the call's deadline, capped
at :data:`MAX_WAIT_S`; an engine with no requests reaches no boundary, so the call then
returns the status with the order in ``pending_action`` (it still runs with the next
step). Mutating calls need the admin token when one is configured, as on the sidecar's
AdminService. Health reports SERVING for the service while the agent is up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from nightjar_proto.v1 import memory_pb2, memory_pb2_grpc

from memory_agent.agent import MemoryAgent, MemoryStatus
from memory_agent.orders import Action, Order
from nightjar_common import decode_guard, reflection, uds
from nightjar_common.admin_token import check_admin_token
from nightjar_common.errors import NightjarError, status_of

log = logging.getLogger(__name__)

MEMORY_SERVICE = memory_pb2.DESCRIPTOR.services_by_name["MemoryAgentService"].full_name
MAX_WAIT_S = 30.0


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
    )


class MemoryAgentServicer(memory_pb2_grpc.MemoryAgentServiceServicer):  # type: ignore[misc]
    def __init__(self, agent: MemoryAgent, admin_token: str | None) -> None:
        self.agent = agent
        self._token = admin_token

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

    def _order(self, context: grpc.ServicerContext, make: Callable[[], Order]) -> Any:
        try:
            check_admin_token(context, self._token)
            ticket = self.agent.submit(make())
        except NightjarError as exc:
            context.abort(status_of(exc), str(exc))
        remaining = context.time_remaining()
        wait = MAX_WAIT_S if remaining is None else max(0.0, min(MAX_WAIT_S, remaining - 0.05))
        if self.agent.wait(ticket, wait) and ticket.error is not None:
            context.abort(status_of(ticket.error), str(ticket.error))
        return status_to_pb(self.agent.status())


def serve(
    agent: MemoryAgent,
    uds_path: str,
    admin_token: str | None = None,
    mode: int = uds.DEFAULT_MODE,
) -> grpc.Server:
    """Start the service on ``unix:uds_path`` (a few threads: operators, not the hot path).

    The socket file gets ``mode`` (group-writable by default: operators' tools in the
    engine's group connect). Raises SocketPathError when a live server already listens
    on the path (nightjar_common/uds.py).
    """
    uds.claim(uds_path)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="nightjar-memory"),
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
