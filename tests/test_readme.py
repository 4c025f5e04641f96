"""The README's sidecar command and its `nightjarctl` block run as written, in order.

Both blocks are taken from README.md itself. Two things are changed so that they run
here: every absolute path is moved under a fresh temporary root (the token file the
block names is written there), and the fixed metrics port becomes a free one.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.rigs.sidecar import free_port

README = Path(__file__).resolve().parent.parent / "README.md"
# Every subcommand the block is meant to show an operator.
DOCUMENTED = {
    "health",
    "policies",
    "decide",
    "state",
    "swap",
    "set-params",
    "snapshot",
    "restore",
    "reset",
    "replay",
}


def bash_block(after_heading: str) -> list[str]:
    """The first ```bash block after the heading: its commands, continuations joined."""
    text = README.read_text()
    section = text[text.index(after_heading) :]
    match = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert match, f"no bash block after {after_heading!r}"
    joined = match.group(1).replace("\\\n", " ")
    return [line for line in joined.splitlines() if line.strip()]


def rooted(line: str, root: Path) -> str:
    """Absolute paths (after a space, '=' or 'unix:') moved under ``root``."""
    return re.sub(r"(?<=[\s=:])/(?=[\w.-])", f"{root}/", line)


@pytest.fixture
def root() -> Iterator[Path]:
    # Unix socket paths are limited to ~107 bytes: a short root.
    path = Path(tempfile.mkdtemp(prefix="nj-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_readme_nightjarctl_block_runs_in_order(root: Path) -> None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env = {k: v for k, v in env.items() if not k.startswith("NIGHTJAR_")}
    *preparation, server_line = bash_block("## Running the sidecar")
    for line in preparation:
        assert line.startswith("mkdir -p "), line
        subprocess.run(["bash", "-c", rooted(line, root)], check=True, timeout=10)
    server_line = rooted(server_line, root).replace(
        "--metrics-port 9464", f"--metrics-port {free_port()}"
    )
    assert server_line.startswith("nightjar-server ") and "--metrics-port 9464" not in server_line
    block = bash_block("## Operating it: `nightjarctl`")
    exports = [rooted(line, root) for line in block if line.startswith("export ")]
    commands = [line for line in block if not line.startswith("export ")]
    assert {line.split()[1] for line in commands} >= DOCUMENTED

    token_file = Path(flag_value(server_line, "--admin-token-file"))
    token_file.parent.mkdir(parents=True)
    token_file.write_text(secrets.token_hex(24) + "\n")
    assert f"NIGHTJAR_TOKEN_FILE={token_file}" in " ".join(exports)
    log = (root / "server.log").open("wb")
    server = subprocess.Popen(
        ["bash", "-c", f"exec {server_line}"],
        env=env,
        cwd=root,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_serving(flag_value(server_line, "--uds"), server)
        for line in commands:
            command = rooted(line, root)
            done = subprocess.run(
                ["bash", "-c", "\n".join([*exports, command])],
                env=env,
                cwd=root,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, f"README line failed: {line}\n{done.stdout}{done.stderr}"
            assert "nightjarctl:" not in done.stderr, f"{line}\n{done.stderr}"
            if line.startswith("nightjarctl health"):
                assert done.stdout.strip() == "SERVING"
            if line.startswith("nightjarctl restore"):
                assert "restored: goodput" in done.stdout
        # The block ends with replay + restore: what set-params set survives them.
        (set_params,) = [line for line in commands if line.startswith("nightjarctl set-params")]
        wanted = json.loads(re.findall(r"'(\{.*?\})'", set_params)[0])
        state = subprocess.run(
            ["bash", "-c", "\n".join([*exports, "nightjarctl state --json"])],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=60,
        )
        params = json.loads(state.stdout)["params"]
        assert {k: params[k] for k in wanted} == wanted, params
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=15) == 0, (root / "server.log").read_text()
        log.close()


def flag_value(command: str, flag: str) -> str:
    match = re.search(rf"{flag} (\S+)", command)
    assert match, f"{flag} is not in the README's command {command!r}"
    return match.group(1)


def wait_serving(socket_path: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 20
    with grpc.insecure_channel(f"unix:{socket_path}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert server.poll() is None, "the README's nightjar-server exited"
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                time.sleep(0.05)
    raise AssertionError("the README's nightjar-server did not become healthy")
