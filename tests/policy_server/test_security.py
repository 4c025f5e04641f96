"""Security of the sidecar, against real server processes: the TCP port on loopback unless
widened, TLS and mutual TLS, the admin token rotated by rewriting its file, no client-given
path outside the state directory, no allocation sized by a client."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nightjar_proto.v1 import admin_pb2

from nightjar_common import tls
from policy_server.policies import REGISTRY
from policy_server.policies.base import file_path_params
from tests.policy_server.test_server import context, outcome
from tests.rigs.sidecar import EngineStream

PREFILL_TABLE = "lag_tokens,batch_size,c_prefill_ms\n0,1,1\n0,8,2\n64,1,3\n64,8,4\n"


def tcp_port(server: Any) -> int:
    """The TCP port the server logged it listens on (it was started with --port 0)."""
    found = re.search(r"listening on .*?(\S+):(\d+)\b", server.log())
    assert found, server.log()
    return int(found.group(2))


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a listening TCP socket on ``port``, from the kernel's tables."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                # 32-bit words in host (little-endian) order; IPv4 mapped into IPv6 unmapped.
                raw = b"".join(
                    bytes.fromhex(address[i : i + 8])[::-1] for i in range(0, len(address), 8)
                )
                ip = ipaddress.ip_address(raw)
                mapped = getattr(ip, "ipv4_mapped", None)
                found.add(str(mapped or ip))
    return found


def mutual_tls_server(make_server: Any, pki: dict[str, Any], *extra: str) -> tuple[Any, str]:
    """A sidecar on a TCP port with the PKI's server certificate that admits only clients
    with a certificate of its CA (`extra`: more flags), and its target."""
    server = make_server(
        "--port",
        "0",
        "--tls-cert",
        str(pki["server"].cert),
        "--tls-key",
        str(pki["server"].key),
        "--tls-client-ca",
        str(pki["ca"].files.cert),
        *extra,
    )
    return server, f"localhost:{tcp_port(server)}"


def health(channel: grpc.Channel) -> int:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return int(reply.status)


def decide_over(channel: grpc.Channel) -> int:
    """γ of a step run from the table the sidecar sends over ``channel``."""
    with EngineStream(channel) as engine:
        return engine.decide(context("tls", 2)).gamma


def test_tcp_port_is_loopback_only_unless_widened(make_server: Any) -> None:
    server = make_server("--port", "0")
    assert listening_addresses(tcp_port(server)) == {"127.0.0.1"}
    assert "without TLS" not in server.log()
    wide = make_server("--port", "0", "--bind", "0.0.0.0", name="wide")
    assert listening_addresses(tcp_port(wide)) <= {"0.0.0.0", "::"}
    assert "without TLS: decisions and the admin token travel in the clear" in wide.log()


def test_mutual_tls_admits_only_clients_with_a_certificate_of_the_ca(
    make_server: Any, pki: Any
) -> None:
    ca, client, intruder = pki["ca"], pki["client"], pki["intruder"]
    server, target = mutual_tls_server(make_server, pki)
    assert "(TCP with mutual TLS)" in server.log()
    trusted = tls.ClientTls(str(ca.files.cert), str(client.cert), str(client.key))
    with tls.open_channel(target, trusted) as channel:
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING
        assert 0 <= decide_over(channel) <= 4
    refused = {
        "no client certificate": tls.ClientTls(str(ca.files.cert)),
        "a certificate of another CA": tls.ClientTls(
            str(ca.files.cert), str(intruder.cert), str(intruder.key)
        ),
        "plaintext": None,
    }
    for why, files in refused.items():
        with tls.open_channel(target, files) as channel, pytest.raises(grpc.RpcError) as err:
            health(channel)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, why
    # nightjarctl speaks it too, its TLS files from flags.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "policy_server.ctl",
            "--target",
            target,
            "--tls-ca",
            str(ca.files.cert),
            "--tls-cert",
            str(client.cert),
            "--tls-key",
            str(client.key),
            "state",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0 and "engines  tls" in done.stdout, done.stderr  # its table request
    plain = subprocess.run(
        [sys.executable, "-m", "policy_server.ctl", "--target", target, "--timeout", "2", "state"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr


def test_tls_from_the_config_file_and_certificate_rotation(
    make_server: Any, pki: Any, tmp_path: Path
) -> None:
    """Server TLS without client certificates, set in the TOML file; the certificate files
    replaced while it runs are served to the next connection."""
    srv, ca, other = pki["server"], pki["ca"], pki["other"]
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(srv.cert.read_bytes())
    key.write_bytes(srv.key.read_bytes())
    config = tmp_path / "server.toml"
    config.write_text(f'port = 0\ntls_cert = "{cert}"\ntls_key = "{key}"\n')
    server = make_server("--config", str(config))
    target = f"localhost:{tcp_port(server)}"
    with tls.open_channel(target, tls.ClientTls(str(ca.files.cert))) as channel:
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING
    with tls.open_channel(target, None) as channel, pytest.raises(grpc.RpcError):
        health(channel)
    # Rotation: a certificate of another CA, written beside and renamed over.
    renewed = other.issue("server-renewed", server=True)
    for source, dest in ((renewed.key, key), (renewed.cert, cert)):
        dest.with_suffix(".new").write_bytes(source.read_bytes())
        os.replace(dest.with_suffix(".new"), dest)
    with tls.open_channel(target, tls.ClientTls(str(other.files.cert))) as channel:
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING
    with (
        tls.open_channel(target, tls.ClientTls(str(ca.files.cert))) as channel,
        pytest.raises(grpc.RpcError),
    ):
        health(channel)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port", "0", "--tls-cert", "x.crt"], "needs both tls_cert and tls_key"),
        (["--port", "0", "--tls-client-ca", "ca.crt"], "needs tls_cert and tls_key as well"),
        (["--tls-cert", "x.crt", "--tls-key", "x.key"], "give --port as well"),
        (
            ["--port", "0", "--tls-cert", "missing.crt", "--tls-key", "missing.key"],
            "cannot read the TLS certificate missing.crt",
        ),
    ],
)
def test_bad_tls_settings_stop_the_start_with_a_clear_error(
    args: list[str], message: str, tmp_path: Path
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "policy_server.cli", "--uds", str(tmp_path / "s.sock"), *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


def swap(server: Any, token: str, name: str = "static") -> grpc.StatusCode:
    try:
        server.admin.SwapPolicy(
            admin_pb2.SwapPolicyRequest(name=name),
            metadata=[("authorization", f"Bearer {token}")],
            timeout=5,
        )
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_admin_token_file_is_reread_on_rotation(make_server: Any, tmp_path: Path) -> None:
    server = make_server()
    old, new, newer = "old-token-0123456789", "new-token-0123456789", "newer-token-01234567"
    server.token_file.write_text(old + "\n")  # in place
    assert swap(server, old) == grpc.StatusCode.OK
    # Rotated the Kubernetes way: another file renamed over the old one.
    staged = tmp_path / "token.new"
    staged.write_text(new + "\n")
    os.replace(staged, server.token_file)
    assert swap(server, old) == grpc.StatusCode.UNAUTHENTICATED
    assert swap(server, new, "nightjar") == grpc.StatusCode.OK
    # Rewritten in place, the same length.
    server.token_file.write_text(newer)
    assert swap(server, new) == grpc.StatusCode.UNAUTHENTICATED
    assert swap(server, newer) == grpc.StatusCode.OK
    # A placeholder refuses every mutating call (never falls back to the rotated-out token);
    # read-only calls go on.
    server.token_file.write_text("change-me")
    assert swap(server, newer, "nightjar") == grpc.StatusCode.UNAUTHENTICATED
    assert swap(server, "change-me", "nightjar") == grpc.StatusCode.UNAUTHENTICATED
    assert server.state()["policy"] == "static"
    assert "mutating admin calls are refused until it is fixed" in server.log()
    server.token_file.write_text(newer)
    assert swap(server, newer, "nightjar") == grpc.StatusCode.OK


def expect_denied(code: grpc.StatusCode, call: Any, request: Any, server: Any) -> str:
    before = server.state()
    with pytest.raises(grpc.RpcError) as err:
        call(request, metadata=server.auth, timeout=5)
    assert err.value.code() == code, err.value.details()
    assert server.state() == before
    return str(err.value.details())


def test_restore_reads_no_file_outside_the_state_directory(
    make_server: Any, tmp_path: Path
) -> None:
    server = make_server("--policy", "nightjar")
    server.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=5)
    outside = tmp_path / "outside.json"
    outside.write_text((server.state_dir / "snapshot.json").read_text())
    (server.state_dir / "link.json").symlink_to(outside)
    denied = grpc.StatusCode.PERMISSION_DENIED
    for path in (str(outside), "../outside.json", "link.json", "/etc/passwd", "/dev/zero"):
        details = expect_denied(
            denied, server.admin.Restore, admin_pb2.RestoreRequest(path=path), server
        )
        assert "outside the server's state directory" in details
    # Inside it (relative paths start there), a snapshot is restored.
    (server.state_dir / "saved.json").write_text(outside.read_text())
    for path in ("saved.json", str(server.state_dir / "saved.json")):
        reply = server.admin.Restore(
            admin_pb2.RestoreRequest(path=path), metadata=server.auth, timeout=5
        )
        assert reply.policy_name == "nightjar"


def test_path_parameters_are_confined_to_the_state_directory(
    make_server: Any, tmp_path: Path
) -> None:
    server = make_server("--policy", "nightjar")
    outside = tmp_path / "cost.csv"
    outside.write_text(PREFILL_TABLE)
    server.state_dir.mkdir(parents=True, exist_ok=True)
    (server.state_dir / "cost.csv").write_text(PREFILL_TABLE)
    denied = grpc.StatusCode.PERMISSION_DENIED
    for given in (str(outside), "../cost.csv", "/etc/passwd"):
        params = json.dumps({"prefill_cost_table": given})
        expect_denied(
            denied,
            server.admin.SwapPolicy,
            admin_pb2.SwapPolicyRequest(name="nightjar", params_json=params),
            server,
        )
        expect_denied(
            denied,
            server.admin.SetParameters,
            admin_pb2.SetParametersRequest(params_json=params),
            server,
        )
        document = {
            "format": "nightjar-snapshot/1",
            "engines": [],
            "policy": {
                "name": "nightjar",
                "params": {"prefill_cost_table": given},
                "state": {"schema": "nightjar/1", "gamma_max": 4, "engines": {}, "learners": {}},
            },
        }
        restore = admin_pb2.RestoreRequest(snapshot_json=json.dumps(document))
        expect_denied(denied, server.admin.Restore, restore, server)
    reply = server.admin.SetParameters(
        admin_pb2.SetParametersRequest(params_json='{"prefill_cost_table": "cost.csv"}'),
        metadata=server.auth,
        timeout=5,
    )
    assert reply.policy_name == "nightjar"
    table = server.state()["params"]["prefill_cost_table"]
    assert Path(table) == (server.state_dir / "cost.csv").resolve()
    # Unchanged by a later SetParameters (the merged params carry it as it is).
    server.admin.SetParameters(
        admin_pb2.SetParametersRequest(params_json='{"seed": 3}'), metadata=server.auth, timeout=5
    )
    assert server.state()["params"]["prefill_cost_table"] == table


def test_no_string_parameter_of_any_policy_reads_a_file_outside(
    make_server: Any, tmp_path: Path
) -> None:
    """Every registered policy: a readable file outside the state directory given as any of
    its string parameters is refused (a path parameter must be marked FILE_PATH)."""
    server = make_server()
    outside = tmp_path / "cost.csv"
    outside.write_text(PREFILL_TABLE)
    tried = 0
    for name, spec in REGISTRY.items():
        hints = typing.get_type_hints(spec.params_type)
        for field in dataclasses.fields(spec.params_type):
            if hints[field.name] is not str:
                continue
            params = json.dumps({field.name: str(outside)})
            code = grpc.StatusCode.PERMISSION_DENIED
            if field.name not in file_path_params(spec.params_type):
                code = grpc.StatusCode.INVALID_ARGUMENT  # not a path: its value is checked
            request = admin_pb2.SwapPolicyRequest(name=name, params_json=params)
            expect_denied(code, server.admin.SwapPolicy, request, server)
            tried += 1
    assert tried >= 2


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_no_parameter_makes_the_server_allocate_a_client_chosen_size(make_server: Any) -> None:
    """gamma_max / max_batch_size of 10^9 are refused with the state unchanged; for every
    integer parameter of every registered policy 10^9 is refused, or accepted without the
    server's memory growing and with decisions going on (a seed, a counter's period)."""
    server = make_server("--policy", "nightjar")
    assert server.proc is not None
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    for params in ({"gamma_max": 10**9}, {"max_batch_size": 10**9}):
        text = json.dumps(params)
        expect_denied(
            invalid,
            server.admin.SwapPolicy,
            admin_pb2.SwapPolicyRequest(name="nightjar", params_json=text),
            server,
        )
        expect_denied(
            invalid,
            server.admin.SetParameters,
            admin_pb2.SetParametersRequest(params_json=text),
            server,
        )
    for name, text in (
        ("table", json.dumps({"schedule": [[b, b, 1] for b in range(1, 100_001)]})),
        ("ema", json.dumps({"tiers": [[1, list(range(65)) * 1000]]})),
        ("ema", json.dumps({"tiers": [[b, [1]] for b in range(10_000)]})),
        ("ema", json.dumps({"tiers": [[1, [-5]]]})),
        ("random", '{"seed": ' + "9" * 5000 + "}"),
    ):
        expect_denied(
            invalid,
            server.admin.SwapPolicy,
            admin_pb2.SwapPolicyRequest(name=name, params_json=text),
            server,
        )
    baseline = rss_bytes(server.proc.pid)
    accepted = []
    engine = server.engine()
    for name, spec in REGISTRY.items():
        hints = typing.get_type_hints(spec.params_type)
        for field in dataclasses.fields(spec.params_type):
            if hints[field.name] is not int:
                continue
            request = admin_pb2.SwapPolicyRequest(
                name=name, params_json=json.dumps({field.name: 10**9})
            )
            try:
                server.admin.SwapPolicy(request, metadata=server.auth, timeout=30)
            except grpc.RpcError as exc:
                assert exc.code() == invalid, (name, field.name, exc.details())
                continue
            accepted.append(f"{name}.{field.name}")
            for step in range(20):  # tables and reports go on, in several contexts
                d = engine.decide(context("big", 1 + step % 8, step_index=step))
                assert engine.report(outcome(d, "big")).skipped == 0, (name, field.name)
            grown = rss_bytes(server.proc.pid) - baseline
            assert grown < 64 << 20, (name, field.name, grown)
    engine.close()
    assert "nightjar.seed" in accepted  # the check above did run for accepted sizes
