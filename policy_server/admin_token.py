"""The admin token: loaded from a file, refused when it is a placeholder.

One loader serves the sidecar (``--admin-token-file``) and the memory agent in the engine
(``NIGHTJAR_ADMIN_TOKEN_FILE``). A shipped example Secret holding ``change-me`` that
reaches production is worse than no token at all (it looks protected), so the rule is:

* the file's content, stripped of surrounding whitespace, is the token;
* it must be at least :data:`MIN_LENGTH` characters long (``openssl rand -hex 32`` gives 64);
* it must not be a known placeholder (:data:`PLACEHOLDERS`, compared case-insensitively,
  also with ``-``/``_`` removed, so ``Change_Me`` is refused as well).
"""

from __future__ import annotations

from pathlib import Path

from policy_server.config import ConfigError

MIN_LENGTH = 16
PLACEHOLDERS = frozenset(
    {"changeme", "change-me", "secret", "password", "token", "admin", "changemechangeme",
     "adminadmin", "placeholder", "example", "test", "default"}
)  # fmt: skip


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
