"""The Grafana dashboard: built by the SDK, committed as built, its queries run on Prometheus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "nightjar.json"


def test_committed_dashboard_is_what_the_builder_builds() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "policy_server.ops.dashboard", "--check", "--out", str(DASHBOARD)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr


def test_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    stale = tmp_path / "nightjar.json"
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    board["title"] = "edited by hand"
    stale.write_text(json.dumps(board, indent=2, sort_keys=True) + "\n")
    result = subprocess.run(
        [sys.executable, "-m", "policy_server.ops.dashboard", "--check", "--out", str(stale)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 1
    assert "make dashboard" in result.stderr
