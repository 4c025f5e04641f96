"""`nightjarctl` and `nightjar-server` command lines, as an operator runs them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from memory_agent import service
from memory_agent.agent import MemoryAgent
from policy_server.policies import create_policy
from tests.nightjar_common.test_sockets import run_server
from tests.policy_server.test_server import reflect_v1

CTL_TIMEOUT_S = 60


def ctl(server: Any, *args: str, token: bool = True) -> subprocess.CompletedProcess[str]:
    # faulthandler: a run that outlives its timeout is aborted with every thread's stack
    # on stderr, so the failure shows where it hung.
    base = [sys.executable, "-X", "faulthandler", "-m", "policy_server.ctl"]
    base += ["--target", server.target]
    if token:
        base += ["--token-file", str(server.token_file)]
    command = [*base, *args]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            out, err = process.communicate(timeout=CTL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            out, err = process.communicate()
            hung = f"nightjarctl {' '.join(args)} did not exit in {CTL_TIMEOUT_S} s"
            pytest.fail(f"{hung}:\n{out}\n{err}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def ctl_replay(log: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`nightjarctl replay LOG ARGS… --out OUT`: offline, no sidecar."""
    return subprocess.run(
        [sys.executable, "-m", "policy_server.ctl", "replay", str(log), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_operator_session(make_server, tmp_path: Path) -> None:
    server = make_server("--decision-log", str(tmp_path / "log" / "decisions.jsonl"))
    assert ctl(server, "health").stdout.strip() == "SERVING"

    listing = ctl(server, "policies").stdout
    assert "* goodput" in listing and "  nightjar" in listing and '"gamma": 3' in listing

    for step in range(12):
        result = ctl(
            server,
            "decide",
            "--batch-size",
            "4",
            "--step-index",
            str(step),
            "--report-step-seconds",
            "0.02",
            "--report-tokens",
            "9",
        )
        assert result.returncode == 0, result.stderr
    decision = json.loads(result.stdout.splitlines()[0])
    assert decision["policy"] == "goodput" and 0 <= decision["gamma"] <= 4
    assert json.loads(result.stdout.splitlines()[1]) == {"reported": True, "applied": True}

    state = json.loads(ctl(server, "state", "--json").stdout)
    assert state["reports_total"] == 12 and state["engines"] == ["nightjarctl"]
    assert state["state"]["learners"]["engine:nightjarctl"]["steps"] == 12
    human = ctl(server, "state").stdout
    assert "learner engine:nightjarctl: α=" in human and "B=   4  γ=" in human
    # Requests never named: the default stays on the batch γ, learning.
    assert "  nightjarctl: γ per batch (learning, 0 checks, 0 switches)" in human

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
    assert restored.returncode == 0 and "restored: goodput" in restored.stdout
    after = json.loads(ctl(server, "state", "--json").stdout)
    assert after["state"] == state["state"]

    assert ctl(server, "reset").returncode == 0
    assert json.loads(ctl(server, "state", "--json").stdout)["state"]["learners"] == {}

    # Offline replay of the decision log rebuilds what the server had learned.
    server.terminate()
    out = tmp_path / "warm.json"
    replayed = ctl_replay(tmp_path / "log" / "decisions.jsonl", out)
    assert replayed.returncode == 0, replayed.stderr
    assert "12 decisions, 12 with outcomes" in replayed.stdout
    assert json.loads(out.read_text())["policy"]["state"]["learners"] == state["state"]["learners"]


def test_ctl_reports_an_unreachable_sidecar(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "policy_server.ctl",
            "--target",
            f"unix:{tmp_path}/none.sock",
            "--timeout",
            "0.5",
            "policies",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr
    assert f"(is nightjar-server running and listening at unix:{tmp_path}/none.sock?" in (
        result.stderr
    )


def test_a_socket_path_without_unix_gets_the_fix() -> None:
    """gRPC alone would answer "Domain name not found"; the plugin says the same for
    NIGHTJAR_SIDECAR."""
    for target in ("/run/nightjar/nightjar.sock", "nightjar.sock"):
        done = run_ctl("--target", target, "health")
        assert done.returncode == 2
        assert done.stderr == f"nightjarctl: --target {target} is a path: write unix:{target}\n"


def test_help_is_for_operators_and_names_the_default_target() -> None:
    done = run_ctl("--help")
    text = " ".join(done.stdout.split())
    assert done.returncode == 0
    assert "default unix:/run/nightjar/nightjar.sock" in text
    assert text.count("Inspect and steer a running Nightjar sidecar") == 1
    assert "share one parser" not in text  # the module's docstring is for developers


def test_replay_rebuilds_under_the_logged_policy_and_parameters(
    make_server: Any, tmp_path: Path
) -> None:
    """A parameter changed at run time (set-params) survives replay + restore: replay takes
    the logs' last policy record, or with --policy that policy's last one."""
    log = tmp_path / "log" / "decisions.jsonl"
    server = make_server("--decision-log", str(log))
    assert ctl(server, "set-params", '{"tpot_slo_ms": 60}').returncode == 0
    for step in range(4):
        decided = ctl(
            server,
            "decide",
            "--batch-size",
            "2",
            "--step-index",
            str(step),
            "--report-step-seconds",
            "0.02",
            "--report-tokens",
            "3",
        )
        assert decided.returncode == 0, decided.stderr
    assert ctl(server, "swap", "static", "--params", '{"gamma": 2}').returncode == 0
    server.terminate()

    def replayed(*args: str) -> dict[str, Any]:
        out = tmp_path / "warm.json"
        done = ctl_replay(log, out, *args)
        assert done.returncode == 0, done.stderr
        policy: dict[str, Any] = json.loads(out.read_text())["policy"]
        return policy

    last = replayed()
    assert (last["name"], last["params"]["gamma"]) == ("static", 2)
    goodput = replayed("--policy", "goodput")
    assert goodput["params"]["tpot_slo_ms"] == 60
    assert goodput["state"]["learners"]["engine:nightjarctl"]["steps"] == 4
    assert replayed("--policy", "goodput", "--params", '{"seed": 7}')["params"] == {
        **goodput["params"],
        "seed": 7,
    }
    never_ran = replayed("--policy", "nightjar")["params"]
    assert never_ran == create_policy("nightjar").params()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "nothing to listen on"),
        (["--uds", "x.sock", "--params", "{bad"], "--params is not valid JSON"),
        (["--uds", "x.sock", "--policy", "magic"], "unknown policy 'magic'"),
        (["--uds", "x.sock", "--params", '{"gamma_max": 0}'], "gamma_max must be in 1..64"),
        (["--uds", "x.sock", "--admin-token-file", "missing-token"], "cannot read admin token"),
        (["--uds", "x.sock", "--port", "70000"], "port must be in 0..65535"),
        (["--uds", "x.sock", "--uds-mode", "0666"], "or add --force-uds-mode"),
        (["--uds", "x.sock", "--decision-log", "/proc/no/d.jsonl"], "give --decision-log"),
    ],
)
def test_server_refuses_bad_configuration_clearly(
    tmp_path: Path, args: list[str], message: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "policy_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_a_listener_that_cannot_start_is_one_line_and_leaves_nothing() -> None:
    """A metrics port in use or a socket directory that does not exist: rc 1, one line
    naming the fix, no traceback, no socket file or directory left behind."""
    directory = Path(tempfile.mkdtemp(prefix="nj-"))  # socket paths: at most ~107 bytes
    try:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = str(taken.getsockname()[1])
            busy = run_server("--uds", str(directory / "s.sock"), "--metrics-port", port)
        assert busy.returncode == 1 and "Traceback" not in busy.stderr, busy.stderr
        assert busy.stderr.strip().splitlines()[-1] == (
            f"nightjar-server: cannot listen: metrics on 127.0.0.1:{port}: Address already "
            "in use: give another --metrics-port (0 picks a free one) or stop what holds it"
        )
        assert not (directory / "s.sock").exists()
        missing = run_server("--uds", str(directory / "no" / "such" / "s.sock"))
        assert missing.returncode == 1 and "Traceback" not in missing.stderr
        assert f"the directory of {directory}/no/such/s.sock does not exist" in missing.stderr
        assert not (directory / "no").exists()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_a_world_writable_socket_only_when_forced(make_server: Any) -> None:
    server = make_server("--uds-mode", "0666", "--force-uds-mode")
    assert stat.S_IMODE(server.uds.stat().st_mode) == 0o666
    assert "is world-writable (mode 0666, forced)" in server.log()


def test_a_default_start_warns_about_nothing(make_server: Any) -> None:
    """With a token, the defaults are no mistake: nothing to warn about (a WARNING every
    start teaches operators to ignore them)."""
    server = make_server()
    assert " WARNING " not in server.log(), server.log()
    assert "no prefill_cost_table given" in server.log()  # said, at INFO


def test_config_file_with_an_unknown_setting(tmp_path: Path) -> None:
    config = tmp_path / "nightjar.toml"
    config.write_text('uds = "x.sock"\nsnapshot_every = 3\n')
    result = subprocess.run(
        [sys.executable, "-m", "policy_server.cli", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "unknown setting(s) ['snapshot_every']" in result.stderr


def run_ctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTJAR_")}
    return subprocess.run(
        [sys.executable, "-m", "policy_server.ctl", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**environ, **(env or {})},
    )


def test_bad_log_level_is_a_usage_error(tmp_path: Path) -> None:
    flag = subprocess.run(
        [sys.executable, "-m", "policy_server.cli", "--uds", "x.sock", "--log-level", "verbose"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert flag.returncode == 2 and "Traceback" not in flag.stderr
    assert "argument --log-level: invalid choice: 'VERBOSE'" in flag.stderr
    config = tmp_path / "nightjar.toml"
    config.write_text('uds = "x.sock"\nlog_level = "loud"\n')
    from_file = subprocess.run(
        [sys.executable, "-m", "policy_server.cli", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert from_file.returncode == 2 and "Traceback" not in from_file.stderr
    assert "log_level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL" in from_file.stderr


def test_global_flags_go_either_side_of_the_subcommand(make_server: Any) -> None:
    server = make_server()
    after = run_ctl("state", "--target", server.target, "--timeout", "2", "--json")
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout)["policy"] == "goodput"
    # Given on both sides, the one after the subcommand wins; given before only, it holds.
    both = run_ctl("--target", "unix:/nonexistent.sock", "health", "--target", server.target)
    assert both.returncode == 0 and both.stdout.strip() == "SERVING"
    before = run_ctl("--target", server.target, "--timeout", "2", "policies")
    assert before.returncode == 0 and "* goodput" in before.stdout
    swapped = run_ctl(
        "swap", "static", "--target", server.target, "--token-file", str(server.token_file)
    )
    assert swapped.returncode == 0 and "active: static" in swapped.stdout


def test_a_missing_token_file_only_stops_mutating_calls(make_server: Any, tmp_path: Path) -> None:
    server = make_server()
    missing = tmp_path / "no-such-token"
    env = {"NIGHTJAR_TARGET": server.target, "NIGHTJAR_TOKEN_FILE": str(missing)}
    assert run_ctl("health", env=env).stdout.strip() == "SERVING"
    assert run_ctl("policies", env=env).returncode == 0
    state = run_ctl("state", "--json", env=env)
    assert state.returncode == 0 and json.loads(state.stdout)["policy"] == "goodput"
    decide = run_ctl("decide", "--batch-size", "4", env=env)
    assert decide.returncode == 0, decide.stderr
    swap = run_ctl("swap", "static", env=env)
    assert swap.returncode == 2 and "Traceback" not in swap.stderr
    assert f"cannot read the admin token file {missing}" in swap.stderr
    assert "No such file or directory" in swap.stderr
    assert json.loads(run_ctl("state", "--json", env=env).stdout)["policy"] == "goodput"


def test_the_wrong_socket_gets_a_pointer_to_the_right_one(make_server: Any) -> None:
    server = make_server()
    memory = run_ctl("--target", server.target, "memory", "status")
    assert memory.returncode == 1
    assert (
        f"nightjarctl: {server.target} serves no MemoryAgentService (Method not found!); "
        "point --target at the engine's memory-agent socket (NIGHTJAR_MEMORY_SOCKET)"
    ) in memory.stderr
    sock_dir = Path(tempfile.mkdtemp(prefix="nj-"))
    agent_socket = sock_dir / "memory.sock"
    agent = service.serve(MemoryAgent(64, 4096, 4 * 4096), str(agent_socket))
    try:
        target = f"unix:{agent_socket}"
        state = run_ctl("--target", target, "state")
        assert state.returncode == 1
        assert f"{target} serves no AdminService" in state.stderr
        assert "point --target at the sidecar's socket (nightjar-server --uds)" in state.stderr
        decide = run_ctl("--target", target, "decide", "--batch-size", "2")
        assert f"{target} serves no PolicyService" in decide.stderr
        # The agent answers reflection under both names too.
        with grpc.insecure_channel(target) as channel:
            (listing,) = reflect_v1(
                channel, reflection_pb2.ServerReflectionRequest(list_services="")
            )
        names = {s.name for s in listing.list_services_response.service}
        assert "nightjar.v1.MemoryAgentService" in names
        assert "grpc.reflection.v1.ServerReflection" in names
    finally:
        agent.stop(grace=0).wait()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_port_0_logs_the_ports_actually_bound(make_server: Any) -> None:
    server = make_server("--port", "0", "--metrics-port", "0")
    log = server.log()
    (metrics_port,) = re.findall(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", log)
    (grpc_port,) = re.findall(r"listening on unix:\S+, 127\.0\.0\.1:(\d+) ", log)
    assert int(metrics_port) > 0 and int(grpc_port) > 0
    health = run_ctl("--target", f"127.0.0.1:{grpc_port}", "health")
    assert health.stdout.strip() == "SERVING"
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        assert "nightjar_decisions_total" in reply.read().decode()


def test_a_reader_that_goes_away_ends_output_quietly(make_server: Any) -> None:
    """`nightjarctl state | head -2`: no "[Errno 32] Broken pipe", no traceback."""
    server = make_server()
    base = [sys.executable, "-m", "policy_server.ctl", "--target", server.target]
    for command in (["state"], ["state", "--json"], ["policies"]):
        proc = subprocess.Popen(
            [*base, *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader is gone before the first line is written
        stderr = proc.stderr.read()
        assert proc.wait(timeout=60) == 141, stderr
        assert stderr == "", stderr


def test_an_engines_request_mode_reads_as_a_line() -> None:
    from policy_server.ctl import _request_mode_line

    engaged = {
        "mode": "per-request",
        "reason": "gain_above_margin",
        "gain_mean": 0.004,
        "gain_bounds": [0.003, 0.005],
        "checks": 120,
        "switches": 1,
    }
    assert _request_mode_line(engaged) == (
        "γ per request (gain_above_margin, plan gain 0.40% [0.30%, 0.50%], 120 checks, 1 switches)"
    )
    assert _request_mode_line({"mode": "batch", "reason": "forced_off"}) == (
        "γ per batch (forced_off)"
    )
