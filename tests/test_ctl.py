"""`nightjarctl` and `nightjar-server` command lines, as an operator runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def ctl(server: Any, *args: str, token: bool = True) -> subprocess.CompletedProcess[str]:
    base = [sys.executable, "-m", "policy_server.ctl", "--target", server.target]
    if token:
        base += ["--token-file", str(server.token_file)]
    return subprocess.run([*base, *args], capture_output=True, text=True, timeout=60)


def test_operator_session(make_server, tmp_path: Path) -> None:
    server = make_server("--decision-log", str(tmp_path / "log" / "decisions.jsonl"))
    assert ctl(server, "health").stdout.strip() == "SERVING"

    listing = ctl(server, "policies").stdout
    assert "* nightjar" in listing and "table" in listing and '"gamma": 3' in listing

    for step in range(12):
        result = ctl(server, "decide", "--batch-size", "4", "--step-index", str(step),
                     "--report-step-seconds", "0.02", "--report-tokens", "9")  # fmt: skip
        assert result.returncode == 0, result.stderr
    decision = json.loads(result.stdout.splitlines()[0])
    assert decision["policy"] == "nightjar" and 0 <= decision["gamma"] <= 4
    assert json.loads(result.stdout.splitlines()[1]) == {"reported": True, "applied": True}

    state = json.loads(ctl(server, "state", "--json").stdout)
    assert state["reports_total"] == 12 and state["engines"] == ["nightjarctl"]
    assert sum(state["state"]["learners"]["engine:nightjarctl"]["4"]["counts"]) == 12
    human = ctl(server, "state").stdout
    assert "B=   4" in human and "pulls" in human

    snap = ctl(server, "snapshot")
    assert snap.returncode == 0 and "snapshot.json" in snap.stdout
    saved = tmp_path / "saved.json"
    saved.write_text((server.state_dir / "snapshot.json").read_text())

    denied = ctl(server, "swap", "static", token=False)
    assert denied.returncode == 1 and "UNAUTHENTICATED" in denied.stderr
    swapped = ctl(server, "swap", "static", "--params", '{"gamma": 1}')
    assert swapped.returncode == 0 and "active: static" in swapped.stdout
    bad = ctl(server, "swap", "nightjar", "--keep-state")
    assert bad.returncode == 1 and "FAILED_PRECONDITION" in bad.stderr
    assert json.loads(ctl(server, "state", "--json").stdout)["policy"] == "static"

    restored = ctl(server, "restore", str(saved))
    assert restored.returncode == 0 and "restored: nightjar" in restored.stdout
    after = json.loads(ctl(server, "state", "--json").stdout)
    assert after["state"] == state["state"]

    assert ctl(server, "reset").returncode == 0
    assert json.loads(ctl(server, "state", "--json").stdout)["state"]["learners"] == {}

    # Offline replay of the decision log rebuilds what the server had learned.
    server.terminate()
    out = tmp_path / "warm.json"
    replayed = subprocess.run(
        [sys.executable, "-m", "policy_server.ctl", "replay",
         str(tmp_path / "log" / "decisions.jsonl"), "--out", str(out)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr
    assert "12 decisions, 12 with outcomes" in replayed.stdout
    assert json.loads(out.read_text())["policy"]["state"]["learners"] == state["state"]["learners"]


def test_ctl_reports_an_unreachable_sidecar(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "policy_server.ctl", "--target", f"unix:{tmp_path}/none.sock",
         "--timeout", "0.5", "policies"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "nothing to listen on"),
        (["--uds", "x.sock", "--params", "{bad"], "--params is not valid JSON"),
        (["--uds", "x.sock", "--policy", "magic"], "unknown policy 'magic'"),
        (["--uds", "x.sock", "--params", '{"gamma_max": 0}'], "gamma_max must be in 1..64"),
        (["--uds", "x.sock", "--admin-token-file", "missing-token"], "cannot read admin token"),
        (["--uds", "x.sock", "--port", "70000"], "port must be in 0..65535"),
    ],
)
def test_server_refuses_bad_configuration_clearly(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "policy_server.cli", *args],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2
    assert message in result.stderr


def test_config_file_with_an_unknown_setting(tmp_path: Path) -> None:
    config = tmp_path / "nightjar.toml"
    config.write_text('uds = "x.sock"\nsnapshot_every = 3\n')
    result = subprocess.run(
        [sys.executable, "-m", "policy_server.cli", "--config", str(config)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "unknown setting(s) ['snapshot_every']" in result.stderr
