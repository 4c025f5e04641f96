"""Fleet learning between real sidecar processes through a real redis-server (issue 56):
a new sidecar starts from the fleet's learning, a restart counts nothing twice, Redis
killed mid-run stops no decision nor local learning and pooling resumes when it is back,
and garbage in Redis is refused."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nightjar_common import wire
from nightjar_common.client import ClientConfig, NightjarClient
from nightjar_common.types import StepContext
from tests.policy_server.test_fleet import KEY, ctl, serve_steps
from tests.rigs.redis_server import RedisRig

LEARNER = f"shared:{KEY}"
pytestmark = pytest.mark.slow


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[RedisRig]:
    with RedisRig(tmp_path / "redis") as server:
        yield server


def fleet(rig: RedisRig, member: str) -> tuple[str, ...]:
    return (
        "--fleet",
        rig.url,
        "--fleet-member",
        member,
        "--fleet-interval-s",
        "0.2",
        "--fleet-ttl-s",
        "30",
    )


def wait_for(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def learner(server: Any) -> dict[str, Any]:
    learned: dict[str, Any] = server.state()["state"]["learners"].get(LEARNER, {})
    return learned


def steps(server: Any) -> int:
    return int(learner(server).get("steps", 0))


def metric(server: Any, name: str, **labels: str) -> float:
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no {name}{labels} in /metrics")


def probe(server: Any, batches: tuple[int, ...]) -> list[int]:
    """The γ a new engine is decided at each batch size, one step each (not reported)."""
    gammas = []
    with server.engine() as stream:
        for index, batch in enumerate(batches):
            ctx = StepContext(
                "probe",
                batch,
                step_index=index,
                max_gamma=4,
                learner_key=KEY,
                context_tokens=500 * batch,
            )
            gammas.append(stream.decide(wire.context_to_pb(ctx)).gamma)
    return gammas


def rounds(server: Any) -> float:
    return metric(server, "nightjar_fleet_round_seconds_count")


def after_rounds(servers: list[Any], count: int = 3) -> None:
    """Until each of ``servers`` has merged ``count`` more times."""
    start = [rounds(s) for s in servers]
    wait_for(
        lambda: all(rounds(s) >= n + count for s, n in zip(servers, start, strict=True)),
        f"{count} fleet rounds",
    )


def test_a_new_sidecar_starts_warm_and_a_restart_counts_nothing_twice(
    make_server: Any, rig: RedisRig
) -> None:
    a = make_server(*fleet(rig, "a"), name="a")
    b = make_server(*fleet(rig, "b"), name="b")
    serve_steps(a, "pod-a", 60)
    serve_steps(b, "pod-b", 40)
    wait_for(lambda: steps(a) == steps(b) == 100, "a and b to pool their 100 steps")
    c = make_server(*fleet(rig, "c"), name="c")
    # Before any engine of c asks: its learner is the fleet's, not the prior.
    wait_for(lambda: steps(c) == 100, "c to merge the fleet's learning")
    warm, new = learner(a), learner(c)
    # The same evidence (a's prior has decayed, c's not: a few pseudo-tokens apart).
    gram = np.array(new["step_time"]["gram"])
    np.testing.assert_allclose(gram, np.array(warm["step_time"]["gram"]), rtol=1e-9)
    assert new["alpha"] == pytest.approx(warm["alpha"], rel=0.01)
    assert new["fleet"]["evidence"]["fleet"]["steps"] == 100
    assert new["fleet"]["evidence"]["local"]["steps"] == 0
    assert metric(c, "nightjar_fleet_members") == 3
    shown = ctl(c, "state")
    assert shown.returncode == 0, shown.stderr
    assert "  evidence: local 0 steps, 0 acceptance tokens; fleet 100 steps" in shown.stdout
    assert "fleet    member c of deployment default: link up, 3 members" in shown.stdout
    # c's first decisions are a warm sidecar's (a new engine of the same id on each: the
    # same random stream), not the prior table's.
    batches = (1, 8, 32, 64)
    first = {server.uds: probe(server, batches) for server in (a, c)}
    assert first[c.uds] == first[a.uds]
    assert first[c.uds] != [3, 3, 0, 0]  # the prior table (vLLM's dynamic-SD shape)

    # a restarts (SIGTERM: a snapshot; the same state directory and member id).
    a.terminate()
    a = make_server(*fleet(rig, "a"), name="a")
    assert learner(a)["fleet"]["member"] == "a"
    after_rounds([a, b, c])
    assert steps(a) == steps(b) == steps(c) == 100
    assert learner(b)["fleet"]["evidence"]["fleet"]["steps"] == 60


def test_redis_killed_mid_run_stops_no_decision_and_pooling_resumes(
    make_server: Any, rig: RedisRig
) -> None:
    a = make_server(*fleet(rig, "a"), name="a")
    b = make_server(*fleet(rig, "b"), name="b")
    serve_steps(a, "pod-a", 40)
    wait_for(lambda: steps(b) == 40, "b to pool a's steps")
    rig.kill9()
    wait_for(lambda: metric(a, "nightjar_fleet_link_up") == 0, "a to see the link down")
    down = json.loads(ctl(a, "state", "--json").stdout)["fleet"]
    assert (down["member"], down["link_up"]) == ("a", False)
    # Every step is decided and learned from (serve_steps checks each outcome is taken).
    decisions = serve_steps(a, "pod-a", 40)
    assert len(decisions) == 40
    assert steps(a) == 80
    assert steps(b) == 40
    assert metric(a, "nightjar_fleet_errors_total", operation="publish") >= 1
    rig.start()  # empty, on the same port: both reconnect by themselves
    wait_for(lambda: steps(b) == 80, "b to pool a's steps again")
    assert metric(a, "nightjar_fleet_link_up") == metric(b, "nightjar_fleet_link_up") == 1


def test_garbage_in_redis_is_refused_and_counted(make_server: Any, rig: RedisRig) -> None:
    a = make_server(*fleet(rig, "a"), name="a")
    serve_steps(a, "pod-a", 20)
    wait_for(lambda: rig.client().keys("nightjar:default:*:member:a") != [], "a to publish")
    (key,) = rig.client().keys("nightjar:default:*:member:a")
    assert isinstance(key, bytes)
    prefix = key.decode().rpartition(":member:")[0]
    stored = rig.client().hget(key, LEARNER)
    assert isinstance(stored, bytes)
    record = json.loads(stored)
    record["member"] = "mallory"
    record["stats"]["gram"][0][0] = "NaN"
    client = rig.client()
    client.zadd(f"{prefix}:members", {"mallory": time.time() + 3600})
    client.hset(f"{prefix}:member:mallory", LEARNER, json.dumps(record))
    wait_for(
        lambda: metric(a, "nightjar_fleet_rejected_total", reason="stats") >= 1,
        "a to refuse mallory's record",
    )
    assert steps(a) == 20
    assert "fleet record of member 'mallory' refused (stats)" in a.log()


def test_a_hung_redis_delays_no_decision(make_server: Any, rig: RedisRig) -> None:
    """Redis stopped (SIGSTOP) for longer than the link's call timeout, while an engine's
    client asks for a new table every step (its batch jumps out of the held one) with a
    deadline: not one step falls back, before, during or after, and the link counts
    its failed round."""
    a = make_server(*fleet(rig, "a"), name="a")
    serve_steps(a, "pod-a", 8)  # a learner to publish and merge
    client = NightjarClient(
        ClientConfig(target=a.target, engine_id="pod-q", deadline_s=0.5, connect_timeout_s=10)
    )
    try:
        asked = 0

        def run(steps: int) -> None:
            nonlocal asked
            for _ in range(steps):
                batch = (2, 64)[asked % 2]  # every step outside the held table
                decided = client.decide(
                    StepContext("pod-q", batch, step_index=asked, learner_key=KEY)
                )
                assert decided.source == "sidecar", decided
                asked += 1

        run(10)
        rig.pause()
        try:
            stalled_until = time.monotonic() + 5.0  # > the link's 2 s call timeout
            while time.monotonic() < stalled_until:
                run(5)
        finally:
            rig.resume()
        failed = "a failed round"
        wait_for(lambda: metric(a, "nightjar_fleet_errors_total", operation="publish") >= 1, failed)
        run(10)
        assert client.stats.fallbacks_total == 0
    finally:
        client.close()
