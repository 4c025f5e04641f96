"""Fleet learning in the Kubernetes kit: the kustomize components (components/fleet,
components/redis) and the chart's sidecar.fleet and redis values render manifests that
the schemas accept, whose sidecar flags the sidecar's own parser takes, with the Redis
password from a Secret and the optional Redis reachable from the engine pods only."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as k8s_schema

from policy_server.cli import load_config, parse_args
from policy_server.fleet_link import FleetOptions
from tests.deploy.test_deploy import (
    KUBERNETES_VERSIONS,
    KUSTOMIZE,
    container,
    helm,
    helm_render,
    kustomize,
    one,
)


def with_env(args: list[str], env: dict[str, str]) -> list[str]:
    """``args`` as the kubelet expands them: $(NAME) from the container's env."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in args]


def config_maps(documents: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["data"] for d in documents if d["kind"] == "ConfigMap"}


def env_values(sidecar: dict[str, Any], documents: list[dict[str, Any]]) -> dict[str, str]:
    maps = config_maps(documents)
    values = {}
    for var in sidecar.get("env", []):
        ref = var["valueFrom"]["configMapKeyRef"]
        values[var["name"]] = maps[ref["name"]][ref["key"]]
    return values


def sidecar_of(documents: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = one(documents, "StatefulSet")["spec"]["template"]["spec"]
    return spec, container(spec, "nightjar")


def fleet_options(sidecar: dict[str, Any], documents: list[dict[str, Any]]) -> FleetOptions:
    args = with_env(sidecar["args"], env_values(sidecar, documents))
    return FleetOptions.parse(load_config(parse_args(args)).fleet)


def mounted_secret(spec: dict[str, Any], sidecar: dict[str, Any], path: str) -> str:
    """The Secret whose file the sidecar reads at ``path``."""
    for mount in sidecar["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/"):
            volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
            (item,) = volume["secret"]["items"]
            assert path == f"{mount['mountPath']}/{item['path']}"
            return str(volume["secret"]["secretName"])
    raise AssertionError(f"nothing mounted at {path}")


def validate(documents: list[dict[str, Any]]) -> None:
    for document in documents:
        if document["kind"] in ("ServiceMonitor", "PrometheusRule"):
            continue
        for version in KUBERNETES_VERSIONS:
            k8s_schema.validate(document, version, strict=True)


def check_redis(documents: list[dict[str, Any]], name: str) -> None:
    """The quick-start Redis: no persistence, its password from the Secret, reachable by
    the engine pods only."""
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    assert deployment["metadata"]["name"] == name
    redis = container(deployment["spec"]["template"]["spec"], "redis")
    assert "--save ''" in redis["args"][0] and "--requirepass" in redis["args"][0]
    assert redis["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "nightjar-redis"
    policy = next(
        d for d in documents if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == name
    )
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "vllm"
    service = next(d for d in documents if d["kind"] == "Service" and d["metadata"]["name"] == name)
    assert service["spec"]["ports"][0]["port"] == 6379


def test_kustomize_components_pool_through_redis(tmp_path: Path) -> None:
    components = [KUSTOMIZE / "components" / c for c in ("fleet", "redis")]
    overlay = {
        "resources": [os.path.relpath(KUSTOMIZE / "overlays" / "cpu", tmp_path)],
        "components": [os.path.relpath(c, tmp_path) for c in components],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    documents = kustomize(tmp_path)
    validate(documents)
    spec, sidecar = sidecar_of(documents)
    options = fleet_options(sidecar, documents)
    assert options.url == "redis://nightjar-redis:6379/0"
    assert options.deployment == "nightjar"
    assert options.member == ""  # the pod's name: its host name
    assert mounted_secret(spec, sidecar, options.password_file) == "nightjar-redis"
    check_redis(documents, "nightjar-redis")
    # No Secret is shipped: the operator makes the password.
    assert not [d for d in documents if d["kind"] == "Secret"]


def test_the_chart_pools_through_its_redis_or_yours() -> None:
    off, own, yours = helm_render(
        {},
        {
            "redis": {"enabled": True},
            "sidecar": {"fleet": {"passwordSecret": {"name": "nightjar-redis"}}},
        },
        {
            "sidecar": {
                "fleet": {
                    "url": "rediss://redis.example:6380/0",
                    "deployment": "llama-8b",
                    "tlsCASecret": "redis-ca",
                    "intervalSeconds": 2,
                    "ttlSeconds": 30,
                }
            }
        },
    )
    assert not [a for a in sidecar_of(off)[1]["args"] if a.startswith("--fleet")]
    assert not [d for d in off if "redis" in d["metadata"]["name"]]
    for documents in (own, yours):
        validate(documents)
    spec, sidecar = sidecar_of(own)
    options = fleet_options(sidecar, own)
    assert options.url == "redis://nightjar-redis:6379/0"
    assert options.deployment == "llm.nightjar"
    assert mounted_secret(spec, sidecar, options.password_file) == "nightjar-redis"
    check_redis(own, "nightjar-redis")
    spec, sidecar = sidecar_of(yours)
    options = fleet_options(sidecar, yours)
    assert (options.url, options.deployment) == ("rediss://redis.example:6380/0", "llama-8b")
    assert (options.interval_s, options.ttl_s, options.password_file) == (2.0, 30.0, "")
    assert mounted_secret(spec, sidecar, options.tls_ca) == "redis-ca"
    assert not [d for d in yours if d["kind"] == "Deployment"]


@pytest.mark.parametrize(
    "fleet",
    [{"url": "http://redis:6379"}, {"deployment": "a b"}, {"urll": "redis://r"}],
)
def test_the_chart_refuses_fleet_values_that_do_not_fit(fleet: dict[str, Any]) -> None:
    (reply,) = helm([{"values": {"sidecar": {"fleet": fleet}}, "lint": False}])
    assert "error" in reply


def test_the_chart_with_redis_lints_clean() -> None:
    (report,) = helm([{"values": {"redis": {"enabled": True}}, "lint": True}])
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []
