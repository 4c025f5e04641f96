"""Errors of the contract and the gRPC status code each one is answered with.

Every server of the contract (the sidecar, the memory agent) raises these and answers
:func:`status_of` the error; nothing else picks a status code.
"""

from __future__ import annotations

import grpc


class ConfigError(ValueError):
    """A setting or a file named at start-up is unusable; the process refuses to start."""


class NightjarError(Exception):
    """Base class; the message is sent to the caller verbatim."""


class InvalidArgumentError(NightjarError):
    """The request itself is malformed (INVALID_ARGUMENT)."""


class NotFoundError(NightjarError):
    """A referenced decision, policy or file does not exist (NOT_FOUND)."""


class FailedPreconditionError(NightjarError):
    """The request is well-formed but the system is not in a state to apply it."""


class UnauthenticatedError(NightjarError):
    """A mutating admin call without a valid admin token (UNAUTHENTICATED)."""


class PermissionDeniedError(NightjarError):
    """The request names something the server must not touch, e.g. a file outside its state
    directory (PERMISSION_DENIED)."""


class ResourceExhaustedError(NightjarError):
    """A bounded queue or budget is full; the caller may retry later (RESOURCE_EXHAUSTED)."""


class DeadlineExceededError(NightjarError):
    """The caller's deadline passed before the work could start; it will not run
    (DEADLINE_EXCEEDED)."""


class AbortedError(NightjarError):
    """The work failed part-way and was undone: everything is as before it, and a retry may
    succeed (ABORTED)."""


class CancelledError(NightjarError):
    """The work was withdrawn (by an operator or its caller) before it started (CANCELLED)."""


STATUS_OF: dict[type[NightjarError], grpc.StatusCode] = {
    InvalidArgumentError: grpc.StatusCode.INVALID_ARGUMENT,
    NotFoundError: grpc.StatusCode.NOT_FOUND,
    FailedPreconditionError: grpc.StatusCode.FAILED_PRECONDITION,
    UnauthenticatedError: grpc.StatusCode.UNAUTHENTICATED,
    PermissionDeniedError: grpc.StatusCode.PERMISSION_DENIED,
    ResourceExhaustedError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    DeadlineExceededError: grpc.StatusCode.DEADLINE_EXCEEDED,
    AbortedError: grpc.StatusCode.ABORTED,
    CancelledError: grpc.StatusCode.CANCELLED,
}


def status_of(exc: NightjarError) -> grpc.StatusCode:
    for cls in type(exc).__mro__:
        if cls in STATUS_OF:
            return STATUS_OF[cls]
    return grpc.StatusCode.INTERNAL
