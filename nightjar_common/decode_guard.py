"""Undecodable requests get INVALID_ARGUMENT, not gRPC's INTERNAL.

grpcio answers a request whose bytes do not parse as the method's message (truncated,
corrupted, invalid UTF-8 in a string field) with INTERNAL "Exception deserializing
request!", which reads as a server bug. This interceptor wraps every method handler's
deserializer: bytes that do not parse become an :class:`Undecodable` marker that the
handler turns into INVALID_ARGUMENT before the servicer sees anything. In a stream the
stream ends with that status (its framing cannot be trusted after a bad message).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # grpcio's classes are generic in its stubs only
    Handler = grpc.RpcMethodHandler[Any, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Undecodable:
    reason: str


def describe(method: str, marker: Undecodable) -> str:
    """The INVALID_ARGUMENT message for an undecodable request to ``method``."""
    return f"the request is not a valid message for {method}: {marker.reason}"


class DecodeGuard(grpc.ServerInterceptor):  # type: ignore[type-arg]
    def __init__(self) -> None:
        # Wrapped handlers by method; built once, so a call costs one dictionary lookup.
        self._handlers: dict[str, Handler | None] = {}
        self._lock = threading.Lock()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        method = handler_call_details.method
        try:
            return self._handlers[method]
        except KeyError:
            pass
        handler = _guarded(method, continuation(handler_call_details))
        with self._lock:
            self._handlers[method] = handler
        return handler


def tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """A request deserializer that returns an Undecodable marker instead of raising."""

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # protobuf raises DecodeError and others
            return Undecodable(str(exc) or type(exc).__name__)

    return deserialize


def _guarded(method: str, handler: Handler | None) -> Handler | None:
    if handler is None or handler.request_deserializer is None:
        return handler
    deserialize = tolerant(handler.request_deserializer)

    def checked(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, describe(method, request))
        return request

    def checked_stream(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
        for request in requests:
            yield checked(request, context)

    serialize = handler.response_serializer
    if handler.unary_unary is not None:
        behavior = handler.unary_unary
        return grpc.unary_unary_rpc_method_handler(
            lambda request, context: behavior(checked(request, context), context),
            deserialize,
            serialize,
        )
    if handler.unary_stream is not None:
        unary_stream = handler.unary_stream
        return grpc.unary_stream_rpc_method_handler(
            lambda request, context: unary_stream(checked(request, context), context),
            deserialize,
            serialize,
        )
    if handler.stream_unary is not None:
        stream_unary = handler.stream_unary
        return grpc.stream_unary_rpc_method_handler(
            lambda requests, context: stream_unary(checked_stream(requests, context), context),
            deserialize,
            serialize,
        )
    stream_stream = handler.stream_stream
    assert stream_stream is not None
    return grpc.stream_stream_rpc_method_handler(
        lambda requests, context: stream_stream(checked_stream(requests, context), context),
        deserialize,
        serialize,
    )
