"""The fleet link (policy_server/fleet_link.py) against a real redis-server: sidecars'
decision services pool through it, keep deciding and learning when Redis is down, slow
or full, refuse garbage, and keep deployments apart."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from nightjar_common.errors import ConfigError
from policy_server.cli import load_config, parse_args
from policy_server.fleet_link import (
    FleetConfigError,
    FleetLink,
    FleetOptions,
    connect,
)
from policy_server.metrics import Metrics
from policy_server.service import DecisionService
from tests.policy_server.policies.test_fleet_stats import LEARNER, _run
from tests.rigs.redis_server import RedisRig


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[RedisRig]:
    with RedisRig(tmp_path / "redis") as server:
        yield server


def _sidecar(url: str, member: str, policy: str = "goodput", **options: Any) -> FleetLink:
    metrics = Metrics()
    service = DecisionService(policy, metrics=metrics)
    settings = {"url": url, "member": member, "interval_s": 0.2, "ttl_s": 30.0, **options}
    return FleetLink(service, FleetOptions.parse(settings), metrics)


def _text(value: Any) -> str:
    assert isinstance(value, bytes), value
    return value.decode()


def _learner(link: FleetLink) -> Any:
    return link.service.active.policy._book.learners[LEARNER]


def _sample(link: FleetLink, name: str, **labels: str) -> float:
    value = link.service.metrics.registry.get_sample_value(name, labels or None)
    assert value is not None, name
    return float(value)


def test_sidecars_pool_through_redis_and_count_each_step_once(rig: RedisRig) -> None:
    a, b = _sidecar(rig.url, "a"), _sidecar(rig.url, "b")
    _run(a.service.active.policy, "ea", 200, seed=1, alpha=0.8)
    assert a.round().published == 1
    report = b.round()  # b holds no learner yet: it gets a's, warm before its first step
    assert report.ok and sorted(report.members) == ["a", "b"]
    assert _learner(b).steps == 200
    for _ in range(3):  # again and again: nothing is added twice
        a.round()
        b.round()
    assert _learner(a).steps == _learner(b).steps == 200
    local, fleet = b.service.active.policy.evidence(LEARNER)
    assert (local["steps"], fleet["steps"]) == (0, 200)
    _run(b.service.active.policy, "eb", 50, seed=2, alpha=0.8)
    b.round()
    a.round()
    assert _learner(a).steps == _learner(b).steps == 250
    assert _sample(a, "nightjar_fleet_members") == 2
    assert _sample(a, "nightjar_fleet_link_up") == 1
    assert _sample(a, "nightjar_fleet_evidence_steps", source="local") == 200
    assert _sample(a, "nightjar_fleet_evidence_steps", source="fleet") == 50
    # Only learned statistics are stored: one record per member and learner key.
    client = rig.client()
    keys = sorted(_text(k) for k in client.keys("*"))
    scope = a.service.active.policy.pool_scope
    assert keys == [
        f"nightjar:default:{scope}:member:a",
        f"nightjar:default:{scope}:member:b",
        f"nightjar:default:{scope}:members",
    ]
    record = json.loads(_text(client.hget(keys[0], LEARNER)))
    assert set(record) == {"format", "scope", "member", "learner", "published_unix", "stats"}


def test_a_restart_under_its_member_id_replaces_its_record(rig: RedisRig) -> None:
    a, b = _sidecar(rig.url, "a"), _sidecar(rig.url, "b")
    _run(a.service.active.policy, "ea", 120, seed=3, alpha=0.7)
    a.round()
    b.round()
    snapshot = a.service.active.policy.state()
    restarted = _sidecar(rig.url, "a")
    restarted.service.active.policy.load_state(json.loads(json.dumps(snapshot)))
    restarted.round()
    b.round()
    assert _learner(b).steps == 120


def test_deployments_do_not_pool(rig: RedisRig) -> None:
    a = _sidecar(rig.url, "a")
    other = _sidecar(rig.url, "x", deployment="staging")
    _run(a.service.active.policy, "ea", 60, seed=4, alpha=0.7)
    a.round()
    assert other.round().members == ["x"]
    assert LEARNER not in other.service.active.policy._book.learners


def test_garbage_in_redis_is_refused_with_its_reason(rig: RedisRig) -> None:
    a, b = _sidecar(rig.url, "a"), _sidecar(rig.url, "b")
    _run(a.service.active.policy, "ea", 80, seed=5, alpha=0.7)
    a.round()
    scope = a.service.active.policy.pool_scope
    prefix = f"nightjar:default:{scope}"
    good = json.loads(_text(rig.client().hget(f"{prefix}:member:a", LEARNER)))

    def signed(reason: str, **changes: Any) -> str:
        return json.dumps({**good, "member": f"evil-{reason}", **changes})

    bad: dict[str, str | bytes] = {
        "json": b"{not json",
        "format": signed("format", format="other/1"),
        "scope": signed("scope", scope="goodput/x"),
        "member": json.dumps(good),  # a's record under another member's name
        "stats": signed("stats", stats={**good["stats"], "steps": -3}),
        "size": b"x" * (2 << 20),
    }
    client = rig.client()
    for reason, value in bad.items():
        member = f"evil-{reason}"
        client.zadd(f"{prefix}:members", {member: 4e9})
        # Each under the learner's own field, so only the content is wrong.
        client.hset(f"{prefix}:member:{member}", LEARNER, value)
    report = b.round()
    assert report.ok
    assert report.rejected == {reason: 1 for reason in bad}
    assert _learner(b).steps == 80  # a's evidence, none of the garbage
    for reason in bad:
        assert _sample(b, "nightjar_fleet_rejected_total", reason=reason) == 1


def test_redis_down_then_back_costs_nothing_but_the_fleet(rig: RedisRig) -> None:
    a, b = _sidecar(rig.url, "a"), _sidecar(rig.url, "b")
    _run(a.service.active.policy, "ea", 100, seed=6, alpha=0.8)
    a.round()
    b.round()
    rig.kill9()
    report = b.round()
    assert not report.ok
    assert _sample(b, "nightjar_fleet_link_up") == 0
    assert _sample(b, "nightjar_fleet_errors_total", operation="publish") == 1
    # Local learning goes on, on top of what the fleet gave.
    _run(b.service.active.policy, "eb", 30, seed=7, alpha=0.8)
    assert _learner(b).steps == 130
    rig.start()  # an empty Redis on the same port: the client reconnects by itself
    assert b.round().ok
    assert a.round().ok
    assert _sample(b, "nightjar_fleet_link_up") == 1
    assert _learner(a).steps == 130


def test_a_redis_that_never_answers_never_holds_a_learner(tmp_path: Path) -> None:
    """A stalled Redis holds the link's thread until its timeout; no learner's lock is held
    meanwhile, so no decision waits for it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    connected = threading.Event()
    accepted: list[socket.socket] = []

    def accept() -> None:
        conn, _ = listener.accept()
        accepted.append(conn)
        connected.set()

    threading.Thread(target=accept, daemon=True).start()
    link = _sidecar(f"redis://127.0.0.1:{port}/0", "a", timeout_s=2.0)
    _run(link.service.active.policy, "ea", 40, seed=8, alpha=0.8)
    reports: list[Any] = []
    worker = threading.Thread(target=lambda: reports.append(link.round()))
    worker.start()
    assert connected.wait(10)
    lock = link.service.activation.learner_locks.of(LEARNER)
    assert lock.acquire(blocking=False)  # the round holds no learner's lock meanwhile
    lock.release()
    worker.join(30)
    assert reports and not reports[0].ok
    listener.close()
    for conn in accepted:
        conn.close()


def test_a_full_redis_is_a_failed_publish_not_a_failure_of_the_sidecar(tmp_path: Path) -> None:
    with RedisRig(tmp_path / "full", maxmemory="1mb") as rig:
        filler = rig.client()
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(10_000):
                filler.set(f"fill:{i}", "x" * 1000)
        link = _sidecar(rig.url, "a")
        _run(link.service.active.policy, "ea", 40, seed=9, alpha=0.8)
        assert not link.round().ok
        assert _sample(link, "nightjar_fleet_errors_total", operation="publish") == 1
        assert _learner(link).steps == 40


def test_a_policy_that_cannot_pool_says_so_and_writes_nothing(rig: RedisRig) -> None:
    link = _sidecar(rig.url, "a", policy="nightjar")
    link._last_merge = -1e9  # as if the last merge were long ago
    assert link.round().published == 0
    assert _sample(link, "nightjar_fleet_poolable") == 0
    assert rig.client().keys("*") == []
    # Nothing to merge is not a link that is down: the age starts again.
    assert _sample(link, "nightjar_fleet_last_merge_age_seconds") < 1e8


def test_the_password_comes_from_its_file(tmp_path: Path) -> None:
    with RedisRig(tmp_path / "auth", password="pa55") as rig:
        secret = tmp_path / "redis-password"
        secret.write_text("pa55\n")
        link = _sidecar(rig.url, "a", password_file=str(secret))
        assert link.round().ok
        secret.write_text("wrong\n")
        link.client.connection_pool.disconnect()  # a new connection reads the file again
        assert not link.round().ok


@pytest.mark.parametrize(
    "settings",
    [
        {"url": "http://redis:6379"},
        {"url": "redis://r:6379", "tls_ca": "/ca.pem"},
        {"url": "rediss://r:6379", "tls_cert": "/c.pem"},
        {"url": "redis://r:6379", "deployment": "a b"},
        {"url": "redis://r:6379", "interval_s": 10, "ttl_s": 5},
        {"url": "redis://r:6379", "bogus": 1},
    ],
)
def test_settings_that_do_not_fit_are_refused(settings: dict[str, Any]) -> None:
    with pytest.raises(FleetConfigError):
        FleetOptions.parse(settings)


def test_a_password_in_both_places_is_refused() -> None:
    with pytest.raises(FleetConfigError, match="not both"):
        FleetOptions.parse({"url": "redis://u:p@r:6379", "password_file": "/p"})


def test_the_password_file_keeps_the_urls_user_name(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("pw\n")
    options = FleetOptions.parse({"url": "redis://nightjar@r:6379/0", "password_file": str(secret)})
    provider = connect(options).connection_pool.connection_kwargs["credential_provider"]
    assert provider.get_credentials() == ("nightjar", "pw")


def test_the_config_files_fleet_table_and_flags_merge_key_by_key(tmp_path: Path) -> None:
    config = tmp_path / "nightjar.toml"
    socket = tmp_path / "x.sock"
    config.write_text(
        f'uds = "{socket}"\n[fleet]\nurl = "redis://r:6379/0"\ndeployment = "llama"\n'
        "interval_s = 2.0\n"
    )
    args = parse_args(["--config", str(config), "--fleet-deployment", "llama-canary"])
    options = FleetOptions.parse(load_config(args).fleet)
    assert (options.url, options.deployment, options.interval_s) == (
        "redis://r:6379/0",
        "llama-canary",
        2.0,
    )
    with pytest.raises(ConfigError, match="fleet"):
        load_config(parse_args(["--uds", str(socket), "--fleet", "http://r"]))


def test_mutual_tls_to_redis(tmp_path: Path, pki: dict[str, Any]) -> None:
    """rediss:// with the CA that verifies Redis and a client certificate of the CA Redis
    trusts; without the certificate, or with another CA's, the round fails (fail-open)."""
    with RedisRig(tmp_path / "tls", tls=pki) as rig:
        ca = str(pki["ca"].files.cert)
        client, intruder = pki["client"], pki["intruder"]
        good = _sidecar(rig.url, "a", tls_ca=ca, tls_cert=str(client.cert), tls_key=str(client.key))
        _run(good.service.active.policy, "ea", 30, seed=11, alpha=0.8)
        assert good.round().ok
        stranger = _sidecar(
            rig.url, "b", tls_ca=ca, tls_cert=str(intruder.cert), tls_key=str(intruder.key)
        )
        assert not stranger.round().ok
        anonymous = _sidecar(rig.url, "c", tls_ca=ca)
        assert not anonymous.round().ok
        assert [
            _text(m)
            for m in rig.client().zrange(
                f"nightjar:default:{good.service.active.policy.pool_scope}:members", 0, -1
            )
        ] == ["a"]
