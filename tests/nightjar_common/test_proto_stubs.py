"""The checked-in gRPC stubs are exactly what protoc generates from proto/ today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_current() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_every_service_and_field_is_documented() -> None:
    """The .proto is the contract: every service, rpc and field carries a comment."""
    undocumented = []
    for proto in sorted((ROOT / "proto" / "nightjar" / "v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for number, line in enumerate(lines):
            stripped = line.strip()
            is_decl = stripped.startswith(("service ", "rpc ")) or (
                "=" in stripped
                and stripped.endswith(";")
                and not stripped.startswith("//")
                and not stripped.startswith(("syntax", "option"))
            )
            previous = lines[number - 1].strip() if number else ""
            if is_decl and not previous.startswith("//") and "//" not in stripped:
                undocumented.append(f"{proto.name}:{number + 1}: {stripped}")
    assert not undocumented, "\n".join(undocumented)
