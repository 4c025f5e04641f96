"""Plumbing of the sidecar's asyncio gRPC server, apart from what it serves: synchronous
servicers run in the loop's thread pool, the decode guard as an asyncio interceptor, and a
handle that drives the loop's server from other threads."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn

import grpc

from nightjar_common import decode_guard
from nightjar_common.errors import InvalidArgumentError


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class ThreadContext:
    """What a synchronous servicer method uses of its context, from a worker thread."""

    def __init__(self, context: Any) -> None:
        self._context = context

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    def peer(self) -> str:
        return str(self._context.peer())

    def auth_context(self) -> Any:
        return self._context.auth_context()

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise _Aborted(code, details)


@dataclasses.dataclass(slots=True)
class Deferred:
    """A large request as received: its bytes, parsed on the thread that serves it (a
    Restore of tens of MB would hold the loop, and the GIL, for as long as it parses)."""

    method: str
    data: bytes
    parse: Callable[[bytes], Any]
    # What the audit logs of it (audit.describe of the parsed request), set once parsed.
    described: dict[str, Any] | None = None

    def parsed(self) -> Any:
        """The request; InvalidArgumentError (the decode guard's words) when its bytes are
        not the method's message."""
        try:
            return self.parse(self.data)
        except Exception as exc:  # protobuf raises DecodeError and others
            marker = decode_guard.Undecodable(str(exc) or type(exc).__name__)
            self.described = {"undecodable": True}
            raise InvalidArgumentError(decode_guard.describe(self.method, marker)) from None


@dataclasses.dataclass(frozen=True, slots=True)
class Serialized:
    """A reply serialized on the thread that built it: the loop only sends its bytes."""

    data: bytes


def deferring(method: str, parse: Callable[[bytes], Any], threshold: int) -> Callable[[bytes], Any]:
    """A request deserializer that parses requests up to ``threshold`` bytes on the loop
    and defers larger ones (Deferred) to the servicer's thread (InThreads)."""

    def deserialize(data: bytes) -> Any:
        return Deferred(method, data, parse) if len(data) > threshold else parse(data)

    return deserialize


def serializing(serialize: Callable[[Any], bytes]) -> Callable[[Any], bytes]:
    """A response serializer that passes a Serialized reply's bytes on as they are."""

    def serialized(reply: Any) -> bytes:
        return reply.data if isinstance(reply, Serialized) else serialize(reply)

    return serialized


class InThreads:
    """A synchronous servicer's unary methods as coroutines that run them in the loop's
    thread pool (admin calls write snapshots and copy learned state: not on the loop); a
    Deferred request is parsed there too, and described with ``describe`` for the audit,
    but for the methods named in ``unparsed``, which are handed it as it is (they parse it
    elsewhere: Restore, in a forked child)."""

    def __init__(
        self,
        servicer: Any,
        describe: Callable[[Any], dict[str, Any]] = lambda request: {},
        unparsed: frozenset[str] = frozenset(),
    ) -> None:
        self._servicer = servicer
        self._describe = describe
        self._unparsed = unparsed

    def __getattr__(self, name: str) -> Callable[[Any, Any], Awaitable[Any]]:
        method = getattr(self._servicer, name)
        parse = name not in self._unparsed

        def run(request: Any, context: ThreadContext) -> Any:
            if isinstance(request, Deferred) and parse:
                request = self._parsed(request)
            return method(request, context)

        async def handler(request: Any, context: Any) -> Any:
            try:
                return await asyncio.to_thread(run, request, ThreadContext(context))
            except _Aborted as aborted:
                await context.abort(aborted.code, aborted.details)

        return handler

    def _parsed(self, deferred: Deferred) -> Any:
        try:
            request = deferred.parsed()
        except InvalidArgumentError as exc:
            raise _Aborted(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        deferred.described = self._describe(request)
        return request


class WrappingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """An interceptor that wraps each method's handler once (:meth:`wrap`) and keeps it."""

    def __init__(self) -> None:
        # Only handlers that exist are kept: unknown method names cannot grow this.
        self._handlers: dict[str, Any] = {}

    def wrap(self, method: str, handler: Any) -> Any:
        """``handler`` of ``method`` as this interceptor serves it."""
        raise NotImplementedError

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[Any]], handler_call_details: Any
    ) -> Any:
        method = handler_call_details.method
        handler = self._handlers.get(method)
        if handler is None:
            handler = await continuation(handler_call_details)
            if handler is not None:
                handler = self._handlers[method] = self.wrap(method, handler)
        return handler


class AioDecodeGuard(WrappingInterceptor):
    """nightjar_common/decode_guard.py for the asyncio server: undecodable request bytes
    get INVALID_ARGUMENT before the servicer sees anything (a stream ends with it)."""

    def wrap(self, method: str, handler: Any) -> Any:
        return _guarded(method, handler)


class _UndecodableMessage(Exception):
    """A streamed request that is not the method's message (decode_guard)."""


def _guarded(method: str, handler: Any) -> Any:
    if handler is None or handler.request_deserializer is None:
        return handler
    deserialize = decode_guard.tolerant(handler.request_deserializer)

    async def check(request: Any, context: Any) -> Any:
        if isinstance(request, decode_guard.Undecodable):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, decode_guard.describe(method, request)
            )
        return request

    async def checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, decode_guard.Undecodable):
                # Raised, not aborted here: a handler may read its requests in a task of
                # its own (StepStream does), and an abort from there races its writes.
                raise _UndecodableMessage(decode_guard.describe(method, request))
            yield request

    def wrap(behavior: Callable[..., Any], streaming_request: bool) -> Callable[..., Any]:
        async def unary_result(request: Any, context: Any) -> Any:
            if not streaming_request:
                return await behavior(await check(request, context), context)
            try:
                return await behavior(checked_stream(request), context)
            except _UndecodableMessage as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        async def streamed_result(request: Any, context: Any) -> AsyncIterator[Any]:
            if streaming_request:
                request = checked_stream(request)
            else:
                request = await check(request, context)
            try:
                async for response in behavior(request, context):
                    yield response
            except _UndecodableMessage as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

        return streamed_result if inspect.isasyncgenfunction(behavior) else unary_result

    return rebuilt(handler, wrap, deserialize)


# A method handler's behaviour attribute, how to build one, and whether its requests stream.
_HANDLER_KINDS = (
    ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
    ("unary_stream", grpc.unary_stream_rpc_method_handler, False),
    ("stream_unary", grpc.stream_unary_rpc_method_handler, True),
    ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
)


def rebuilt(
    handler: Any,
    wrap: Callable[[Callable[..., Any], bool], Callable[..., Any]],
    deserialize: Callable[[bytes], Any],
) -> Any:
    """``handler`` built again with its behaviour wrapped (``wrap(behavior,
    streaming_request)``) and its requests read by ``deserialize``."""
    for name, make, streaming_request in _HANDLER_KINDS:
        behavior = getattr(handler, name)
        if behavior is not None:
            return make(wrap(behavior, streaming_request), deserialize, handler.response_serializer)
    return handler


class LoopServer:
    """The asyncio server, driven from other threads: ``stop(grace).wait()`` as with
    grpc.Server."""

    def __init__(self, server: grpc.aio.Server, loop: asyncio.AbstractEventLoop) -> None:
        self.aio = server
        self.loop = loop
        self._thread: threading.Thread | None = None

    def run(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def stop(self, grace: float | None) -> threading.Event:
        stopped = threading.Event()
        try:
            self.run(self.aio.stop(grace))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=5)
            stopped.set()
        return stopped
