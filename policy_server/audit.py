"""Audit trail of admin calls: one INFO line per call on the ``nightjar.audit`` logger.

Every call of the admin service is logged once it is answered, whatever the answer: the
method, its parameters, the status (with the reason of a refusal), who called (the gRPC
peer and, under mutual TLS, the client certificate's name) and how long it took; a call
that activated a policy names the version it activated, which the decision log's
``policy`` records carry too. It is an interceptor, outermost, so refusals made before the
servicer runs (undecodable requests, a missing token) are logged as well.

The admin token travels in metadata and is never logged. Long strings (a snapshot sent
with Restore) are logged by their length only.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import grpc
from google.protobuf import json_format

from nightjar_common import decode_guard
from policy_server.aio import Deferred, WrappingInterceptor

log = logging.getLogger("nightjar.audit")

# Strings longer than this are logged as their length (snapshots, exported learners).
MAX_LOGGED_CHARS = 256


class AdminAudit(WrappingInterceptor):
    """Logs every call of the methods under ``service`` (a full service name)."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._prefix = f"/{service}/"

    def wrap(self, method: str, handler: Any) -> Any:
        if not method.startswith(self._prefix):
            return handler
        return _audited(method.removeprefix(self._prefix), handler)


def _audited(method: str, handler: Any) -> Any:
    behavior = handler.unary_unary
    if behavior is None:  # the admin service is unary only; anything else passes
        return handler

    async def audited(request: Any, context: Any) -> Any:
        started = time.perf_counter()
        try:
            reply = await behavior(request, context)
        except BaseException as exc:
            code = context.code() or grpc.StatusCode.UNKNOWN
            details = context.details() or str(exc) or type(exc).__name__
            _log(method, request, context, started, code, details, None)
            raise
        _log(method, request, context, started, grpc.StatusCode.OK, "", reply)
        return reply

    return grpc.unary_unary_rpc_method_handler(
        audited, handler.request_deserializer, handler.response_serializer
    )


def _log(
    method: str,
    request: Any,
    context: Any,
    started: float,
    code: grpc.StatusCode,
    details: str | bytes,
    reply: Any,
) -> None:
    if isinstance(details, bytes):
        details = details.decode(errors="replace")
    record: dict[str, Any] = {
        "method": method,
        "params": describe(request),
        "status": code.name,
        "peer": str(context.peer()),
    }
    client = client_name(context)
    if client:
        record["client"] = client
    record["duration_ms"] = round(1000.0 * (time.perf_counter() - started), 3)
    if details:
        record["reason"] = details
    version = getattr(reply, "policy_version", "")
    if version:
        record["policy_version"] = version
    text = " ".join(f"{key}={_text(value)}" for key, value in record.items())
    log.info("admin call %s", text, extra={"audit": record})


def _text(value: object) -> str:
    # JSON: a value cannot break the line or pass for another field.
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def describe(request: Any) -> dict[str, Any]:
    """A request's fields (set ones only), long strings as their length."""
    if isinstance(request, decode_guard.Undecodable):
        return {"undecodable": True}
    if isinstance(request, Deferred):  # described on its thread once parsed
        return request.described or {"bytes": len(request.data)}
    fields = json_format.MessageToDict(request, preserving_proto_field_name=True)
    return {
        key: f"<{len(value)} characters>"
        if isinstance(value, str) and len(value) > MAX_LOGGED_CHARS
        else value
        for key, value in fields.items()
    }


def client_name(context: Any) -> str:
    """The client certificate's name under mutual TLS, else "" (a Unix socket's peer has
    no identity gRPC reports: its file mode decides who may connect)."""
    try:
        names = context.peer_identities()
    except (AttributeError, ValueError):
        return ""
    if not names:
        return ""
    return ",".join(n.decode(errors="replace") if isinstance(n, bytes) else str(n) for n in names)
