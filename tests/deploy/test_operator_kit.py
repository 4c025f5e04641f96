"""What an operator needs beyond the default deployment (issue 29): reproducible images,
a chart that can be extended, kube-prometheus-stack, more than one vLLM in a namespace,
and an admin token that GitOps does not regenerate. Manifests are rendered as in
test_deploy.py: kubectl's kustomize and Helm's Go SDK."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from kubernetes_validate import utils as k8s_schema
from nightjar_proto.v1 import admin_pb2
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from policy_server.cli import load_config, parse_args
from tests.deploy.test_deploy import (
    CHART,
    CRDS,
    DEPLOY,
    HELM_VALUES,
    KUBERNETES_VERSIONS,
    KUSTOMIZE,
    REPO,
    RIG_FLAGS,
    VARIANTS,
    container,
    crd_errors,
    documents_of,
    flags,
    helm,
    helm_render,
    kubectl,
    kustomize,
    manifests,
    normalised_pod,
    one,
    pod_spec,
)

DIGEST = "sha256:" + "0123456789abcdef" * 4


def load_module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"nightjar_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def statefulset_pod(documents: list[dict[str, Any]]) -> dict[str, Any]:
    template: dict[str, Any] = one(documents, "StatefulSet")["spec"]["template"]
    return template


# --- images: base image, locked dependencies, digests ----------------------------------------


def constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in (DEPLOY / "sidecar-constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_sidecar_constraints_pin_the_runtime_closure() -> None:
    import tomllib

    pins = constraints()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    # Every runtime dependency of pyproject.toml is pinned, at a version its floor allows.
    for text in project["dependencies"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not pinned in deploy/sidecar-constraints.txt"
        assert requirement.specifier.contains(pins[name]), (name, pins[name])
    # ... and so is everything they pull in (else pip would pick it on the day).
    lock = load_module(DEPLOY / "sidecar_lock.py")
    closure = lock.runtime_closure()
    assert set(closure) <= set(pins), set(closure) - set(pins)
    # Where this environment has the pinned version, its own requirements are pinned
    # compatibly (the pins resolve together).
    for name, version in closure.items():
        if pins[name] != version:
            continue
        for requirement in lock.requirements_of(name):
            dependency = canonicalize_name(requirement.name)
            assert requirement.specifier.contains(pins[dependency]), (name, requirement)
    # The wheel is built by the pinned setuptools, which pyproject's build floor allows.
    (setuptools,) = [r for r in _build_requires() if r.name == "setuptools"]
    assert setuptools.specifier.contains(pins["setuptools"])


def _build_requires() -> list[Requirement]:
    import tomllib

    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]
    return [Requirement(r) for r in build["requires"]]


def dockerfile_stages(name: str) -> tuple[str, list[str]]:
    """The lines before the first FROM (global ARGs) and each stage's text, with
    continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / name).read_text())
    head, *stages = re.split(r"^FROM ", text, flags=re.M)
    return head, stages


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.vllm"])
def test_dockerfiles_take_their_base_images_as_build_args(name: str) -> None:
    head, stages = dockerfile_stages(name)
    arguments = dict(re.findall(r"^ARG (\w+)=(\S+)$", head, re.M))
    # Pinned by digest (a multi-platform index); the README says how to move it.
    assert re.fullmatch(r"python:3\.11-slim@sha256:[0-9a-f]{64}", arguments["BASE_IMAGE"])
    lock = load_module(DEPLOY / "sidecar_lock.py")
    assert arguments["BASE_IMAGE"].startswith(f"python:{lock.IMAGE_PYTHON}-")
    for stage in stages:
        base = stage.split()[0]
        # Every stage starts from an ARG, so a digest given at build time reaches all.
        assert re.fullmatch(r"\$\{(\w+)\}", base), f"{name}: FROM {base} is not a build ARG"
        assert base[2:-1] in arguments
    wheel_stage = stages[0]
    assert re.search(
        r"^RUN pip install .*--constraint constraints\.txt setuptools$", wheel_stage, re.M
    )
    assert "--no-build-isolation" in wheel_stage
    assert "COPY deploy/sidecar-constraints.txt ./constraints.txt" in wheel_stage


def test_sidecar_image_installs_from_the_constraints() -> None:
    _, stages = dockerfile_stages("Dockerfile")
    final = stages[-1]
    (copied,) = re.findall(r"^COPY deploy/sidecar-constraints\.txt (\S+)$", final, re.M)
    (install,) = [r for r in re.findall(r"^RUN (.+)$", final, re.M) if "pip install" in r]
    assert f"--constraint {copied}" in install
    assert "--only-binary=:all:" in install


def run_pin_script(
    tmp_path: Path, docker_output: str, *images: str
) -> subprocess.CompletedProcess[str]:
    """deploy/pin-base-image.sh with a stand-in `docker` that answers like buildx's
    `imagetools inspect --format '{{.Manifest.Digest}}'` and records its arguments."""
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/calls"\necho "{docker_output}"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    return subprocess.run(
        ["bash", str(DEPLOY / "pin-base-image.sh"), *images],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )


def test_pin_script_prints_digest_build_args(tmp_path: Path) -> None:
    done = run_pin_script(tmp_path, DIGEST)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "--build-arg",
        f"BASE_IMAGE=python:3.11-slim@{DIGEST}",
        "--build-arg",
        f"VLLM_IMAGE=vllm/vllm-openai:v0.32.0@{DIGEST}",
    ]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0] == "buildx version"  # checked before anything else
    assert calls[1].startswith("buildx imagetools inspect python:3.11-slim --format")
    # The defaults it pins are the Dockerfiles' own.
    for name, argument in (("Dockerfile", "BASE_IMAGE"), ("Dockerfile.vllm", "VLLM_IMAGE")):
        head, _ = dockerfile_stages(name)
        (default,) = re.findall(rf"^ARG {argument}=(\S+)$", head, re.M)
        assert f"{argument}={default.split('@')[0]}@" in done.stdout
    # No digest (registry unreachable, an error page) or an already pinned image: refused.
    assert run_pin_script(tmp_path, "error: not found", "python:3.11-slim").returncode != 0
    pinned = run_pin_script(tmp_path, DIGEST, f"python:3.11-slim@{DIGEST}")
    assert pinned.returncode != 0 and "already pinned" in pinned.stderr


def readme_commands(marker: str) -> list[str]:
    """The commands of deploy/README.md's code blocks that mention ``marker``, each with
    its continuation lines (a trailing backslash or &&) joined."""
    readme = (DEPLOY / "README.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", readme, re.DOTALL):
        joined = re.sub(
            r"(\\|&&)[ \t]*(#[^\n]*)?\n\s*", lambda m: " && " if m[1] == "&&" else " ", block
        )
        commands += [line.strip() for line in joined.splitlines() if marker in line]
    return commands


def test_pinning_without_buildx_fails_loudly_and_builds_nothing(tmp_path: Path) -> None:
    """Every README command that pins base images, run where `docker` has no buildx
    (`docker buildx …` is rc 125 there): it fails with a line naming buildx, and no
    `docker build` runs from the unpinned tags."""
    fake = tmp_path / "bin" / "docker"
    fake.parent.mkdir()
    fake.write_text(
        f'#!/bin/sh\necho "$@" >> "{tmp_path}/calls"\n'
        'if [ "$1" = buildx ]; then echo "docker: \'buildx\' is not a docker command." >&2; '
        "exit 125; fi\n"
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "REGISTRY": "r.example"}
    commands = readme_commands("pin-base-image.sh")
    assert len(commands) >= 3
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", command], capture_output=True, text=True, env=env, cwd=REPO, timeout=30
        )
        assert done.returncode != 0, command
        assert "pin-base-image.sh: needs Docker with buildx" in done.stderr, done.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c for c in calls if c.split()[0] == "build"] == [], calls


def test_helm_references_images_by_digest_when_given() -> None:
    tagged, digested = helm_render(
        {},
        {
            "engine": {"image": {"repository": "registry.example/vllm-nightjar", "digest": DIGEST}},
            "sidecar": {
                "image": {"repository": "registry.example/nightjar-sidecar", "digest": DIGEST}
            },
        },
    )
    spec = statefulset_pod(tagged)["spec"]
    assert container(spec, "nightjar")["image"] == "nightjar-sidecar:0.1.0"
    spec = statefulset_pod(digested)["spec"]
    assert container(spec, "nightjar")["image"] == f"registry.example/nightjar-sidecar@{DIGEST}"
    assert container(spec, "vllm")["image"] == f"registry.example/vllm-nightjar@{DIGEST}"
    short, tag_as_digest = helm(
        [
            {"values": {"sidecar": {"image": {"digest": "sha256:abc"}}}, "lint": False},
            {"values": {"engine": {"image": {"digest": "v0.32.0"}}}, "lint": False},
        ]
    )
    assert "digest" in short["error"] and "digest" in tag_as_digest["error"]


# --- the chart's extension points -------------------------------------------------------------

EXTENDED = {
    "imagePullSecrets": [{"name": "regcred"}],
    "podAnnotations": {"example.com/scrape-logs": "true"},
    "podLabels": {"team": "inference", "app.kubernetes.io/name": "not-vllm"},
    "priorityClassName": "inference-high",
    "sidecar": {
        "extraArgs": ["--log-level=DEBUG", "--log-format=json"],
        "extraEnv": [{"name": "TZ", "value": "UTC"}],
    },
}


def test_helm_extension_values_reach_the_pod() -> None:
    default, extended = helm_render({}, EXTENDED)
    template = statefulset_pod(extended)
    spec, labels = template["spec"], template["metadata"]["labels"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["priorityClassName"] == "inference-high"
    assert template["metadata"]["annotations"] == {"example.com/scrape-logs": "true"}
    assert labels["team"] == "inference"
    # The selector labels are the chart's: a podLabels entry cannot take the pods away
    # from their StatefulSet and Services.
    assert labels["app.kubernetes.io/name"] == "vllm"
    selector = one(extended, "StatefulSet")["spec"]["selector"]["matchLabels"]
    assert selector.items() <= labels.items()
    for service in (d for d in extended if d["kind"] == "Service"):
        assert service["spec"]["selector"].items() <= labels.items()
    # The sidecar's extra flags go through nightjar-server's own parser.
    sidecar = container(spec, "nightjar")
    config = load_config(parse_args(sidecar["args"]))
    assert config.log_level == "DEBUG"
    assert config.log_format == "json"
    assert sidecar["env"] == [{"name": "TZ", "value": "UTC"}]
    for version in KUBERNETES_VERSIONS:
        k8s_schema.validate(one(extended, "StatefulSet"), version, strict=True)
    # Unset, none of them appears.
    template = statefulset_pod(default)
    assert "annotations" not in template["metadata"]
    assert not {"imagePullSecrets", "priorityClassName"} & set(template["spec"])
    assert "env" not in container(template["spec"], "nightjar")


def test_a_repeated_sidecar_flag_overrides_the_charts() -> None:
    (documents,) = helm_render({"sidecar": {"extraArgs": ['--params={"gamma_max": 3}']}})
    sidecar = container(statefulset_pod(documents)["spec"], "nightjar")
    assert load_config(parse_args(sidecar["args"])).params["gamma_max"] == 3


def schema_properties(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every property of the values schema (definitions included), with its path."""
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        for name, child in node.get("properties", {}).items():
            found.append((f"{path}.{name}", child))
        for key, child in node.items():
            found += schema_properties(child, f"{path}.{key}" if key != "properties" else path)
    elif isinstance(node, list):
        for child in node:
            found += schema_properties(child, path)
    return found


def test_every_schema_property_has_a_description() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    properties = schema_properties(schema)
    assert len(properties) > 60
    undescribed = [
        path for path, node in properties if not str(node.get("description", "")).strip()
    ]
    assert undescribed == []
    # The schema knows every key values.yaml sets (it refuses unknown ones).
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values) <= set(schema["properties"])
    for key in ("imagePullSecrets", "podAnnotations", "podLabels", "priorityClassName"):
        assert key in values
    assert {"extraArgs", "extraEnv"} <= set(values["sidecar"])


def test_schema_rejects_wrong_types_of_the_new_keys() -> None:
    wrong = [
        ({"imagePullSecrets": ["regcred"]}, "imagePullSecrets"),
        ({"podAnnotations": {"a": 1}}, "podAnnotations"),
        ({"podLabels": ["team=x"]}, "podLabels"),
        ({"priorityClassName": 5}, "priorityClassName"),
        ({"sidecar": {"extraArgs": "--log-format=json"}}, "extraArgs"),
        ({"sidecar": {"extraEnv": [{"value": "x"}]}}, "extraEnv"),
        ({"sidecar": {"extraFlags": []}}, "extraFlags"),
    ]
    results = helm([{"values": values, "lint": False} for values, _ in wrong])
    for (_, key), result in zip(wrong, results, strict=True):
        assert "error" in result, key
        assert key in result["error"], result["error"]


def test_readme_documents_the_chart_values() -> None:
    readme = (DEPLOY / "README.md").read_text()
    schema = json.loads((CHART / "values.schema.json").read_text())
    names = set(schema["properties"]) - {"global"}
    names |= {"digest", "extraArgs", "extraEnv", "existingSecret", "decisionLog", "config"}
    names |= {"configFiles", "extraVolumeMounts", "probes"}
    missing = [name for name in sorted(names) if f"`{name}`" not in readme]
    assert missing == []


def write_overlay(directory: Path, kustomization: dict[str, Any], **files: dict[str, Any]) -> Path:
    """An operator's own overlay in `directory`; paths in `resources`/`components` that
    name deploy/kubernetes directories are made relative to it (kustomize wants that)."""
    directory.mkdir(parents=True, exist_ok=True)
    for key in ("resources", "components"):
        kustomization[key] = [
            os.path.relpath(KUSTOMIZE / entry, directory) if (KUSTOMIZE / entry).is_dir() else entry
            for entry in kustomization.get(key, [])
        ]
        if not kustomization[key]:
            del kustomization[key]
    (directory / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    for name, document in files.items():
        (directory / f"{name}.yaml").write_text(yaml.safe_dump(document))
    return directory


def test_kustomize_images_by_registry_and_digest(tmp_path: Path) -> None:
    """The README's way to point the overlays at your registry, without `kustomize edit`."""
    overlay = write_overlay(
        tmp_path,
        {
            "resources": ["overlays/gpu"],
            "images": [
                {
                    "name": "vllm-nightjar",
                    "newName": "registry.example/vllm-nightjar",
                    "digest": DIGEST,
                },
                {
                    "name": "nightjar-sidecar",
                    "newName": "registry.example/nightjar-sidecar",
                    "newTag": "0.1.0",
                },
            ],
        },
    )
    spec = statefulset_pod(kustomize(overlay))["spec"]
    assert container(spec, "vllm")["image"] == f"registry.example/vllm-nightjar@{DIGEST}"
    assert container(spec, "nightjar")["image"] == "registry.example/nightjar-sidecar:0.1.0"


@pytest.mark.parametrize("overlay", sorted(p.name for p in (KUSTOMIZE / "overlays").iterdir()))
def test_overlays_say_the_images_must_be_built_first(overlay: str) -> None:
    """Applied as they are, the overlays pull placeholder images no registry has: their
    headers say to build and push, and to apply an overlay of your own."""
    header = (KUSTOMIZE / "overlays" / overlay / "kustomization.yaml").read_text()
    header = header[: header.index("apiVersion:")]
    assert "apply -k deploy/kubernetes/overlays" not in header
    assert "No image is published: build deploy/Dockerfile and deploy/Dockerfile.vllm" in (
        " ".join(line.lstrip("# ") for line in header.splitlines())
    )


# --- one deployment's selectors match its own pods only ---------------------------------------

FOREIGN_VLLM_POD = {"app.kubernetes.io/name": "vllm"}  # e.g. a plain vLLM Deployment


def selectors(documents: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Every pod (or Service) selector in the manifests, by object."""
    found: dict[str, dict[str, str]] = {}
    for d in documents:
        name, spec = f"{d['kind']}/{d['metadata']['name']}", d.get("spec", {})
        if d["kind"] == "Service":
            found[name] = spec["selector"]
        elif d["kind"] == "StatefulSet":
            found[name] = spec["selector"]["matchLabels"]
        elif d["kind"] == "NetworkPolicy":
            found[name] = spec["podSelector"]["matchLabels"]
        elif d["kind"] == "ServiceMonitor":
            found[name] = spec["selector"]["matchLabels"]
    return found


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("variant", VARIANTS)
def test_selectors_name_the_instance(variant: str) -> None:
    documents = documents_of(variant)
    pod_labels = statefulset_pod(documents)["metadata"]["labels"]
    found = selectors(documents)
    assert len(found) == 5  # StatefulSet, two Services, NetworkPolicy, ServiceMonitor
    for name, selector in found.items():
        assert "app.kubernetes.io/instance" in selector, name
        assert not matches(selector, FOREIGN_VLLM_POD | {"nightjar.io/metrics": "true"}), name
        if not name.startswith("ServiceMonitor/"):
            assert matches(selector, pod_labels), name
    metrics = [d for d in documents if d["kind"] == "Service" and "clusterIP" in d["spec"]]
    (monitor,) = [s for n, s in found.items() if n.startswith("ServiceMonitor/")]
    assert [matches(monitor, s["metadata"]["labels"]) for s in metrics] == [True]


def readme_overlay(first_line: str) -> dict[str, Any]:
    """A kustomization block of deploy/README.md (the one that starts with ``first_line``),
    its paths into deploy/kubernetes made relative to it for write_overlay."""
    readme = (DEPLOY / "README.md").read_text()
    (block,) = re.findall(rf"```yaml\n({re.escape(first_line)}\n.*?)```", readme, re.DOTALL)
    kustomization: dict[str, Any] = yaml.safe_load(block)
    for key in ("resources", "components"):
        kustomization[key] = [
            entry.removeprefix("../deploy/kubernetes/") for entry in kustomization.get(key, [])
        ]
    return kustomization


def test_a_second_deployment_in_the_same_namespace(tmp_path: Path) -> None:
    """deploy/README.md's recipe, as written: a name prefix and the instance label in one
    block, and no second copy of the rules and the dashboard. The two deployments'
    selectors each match their own pods only."""
    second = write_overlay(tmp_path / "qwen", readme_overlay("# qwen/kustomization.yaml"))
    first, other = documents_of("kustomize:gpu"), kustomize(second)
    assert not {d["metadata"]["name"] for d in first} & {d["metadata"]["name"] for d in other}
    for mine, theirs in ((first, other), (other, first)):
        my_pods = statefulset_pod(mine)["metadata"]["labels"]
        their_pods = statefulset_pod(theirs)["metadata"]["labels"]
        their_metrics = [
            d["metadata"]["labels"]
            for d in theirs
            if d["kind"] == "Service" and "clusterIP" in d["spec"]
        ]
        for name, selector in selectors(mine).items():
            assert not matches(selector, their_pods), name
            assert not any(matches(selector, labels) for labels in their_metrics), name
            if not name.startswith("ServiceMonitor/"):
                assert matches(selector, my_pods), name
    assert statefulset_pod(other)["metadata"]["labels"]["app.kubernetes.io/instance"] == "qwen"
    # One copy of the rules and the dashboard per cluster: the first deployment's.
    shipped = {"PrometheusRule", "ConfigMap"}
    assert {d["kind"] for d in first} >= shipped
    assert not [d["metadata"]["name"] for d in other if d["kind"] in shipped]
    # The StatefulSet still finds its renamed governing Service.
    (statefulset,) = [d for d in other if d["kind"] == "StatefulSet"]
    assert statefulset["spec"]["serviceName"] == "qwen-vllm-metrics"


# --- kube-prometheus-stack ---------------------------------------------------------------------


def prometheus_settings(release: str, namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": "nightjar-prometheus",
            "annotations": {"config.kubernetes.io/local-config": "true"},
        },
        "data": {"release": release, "namespace": namespace},
    }


def scraping_namespace(documents: list[dict[str, Any]]) -> str:
    policy = one(documents, "NetworkPolicy")["spec"]
    (rule,) = [r for r in policy["ingress"] if {p["port"] for p in r["ports"]} == {9464}]
    (source,) = rule["from"]
    return str(source["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"])


def test_kube_prometheus_stack_overlay() -> None:
    overlay = KUSTOMIZE / "overlays" / "gpu-kube-prometheus-stack"
    settings = yaml.safe_load((overlay / "prometheus.yaml").read_text())["data"]
    documents = kustomize(overlay)
    for kind in CRDS:
        resource = one(documents, kind)
        assert resource["metadata"]["labels"]["release"] == settings["release"]
        assert crd_errors(resource) == []
    assert scraping_namespace(documents) == settings["namespace"]
    # The settings are read by kustomize, never applied.
    assert not [d for d in documents if d["metadata"]["name"] == "nightjar-prometheus"]
    # Otherwise the pod is the gpu overlay's.
    assert statefulset_pod(documents) == statefulset_pod(documents_of("kustomize:gpu"))


def test_prometheus_release_and_namespace_are_configurable(tmp_path: Path) -> None:
    kps = write_overlay(
        tmp_path / "kps",
        {
            "resources": ["overlays/cpu", "prometheus.yaml"],
            "components": ["components/kube-prometheus-stack"],
        },
        prometheus=prometheus_settings("prom-prod", "observability"),
    )
    documents = kustomize(kps)
    assert {one(documents, kind)["metadata"]["labels"]["release"] for kind in CRDS} == {"prom-prod"}
    assert scraping_namespace(documents) == "observability"
    # Only the namespace: any Prometheus, no release label.
    namespace_only = write_overlay(
        tmp_path / "namespace",
        {
            "resources": ["overlays/cpu", "prometheus.yaml"],
            "components": ["components/monitoring-namespace"],
        },
        prometheus={
            **prometheus_settings("unused", "observability"),
            "data": {"namespace": "observability"},
        },
    )
    documents = kustomize(namespace_only)
    assert scraping_namespace(documents) == "observability"
    assert all("release" not in one(documents, kind)["metadata"]["labels"] for kind in CRDS)
    # The base's default where neither is used.
    assert scraping_namespace(documents_of("kustomize:cpu")) == "monitoring"


def test_prometheus_component_without_settings_is_refused(tmp_path: Path) -> None:
    overlay = write_overlay(
        tmp_path,
        {"resources": ["overlays/cpu"], "components": ["components/kube-prometheus-stack"]},
    )
    done = subprocess.run(
        [kubectl(), "kustomize", str(overlay)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "nightjar-prometheus" in done.stderr


def test_helm_release_label_and_monitoring_namespace() -> None:
    (documents,) = helm_render(
        {
            "metrics": {
                "serviceMonitor": {"labels": {"release": "prom-prod"}},
                "prometheusRule": {"labels": {"release": "prom-prod"}},
            },
            "networkPolicy": {"monitoringNamespace": "observability"},
        }
    )
    for kind in CRDS:
        assert one(documents, kind)["metadata"]["labels"]["release"] == "prom-prod"
    assert scraping_namespace(documents) == "observability"


# --- the admin token under helm template and GitOps ------------------------------------------


def test_existing_secret_means_no_secret_rendered() -> None:
    generated, existing = helm_render({}, {"adminToken": {"existingSecret": "nightjar-token"}})
    assert [d["metadata"]["name"] for d in generated if d["kind"] == "Secret"] == [
        "nightjar-admin-token"
    ]
    assert [d for d in existing if d["kind"] == "Secret"] == []
    spec = statefulset_pod(existing)["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "nightjar-admin-token"]
    assert volume["secret"]["secretName"] == "nightjar-token"


def test_an_upgrade_that_cannot_see_the_token_refuses_to_replace_it() -> None:
    """Rendered as an upgrade without a cluster (helm template --is-upgrade, helm upgrade
    --dry-run=client): the lookup finds no Secret, and the chart fails rather than render a
    new random token. With existingSecret the same upgrade renders."""
    generated, existing = helm(
        [
            {"values": {}, "lint": False, "options": {"is_upgrade": True}},
            {
                "values": {"adminToken": {"existingSecret": "nightjar-token"}},
                "lint": False,
                "options": {"is_upgrade": True},
            },
        ]
    )
    assert "adminToken.existingSecret" in generated["error"]
    assert "nightjar-admin-token" in generated["error"]
    assert [d for d in manifests(existing) if d["kind"] == "Secret"] == []


# --- the decision log, the configuration file, restarts (issue 55) ----------------------------


def mount_at(spec: dict[str, Any], name: str, path: str) -> str:
    """The name of the volume behind ``path`` in container ``name`` (its deepest mount)."""
    mounts = [m for m in container(spec, name)["volumeMounts"] if path.startswith(m["mountPath"])]
    assert mounts, f"{name} has no volume at {path}"
    return str(max(mounts, key=lambda m: len(m["mountPath"]))["name"])


def mounted_volume(spec: dict[str, Any], name: str, path: str) -> dict[str, Any]:
    """The pod volume behind ``path`` in container ``name``."""
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount_at(spec, name, path)]
    return dict(volume)


def with_components(directory: Path, overlay: str, *components: str) -> list[dict[str, Any]]:
    return kustomize(
        write_overlay(
            directory,
            {
                "resources": [f"overlays/{overlay}"],
                "components": [f"components/{c}" for c in components],
            },
        )
    )


def test_the_decision_log_has_a_volume_of_its_own(tmp_path: Path) -> None:
    """Chart and kustomize component: the log on its own emptyDir, sized for every rotated
    file, its size settings as flags; never on the state volume."""
    (charted,) = helm_render({**HELM_VALUES["cpu"], "sidecar": {"decisionLog": {"enabled": True}}})
    kustomized = with_components(tmp_path, "cpu", "decision-log")
    for documents in (charted, kustomized):
        spec = statefulset_pod(documents)["spec"]
        config = load_config(parse_args(container(spec, "nightjar")["args"]))
        volume = mounted_volume(spec, "nightjar", config.decision_log)
        assert volume["name"] == "nightjar-decision-log"
        assert mount_at(spec, "nightjar", config.state_dir) == "nightjar-state"
        room = (config.decision_log_backups + 1) * config.decision_log_max_bytes
        assert int(volume["emptyDir"]["sizeLimit"]) > room
        for version in KUBERNETES_VERSIONS:
            k8s_schema.validate(one(documents, "StatefulSet"), version, strict=True)
    assert normalised_pod(statefulset_pod(charted)["spec"]) == normalised_pod(
        statefulset_pod(kustomized)["spec"]
    )
    # Sizes and a volume of your own through the chart.
    (sized,) = helm_render(
        {
            "sidecar": {
                "decisionLog": {
                    "enabled": True,
                    "maxBytes": 1 << 20,
                    "backups": 2,
                    "volume": {"persistentVolumeClaim": {"claimName": "nightjar-logs"}},
                }
            }
        }
    )
    spec = statefulset_pod(sized)["spec"]
    config = load_config(parse_args(container(spec, "nightjar")["args"]))
    assert (config.decision_log_max_bytes, config.decision_log_backups) == (1 << 20, 2)
    volume = mounted_volume(spec, "nightjar", config.decision_log)
    assert volume == {
        "name": "nightjar-decision-log",
        "persistentVolumeClaim": {"claimName": "nightjar-logs"},
    }
    # No example puts it on the state volume any more.
    for document in (DEPLOY / "README.md", CHART / "values.yaml", CHART / "values.schema.json"):
        assert "/var/lib/nightjar/decisions" not in document.read_text(), document


def test_the_sidecar_warns_when_the_log_shares_the_state_volume(
    make_server: Any, tmp_path: Path
) -> None:
    inside = make_server("--decision-log", str(tmp_path / "state-in" / "d.jsonl"), name="in")
    assert inside.state_dir == tmp_path / "state-in"
    assert "is inside --state-dir" in inside.log()
    assert "give it a volume of its own" in inside.log()
    apart = make_server("--decision-log", str(tmp_path / "logs" / "d.jsonl"), name="apart")
    assert "is inside --state-dir" not in apart.log()


@pytest.mark.parametrize("variant", ["helm:gpu", "kustomize:cpu"])
def test_a_policy_swapped_at_run_time_survives_a_restart(variant: str, make_server: Any) -> None:
    """Nothing configured by default (policy "" and no params): the sidecar restarted with
    the manifest's flags restores what was swapped in, parameters and state included,
    instead of starting goodput and overwriting the snapshot with it."""
    sidecar = container(pod_spec(variant), "nightjar")
    settings = [a for a in sidecar["args"] if not a.startswith(RIG_FLAGS)]
    assert not [a for a in settings if a.startswith(("--policy", "--params"))]
    first = make_server(*settings, name="pod")
    swapped = first.admin.SwapPolicy(
        admin_pb2.SwapPolicyRequest(name="nightjar", params_json='{"gamma_max": 4, "seed": 9}'),
        metadata=first.auth,
        timeout=5,
    )
    assert swapped.policy_name == "nightjar"
    before = first.state()
    assert first.terminate() == 0  # SIGTERM: a last snapshot
    after = make_server(*settings, name="pod").state()
    assert (after["policy"], after["params"]) == ("nightjar", before["params"])
    assert after["state"] == before["state"]


EXTENDED_POD: dict[str, Any] = {
    "terminationGracePeriodSeconds": 120,
    "extraVolumes": [{"name": "tables", "configMap": {"name": "profiled-tables"}}],
    "topologySpreadConstraints": [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "nightjar"}},
        }
    ],
    "service": {"annotations": {"service.beta.kubernetes.io/aws-load-balancer-internal": "true"}},
    "serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": "vllm@p.iam"}},
    "engine": {
        "extraVolumeMounts": [{"name": "tables", "mountPath": "/tables", "readOnly": True}],
        "probes": {"startup": {"periodSeconds": 20, "failureThreshold": 180}},
    },
    "sidecar": {
        "extraVolumeMounts": [{"name": "tables", "mountPath": "/tables", "readOnly": True}],
        "probes": {"liveness": {"periodSeconds": 30, "timeoutSeconds": 8, "failureThreshold": 3}},
        "config": 'max_engines = 2048\nparams = { prefill_cost_table = "/etc/nightjar/c.csv" }\n',
        "configFiles": {"c.csv": "lag_tokens,batch_size,c_prefill_ms\n0,1,1\n0,8,2\n"},
    },
}


def test_the_charts_pod_extension_points(tmp_path: Path) -> None:
    default, extended, reconfigured = helm_render(
        {},
        EXTENDED_POD,
        {**EXTENDED_POD, "sidecar": {**EXTENDED_POD["sidecar"], "config": "max_engines = 4096\n"}},
    )
    for documents in (default, extended):
        for document in documents:
            if document["kind"] not in CRDS:
                for version in KUBERNETES_VERSIONS:
                    k8s_schema.validate(document, version, strict=True)
    template = statefulset_pod(extended)
    spec = template["spec"]
    assert spec["terminationGracePeriodSeconds"] == 120
    assert spec["topologySpreadConstraints"] == EXTENDED_POD["topologySpreadConstraints"]
    for name in ("vllm", "nightjar"):
        assert mounted_volume(spec, name, "/tables/x.csv")["configMap"] == {
            "name": "profiled-tables"
        }
    (api,) = [d for d in extended if d["kind"] == "Service" and "clusterIP" not in d["spec"]]
    assert api["metadata"]["annotations"] == EXTENDED_POD["service"]["annotations"]
    account = one(extended, "ServiceAccount")
    assert account["metadata"]["annotations"] == EXTENDED_POD["serviceAccount"]["annotations"]
    engine, sidecar = container(spec, "vllm"), container(spec, "nightjar")
    # Timing overridden key by key; the checks stay the chart's.
    assert engine["startupProbe"] == {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": 20,
        "timeoutSeconds": 5,
        "failureThreshold": 180,
    }
    assert sidecar["livenessProbe"]["exec"]["command"][0] == "nightjarctl"
    assert sidecar["livenessProbe"]["timeoutSeconds"] == 8
    # The configuration file: a ConfigMap at /etc/nightjar that nightjar-server reads.
    args = sidecar["args"]
    config_path = flags(args)["--config"]
    volume = mounted_volume(spec, "nightjar", config_path)
    (config_map,) = [d for d in extended if d["metadata"]["name"] == volume["configMap"]["name"]]
    for name, content in config_map["data"].items():
        (tmp_path / name).write_text(content)
    local = [a.replace(str(Path(config_path).parent), str(tmp_path)) for a in args]
    config = load_config(parse_args(local))
    assert config.max_engines == 2048 and config.uds == "/run/nightjar/nightjar.sock"
    assert config.params["prefill_cost_table"] == "/etc/nightjar/c.csv"
    assert (tmp_path / "c.csv").read_text() == EXTENDED_POD["sidecar"]["configFiles"]["c.csv"]
    # A changed configuration changes the pod template, so the pods roll.
    checksums = [
        statefulset_pod(d)["metadata"].get("annotations", {}).get("checksum/sidecar-config")
        for d in (default, extended, reconfigured)
    ]
    assert checksums[0] is None and None not in checksums[1:] and checksums[1] != checksums[2]
    # The defaults render none of it.
    spec = statefulset_pod(default)["spec"]
    assert "topologySpreadConstraints" not in spec and spec["terminationGracePeriodSeconds"] == 60
    assert "--config" not in flags(container(spec, "nightjar")["args"])


def test_schema_refuses_a_sidecar_probe_timeout_its_check_outlives() -> None:
    short, unknown = helm(
        [
            {"values": {"sidecar": {"probes": {"liveness": {"timeoutSeconds": 2}}}}, "lint": False},
            {"values": {"engine": {"probes": {"startup": {"exec": {}}}}}, "lint": False},
        ]
    )
    assert "timeoutSeconds" in short["error"]
    assert "exec" in unknown["error"]
