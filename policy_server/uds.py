"""Unix-domain sockets of the sidecar and of the memory agent: claiming the path.

gRPC removes whatever socket file is at the path when it binds, live or not: a second
server started on the same path would silently take it over from a running one (which
stays alive, unreachable). So the path is probed first: a server that accepts a
connection there is live and the new one refuses to start; a socket file nobody listens
on is a leftover of a killed server and is removed; anything that is not a socket is
never removed.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from pathlib import Path

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0


class SocketPathError(RuntimeError):
    """The socket path is taken by a live server or by something that is not a socket."""


def connect_error(path: str | Path, timeout: float = PROBE_TIMEOUT_S) -> OSError | None:
    """None when something accepts connections on the Unix socket ``path``, else why not
    (FileNotFoundError, ConnectionRefusedError for a stale file, PermissionError, ...)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(timeout)
        try:
            probe.connect(os.fspath(path))
        except OSError as exc:
            return exc
    return None


def claim(path: str | Path) -> None:
    """Make ``path`` ready for a new listener, or raise SocketPathError saying why not."""
    path = Path(path)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        return
    if not stat.S_ISSOCK(mode):
        raise SocketPathError(f"{path} exists and is not a socket: refusing to replace it")
    error = connect_error(path)
    if error is None:
        raise SocketPathError(
            f"another server is listening on {path}: stop it first, or give this one "
            "another socket path"
        )
    if not isinstance(error, ConnectionRefusedError):
        # Permission denied, a full backlog (timeout): it may well be live.
        raise SocketPathError(f"cannot tell whether {path} is in use ({error}): not replacing it")
    path.unlink(missing_ok=True)
    log.info("removed the stale socket %s (nothing listens on it)", path)
