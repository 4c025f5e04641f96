"""The admin token: loaded from a file, refused when it is a placeholder.

One loader serves the sidecar (``--admin-token-file``) and the memory agent in the engine
(``NIGHTJAR_ADMIN_TOKEN_FILE``). A shipped example Secret holding ``change-me`` that
reaches production is worse than no token at all (it looks protected), so the rule is:

* the file's content, stripped of surrounding whitespace, is the token;
* it must be at least :data:`MIN_LENGTH` characters long (``openssl rand -hex 32`` gives 64);
* it must not be a known placeholder (:data:`PLACEHOLDERS`, compared case-insensitively,
  also with ``-``/``_`` removed, so ``Change_Me`` is refused as well);
* it must be printable ASCII: gRPC metadata carries nothing else, so a client could never
  send any other token, and the admin API would be locked out.

The sidecar re-reads the file when it changes (:class:`AdminTokenFile`), so a token is
rotated by rewriting the file (best atomically: write another file, rename it over; a
Kubernetes Secret volume does so) without a restart. A rotated file that is unusable
refuses every mutating call until it is fixed: never the old token, which may be the
leaked one being rotated out.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
from pathlib import Path

import grpc

from nightjar_common.errors import ConfigError, UnauthenticatedError

log = logging.getLogger(__name__)

MIN_LENGTH = 16
PLACEHOLDERS = frozenset(
    {
        "changeme",
        "change-me",
        "secret",
        "password",
        "token",
        "admin",
        "changemechangeme",
        "adminadmin",
        "placeholder",
        "example",
        "test",
        "default",
    }
)


class AdminTokenError(ConfigError):
    """The admin token file cannot be read or holds an unacceptable token."""


def token_problem(token: str) -> str | None:
    """Why ``token`` is not acceptable as an admin token, or None when it is."""
    if not token:
        return "it is empty"
    folded = token.lower()
    if folded in PLACEHOLDERS or folded.replace("-", "").replace("_", "") in PLACEHOLDERS:
        return f"{token!r} is a placeholder"
    if len(token) < MIN_LENGTH:
        return f"it is {len(token)} characters long, fewer than {MIN_LENGTH}"
    unsendable = next((char for char in token if not " " <= char <= "~"), None)
    if unsendable is not None:
        return f"it holds {unsendable!r}, which is not printable ASCII (what gRPC metadata carries)"
    return None


def read_token(path: str) -> str | None:
    """The token in the file at ``path``; None when no file is configured ("")."""
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise AdminTokenError(f"cannot read admin token file {path}: {exc}") from exc
    problem = token_problem(token)
    if problem is not None:
        raise AdminTokenError(
            f"admin token file {path} is not usable: {problem}; write a random token of at "
            f"least {MIN_LENGTH} characters, e.g. `openssl rand -hex 32`"
        )
    return token


class AdminTokenFile:
    """The admin token of a file, re-read whenever the file is replaced or rewritten."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seen: tuple[int, ...] | None = None
        self._token: str | None = None
        self._problem = ""
        token = read_token(path)  # an unusable file at start stops the server (AdminTokenError)
        self._seen, self._token = self._identity(), token

    def _identity(self) -> tuple[int, ...] | None:
        try:
            st = os.stat(self.path)  # follows symbolic links (a Secret volume's ..data)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def current(self) -> str:
        """The token now in force; UnauthenticatedError while the file is unusable."""
        with self._lock:
            seen = self._identity()
            if seen is None or seen != self._seen:
                self._seen = seen
                try:
                    self._token, self._problem = read_token(self.path), ""
                    log.info("admin token file %s re-read (rotated)", self.path)
                except AdminTokenError as exc:
                    self._token, self._problem = None, str(exc)
                    log.error("%s: mutating admin calls are refused until it is fixed", exc)
            if self._token is None:
                raise UnauthenticatedError(
                    "the server's admin token file is unusable (see the server's log): "
                    "mutating calls are refused until it is fixed"
                )
            return self._token


def check_admin_token(
    context: grpc.ServicerContext, configured: str | AdminTokenFile | None
) -> None:
    """Mutating calls carry 'authorization: Bearer <token>' when a token is configured."""
    if configured is None:
        return
    # A token file is re-read when it changes (rotation, nightjar_common/admin_token.py).
    expected = configured.current() if isinstance(configured, AdminTokenFile) else configured
    metadata = dict(context.invocation_metadata())
    header = str(metadata.get("authorization", ""))
    if not header:
        raise UnauthenticatedError(
            "admin token required: send 'authorization: Bearer <token>' metadata"
        )
    scheme, _, token = header.partition(" ")
    # Bytes: compare_digest raises TypeError on a str that is not ASCII.
    given = token.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given, expected.encode()):
        raise UnauthenticatedError("invalid admin token")
