"""Request size bounds per method, checked on a request's bytes before they are parsed.

gRPC's own receive limit is one number for the whole server. Restore must take a
snapshot-sized document (tens of MB), while an engine's StepRequest or any other call has
no reason to be larger than a few MB, and parsing a large message costs the event loop
that answers every engine. So the server's limit is the largest any method needs, and this
interceptor holds each method to its own bound: a larger request is refused with
RESOURCE_EXHAUSTED and a message naming the bound and its setting, unparsed. A stream
ends with that status (as gRPC ends one whose message is over its own limit).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc

from nightjar_common import decode_guard
from policy_server.aio import WrappingInterceptor, rebuilt

RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclasses.dataclass(frozen=True, slots=True)
class Bound:
    """A method's largest request in bytes, and the setting that decides it."""

    max_bytes: int
    setting: str

    def refusal(self, method: str, size: int) -> str:
        return (
            f"{method}: the request is {size:,} bytes, more than the {self.max_bytes:,} "
            f"bytes this sidecar accepts for it ({self.setting})"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Oversized(decode_guard.Undecodable):
    """A request over its method's bound, in place of the request (never parsed). An
    Undecodable, so that the audit logs it as one."""


class _OversizedMessage(Exception):
    """A streamed request over its method's bound."""


class MessageLimits(WrappingInterceptor):
    """Holds each method's requests to ``bounds[method]`` (full method names), the others
    to ``default``; ``on_refused(method)`` counts each refusal."""

    def __init__(
        self,
        default: Bound,
        bounds: Mapping[str, Bound],
        on_refused: Callable[[str], None] = lambda method: None,
    ) -> None:
        super().__init__()
        self._default = default
        self._bounds = dict(bounds)
        self._on_refused = on_refused

    def wrap(self, method: str, handler: Any) -> Any:
        return _limited(method, handler, self._bounds.get(method, self._default), self)

    def refused(self, method: str) -> None:
        self._on_refused(method)


def _limited(method: str, handler: Any, bound: Bound, limits: MessageLimits) -> Any:
    if handler is None or handler.request_deserializer is None:
        return handler
    parse = handler.request_deserializer

    def deserialize(data: bytes) -> Any:
        if len(data) > bound.max_bytes:
            return Oversized(bound.refusal(method, len(data)))
        return parse(data)

    async def refuse(context: Any, reason: str) -> None:
        limits.refused(method)
        await context.abort(RESOURCE_EXHAUSTED, reason)

    async def checked_stream(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for request in requests:
            if isinstance(request, Oversized):
                # Raised, not aborted here: a handler may read its requests in a task of its
                # own (StepStream does), and an abort from there races its writes.
                raise _OversizedMessage(request.reason)
            yield request

    def wrap(behavior: Callable[..., Any], streaming_request: bool) -> Callable[..., Any]:
        async def unary_result(request: Any, context: Any) -> Any:
            if streaming_request:
                try:
                    return await behavior(checked_stream(request), context)
                except _OversizedMessage as exc:
                    await refuse(context, str(exc))
            if isinstance(request, Oversized):
                await refuse(context, request.reason)
            return await behavior(request, context)

        async def streamed_result(request: Any, context: Any) -> AsyncIterator[Any]:
            if streaming_request:
                request = checked_stream(request)
            elif isinstance(request, Oversized):
                await refuse(context, request.reason)
            try:
                async for response in behavior(request, context):
                    yield response
            except _OversizedMessage as exc:
                await refuse(context, str(exc))

        return streamed_result if inspect.isasyncgenfunction(behavior) else unary_result

    return rebuilt(handler, wrap, deserialize)
