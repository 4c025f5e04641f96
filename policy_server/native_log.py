"""gRPC's C core logs past Python: its lines (absl's format, ``I1129 00:02:35.601073  4059
ssl_transport_security.cc:2563] Handshake failed ...``) go straight to file descriptor 2.
Under ``--log-format json`` such a line would break a stream of one object a line, so
descriptor 2 is routed through a pipe and each line it carries becomes a record of the
``grpc`` logger, at the level its first letter names. Python's own writes (``sys.stderr``,
the log handler) keep the original descriptor."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading

LOGGER = "grpc"
# absl: severity letter, MMDD, time, thread id, file:line, "] ", the message.
_ABSL_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ (\S+:\d+)\] ?(.*)$")
_LEVELS = {"I": logging.INFO, "W": logging.WARNING, "E": logging.ERROR, "F": logging.CRITICAL}


def route_native_stderr() -> None:
    """From now on, what native code writes to descriptor 2 is logged on ``grpc``; call it
    before the log handler is made, so that the handler writes to the original stderr."""
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    sys.stderr = os.fdopen(original, "w", buffering=1, errors="backslashreplace")
    threading.Thread(target=_forward, args=(read_end,), name="grpc-log", daemon=True).start()


def record_of(line: str) -> tuple[int, str]:
    """The level and message of one line that native code wrote; a line in no known format
    is a WARNING with the line as its message."""
    found = _ABSL_LINE.match(line)
    if found is None:
        return logging.WARNING, line
    severity, source, message = found.groups()
    return _LEVELS[severity], f"{message} ({source})"


def _forward(read_end: int) -> None:
    log = logging.getLogger(LOGGER)
    with os.fdopen(read_end, "r", errors="backslashreplace") as lines:
        for line in lines:
            if line.strip():
                level, message = record_of(line.rstrip("\n"))
                log.log(level, "%s", message)
