"""Placeholder and weak admin tokens are refused at start, by the sidecar and the memory agent."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from nightjar_common.admin_token import (
    MIN_LENGTH,
    AdminTokenError,
    check_admin_token,
    read_token,
)
from nightjar_common.errors import UnauthenticatedError

WEAK = [
    ("change-me\n", "'change-me' is a placeholder"),
    ("CHANGEME", "'CHANGEME' is a placeholder"),
    ("Change_Me", "'Change_Me' is a placeholder"),
    ("password", "'password' is a placeholder"),
    ("", "it is empty"),
    ("   \n\t\n", "it is empty"),
    ("abc123", f"it is 6 characters long, fewer than {MIN_LENGTH}"),
    ("9f86d081884c7d659a2feaa0c55ad015\u00e9", "it holds 'é', which is not printable ASCII"),
    ("9f86d081884c7d659a2f\x01eaa0c55ad015", "it holds '\\x01', which is not printable ASCII"),
]


@pytest.mark.parametrize(("content", "reason"), WEAK)
def test_server_refuses_a_weak_token_with_rc_2(tmp_path: Path, content: str, reason: str) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text(content)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "policy_server.cli",
            "--uds",
            str(tmp_path / "s.sock"),
            "--admin-token-file",
            str(token_file),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert f"admin token file {token_file} is not usable: {reason}" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "s.sock").exists()  # refused before listening


@pytest.mark.parametrize(("content", "reason"), WEAK)
def test_the_shared_loader_refuses_a_weak_token(tmp_path: Path, content: str, reason: str) -> None:
    """The engine's memory agent loads NIGHTJAR_ADMIN_TOKEN_FILE with this same function
    (vllm_client_patch/memory.py), so its service refuses to start on the same tokens."""
    token_file = tmp_path / "admin-token"
    token_file.write_text(content)
    with pytest.raises(AdminTokenError, match=re.escape(reason)):
        read_token(str(token_file))


def test_a_good_token_is_read_stripped_and_no_file_means_no_token(tmp_path: Path) -> None:
    token_file = tmp_path / "admin-token"
    token_file.write_text("  9f86d081884c7d659a2feaa0c55ad015\n")
    assert read_token(str(token_file)) == "9f86d081884c7d659a2feaa0c55ad015"
    assert read_token("") is None
    with pytest.raises(AdminTokenError, match="cannot read admin token file"):
        read_token(str(tmp_path / "missing"))


class _Context:
    def __init__(self, header: str) -> None:
        self._metadata = [("authorization", header)]

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata


def test_a_non_ascii_token_from_a_client_is_refused_not_an_error() -> None:
    expected = "9f86d081884c7d659a2feaa0c55ad015"
    with pytest.raises(UnauthenticatedError, match="invalid admin token"):
        check_admin_token(_Context(f"Bearer {expected}\u00e9"), expected)  # type: ignore[arg-type]
    check_admin_token(_Context(f"Bearer {expected}"), expected)  # type: ignore[arg-type]
