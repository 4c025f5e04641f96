"""The vLLM plugin's client over TLS and mutual TLS to a sidecar on a TCP port, against real
server processes: the settings, what a refused handshake does to the engine (fallbacks, no
exception), and a rotated certificate the server cannot use (it keeps the last good one)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2
from nightjar_proto.v1 import admin_pb2

from nightjar_common import tls
from tests.policy_server.test_security import health, mutual_tls_server, tcp_port
from tests.vllm_client_patch.test_plugin_controller import view, wait_for
from vllm_client_patch.config import PluginConfig, PluginConfigError
from vllm_client_patch.controller import GammaController
from vllm_client_patch.step_journal import VerifiedStep

# Each channel its own subchannel, so every check below makes a new TLS handshake (gRPC
# otherwise may share a connection between channels of the same target).
FRESH = [("grpc.use_local_subchannel_pool", 1)]


def tls_env(
    target: str, ca: Any, cert: Path | None = None, key: Path | None = None
) -> dict[str, str]:
    env = {"NIGHTJAR_SIDECAR": target, "NIGHTJAR_TLS_CA": str(ca.files.cert)}
    if cert is not None and key is not None:
        env |= {"NIGHTJAR_TLS_CERT": str(cert), "NIGHTJAR_TLS_KEY": str(key)}
    return env


def run_steps(controller: GammaController, steps: int) -> list[int]:
    gammas = []
    for _ in range(steps):
        gammas.append(controller.decide(view(4)))
        controller.end_step(VerifiedStep(4, 2, 3))
    return gammas


def engine_ids(server: Any) -> set[str]:
    reply = server.admin.GetState(admin_pb2.GetStateRequest(), timeout=5)  # over its socket
    return set(reply.engine_ids)


def test_plugin_decides_over_mutual_tls_and_falls_back_when_refused(make_server, pki) -> None:
    ca, client, intruder = pki["ca"], pki["client"], pki["intruder"]
    server, target = mutual_tls_server(
        make_server, pki, "--policy", "static", "--params", '{"gamma": 2}'
    )
    env = tls_env(target, ca, client.cert, client.key) | {
        "NIGHTJAR_ENGINE_ID": "tls-engine",
        "NIGHTJAR_DEADLINE_MS": "200",
    }
    config = PluginConfig.load(env)
    assert config.tls == tls.ClientTls(str(ca.files.cert), str(client.cert), str(client.key))
    controller = GammaController(config, fallback_table=((1, 64, 1),))
    try:
        wait_for(lambda: controller.client.connected, timeout=10)
        assert run_steps(controller, 5) == [2] * 5  # the sidecar's γ, not the table's 1
        stats = controller.stats()
        assert stats["sources"] == {"sidecar": 5} and stats["fallbacks_total"] == 0
        assert stats["reported"] == 4
    finally:
        controller.close()
    assert "tls-engine" in engine_ids(server)
    # A client the sidecar refuses: its handshake fails, the engine runs on the fallback
    # table and never sees an exception.
    refused = {
        "no-cert": tls_env(target, ca),
        "intruder": tls_env(target, ca, intruder.cert, intruder.key),
    }
    for engine, refused_env in refused.items():
        config = PluginConfig.load(refused_env | {"NIGHTJAR_ENGINE_ID": engine})
        controller = GammaController(config, fallback_table=((1, 64, 1),))
        try:
            assert not controller.client.wait_connected(1.0), engine
            assert run_steps(controller, 3) == [1, 1, 1], engine
            stats = controller.stats()
            assert stats["sources"] == {"fallback": 3} and stats["sidecar_decisions"] == 0
            assert stats["fallbacks"] == {"disconnected": 3}, engine
        finally:
            controller.close()
    assert engine_ids(server).isdisjoint(refused)


def test_plugin_config_takes_tls_from_the_toml_file(pki, tmp_path: Path) -> None:
    ca, client = pki["ca"], pki["client"]
    toml = tmp_path / "nightjar.toml"
    toml.write_text(
        f'[plugin]\nsidecar = "nightjar.example:50051"\ntls_ca = "{ca.files.cert}"\n'
        f'tls_cert = "{client.cert}"\ntls_key = "{client.key}"\n'
        'tls_server_name = "sidecar.internal"\n'
    )
    config = PluginConfig.load({"NIGHTJAR_CONFIG": str(toml)})
    assert config.tls == tls.ClientTls(
        str(ca.files.cert), str(client.cert), str(client.key), "sidecar.internal"
    )
    # Plaintext stays plaintext: no TLS setting, no ClientTls.
    assert PluginConfig.load({"NIGHTJAR_SIDECAR": "localhost:50051"}).tls is None


def bad_tls_settings(pki: Any, tmp_path: Path) -> list[tuple[dict[str, str], str]]:
    ca, client = str(pki["ca"].files.cert), pki["client"]
    not_pem = tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")
    unreadable = tmp_path / "missing.crt"
    tcp = {"NIGHTJAR_SIDECAR": "nightjar.example:50051"}
    return [
        (
            tcp | {"NIGHTJAR_TLS_CERT": str(client.cert)},
            "NIGHTJAR_TLS_CERT is set without NIGHTJAR_TLS_KEY",
        ),
        (
            tcp | {"NIGHTJAR_TLS_CA": ca, "NIGHTJAR_TLS_KEY": str(client.key)},
            "NIGHTJAR_TLS_KEY is set without NIGHTJAR_TLS_CERT",
        ),
        (
            {"NIGHTJAR_SIDECAR": "unix:/run/nightjar/nightjar.sock", "NIGHTJAR_TLS_CA": ca},
            "NIGHTJAR_TLS_CA set with the Unix socket NIGHTJAR_SIDECAR=unix:",
        ),
        (
            tcp | {"NIGHTJAR_TLS_CA": str(unreadable)},
            f"NIGHTJAR_TLS_CA: cannot read the CA certificate {unreadable}",
        ),
        (
            tcp
            | {
                "NIGHTJAR_TLS_CA": ca,
                "NIGHTJAR_TLS_CERT": str(not_pem),
                "NIGHTJAR_TLS_KEY": str(client.key),
            },
            f"NIGHTJAR_TLS_CERT: the client certificate {not_pem} is not a PEM file",
        ),
        (
            tcp
            | {
                "NIGHTJAR_TLS_CA": ca,
                "NIGHTJAR_TLS_CERT": str(client.cert),
                "NIGHTJAR_TLS_KEY": str(unreadable),
            },
            f"NIGHTJAR_TLS_KEY: cannot read the client key {unreadable}",
        ),
        (
            tcp | {"NIGHTJAR_TLS_SERVER_NAME": "sidecar.internal"},
            "NIGHTJAR_TLS_SERVER_NAME is set but TLS is off",
        ),
    ]


def test_bad_tls_settings_name_the_variable(pki, tmp_path: Path) -> None:
    for env, message in bad_tls_settings(pki, tmp_path):
        with pytest.raises(PluginConfigError) as err:
            PluginConfig.load(env)
        assert message in str(err.value), (env, str(err.value))
    # The files are read only while the plugin is on: NIGHTJAR_ENABLED=0 (the kill switch)
    # starts stock vLLM even with a TLS file gone.
    gone = {"NIGHTJAR_SIDECAR": "nightjar.example:50051", "NIGHTJAR_TLS_CA": "gone.crt"}
    assert not PluginConfig.load(gone | {"NIGHTJAR_ENABLED": "0"}).active


def test_a_rotated_certificate_that_cannot_be_used_keeps_the_last_good(
    make_server, pki, tmp_path: Path
) -> None:
    """tls.py's promise: a changed set that cannot be used is not served; new connections
    get the last good certificate, and a later good set is picked up."""
    ca, srv, other = pki["ca"], pki["server"], pki["other"]
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    cert.write_bytes(srv.cert.read_bytes())
    key.write_bytes(srv.key.read_bytes())
    server = make_server("--port", "0", "--tls-cert", str(cert), "--tls-key", str(key))
    target = f"localhost:{tcp_port(server)}"

    def serves_to(authority: Any) -> bool:
        files = tls.ClientTls(str(authority.files.cert))
        with tls.open_channel(target, files, FRESH) as channel:
            try:
                return health(channel) == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

    def replace(dest: Path, data: bytes) -> None:
        staged = dest.with_suffix(".new")
        staged.write_bytes(data)
        os.replace(staged, dest)  # as a rotated Secret or cert-manager does

    assert serves_to(ca) and not serves_to(other)
    # Garbage over the certificate: tls.py refuses it and says so.
    replace(cert, b"this is not a certificate\n")
    assert serves_to(ca) and not serves_to(other)
    wait_for(lambda: "TLS files changed but cannot be used" in server.log(), timeout=15)
    # A real certificate that does not match the key: refused too, and the log says why.
    renewed = other.issue("server-renewed", server=True)
    replace(cert, renewed.cert.read_bytes())
    assert serves_to(ca) and not serves_to(other)
    wait_for(lambda: "does not fit the certificate" in server.log(), timeout=15)
    assert "serving the new ones" not in server.log()
    # The matching key arrives: the renewed certificate is served from the next handshake.
    replace(key, renewed.key.read_bytes())
    wait_for(lambda: serves_to(other))
    assert not serves_to(ca)
    assert server.proc is not None and server.proc.poll() is None
