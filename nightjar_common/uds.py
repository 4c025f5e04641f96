"""Unix-domain sockets of the sidecar and of the memory agent: claiming the path, binding
with a mode.

Mode: connecting to a Unix socket needs write permission on its file. The engine (vLLM)
and the sidecar often run as different users, so the sockets are created group-writable,
0660 by default, for a group both share (Kubernetes: the pod's ``fsGroup``, which owns the
shared volume and, through its set-group-id bit, the sockets created in it). The process
umask is narrowed while gRPC binds, so the file never exists with more than the mode,
then set to exactly the mode before the server starts.

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
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 1.0
DEFAULT_MODE = 0o660
# os.umask is process-wide: one bind at a time changes it.
_UMASK_LOCK = threading.Lock()


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


def claim(path: str | Path, make_parent: bool = True) -> None:
    """Make ``path`` ready for a new listener, or raise SocketPathError saying why not.
    Without ``make_parent`` a missing directory is an error: a mistyped path must not
    become a socket nobody looks for."""
    path = Path(path)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        if not make_parent and not path.parent.is_dir():
            raise SocketPathError(
                f"the directory of {path} does not exist: create it (in a pod, mount a "
                "volume there) or correct the path"
            ) from None
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


def parse_mode(value: Any) -> int:
    """A socket file mode from an octal string ("0660", "660", "0o660") or an int."""
    if isinstance(value, bool):
        raise ValueError(f"socket mode must be octal like 0660, got {value!r}")
    if isinstance(value, int):
        mode = value
    else:
        text = str(value).strip().lower().removeprefix("0o")
        try:
            mode = int(text, 8)
        except ValueError:
            raise ValueError(f"socket mode must be octal like 0660, got {value!r}") from None
    if not 0 <= mode <= 0o777:
        raise ValueError(f"socket mode must be in 0000..0777, got {oct(mode)}")
    if mode & 0o600 != 0o600:
        raise ValueError(f"socket mode {mode:04o} leaves the owner unable to use the socket")
    return mode


def bind(server: Any, path: str | Path, mode: int = DEFAULT_MODE) -> str:
    """Add ``unix:path`` to the (not yet started) gRPC ``server``: the socket file is
    created with at most ``mode``, then set to exactly ``mode``. Returns the address."""
    address = f"unix:{os.fspath(path)}"
    with _UMASK_LOCK:
        # Reading the umask means setting it: 0o777 for the instant in between (files
        # created meanwhile by other threads get fewer permissions, never more).
        previous = os.umask(0o777)
        os.umask(previous | (0o777 & ~mode))
        try:
            server.add_insecure_port(address)
        finally:
            os.umask(previous)
    os.chmod(path, mode)
    return address
