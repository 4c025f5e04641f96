"""Errors the server maps onto precise gRPC status codes (see grpc_server.py)."""


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
