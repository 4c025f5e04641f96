"""The Kubernetes kit (deploy/kubernetes, deploy/helm): every overlay rendered by kubectl's
kustomize and the chart rendered by Helm's own Go SDK, each manifest validated against the
schemas of Kubernetes 1.37 (current) and 1.29 (the first with native sidecars on by
default) and the prometheus-operator CRDs, and every setting in it loaded through the
sidecar's, nightjarctl's and the plugin's own parsers (a JSON flag that YAML mangles would
otherwise only fail in a cluster)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import urllib.request
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from cloudcoil.models.prometheus_operator import v1 as prometheus_operator
from kubernetes_validate import utils as k8s_schema

from nightjar_common.admin_token import token_problem
from policy_server import __version__
from policy_server.cli import load_config, parse_args
from policy_server.ctl import build_parser as ctl_parser
from policy_server.memory import MemoryParams
from policy_server.policies import create_policy
from policy_server.policies.base import parse_params
from vllm_client_patch.config import PluginConfig
from vllm_client_patch.release import SUPPORTED

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUSTOMIZE = DEPLOY / "kubernetes"
CHART = DEPLOY / "helm" / "nightjar"
KUBERNETES_VERSIONS = ("1.29", "1.37")

# What is deployed: each kustomize overlay and the chart's equivalent values.
OVERLAYS = ("gpu", "gpu-elastic-memory", "cpu")
HELM_VALUES: dict[str, dict[str, Any]] = {
    "gpu": {},
    "gpu-elastic-memory": {"elasticMemory": {"enabled": True}},
    "cpu": yaml.safe_load((CHART / "values-cpu.yaml").read_text()),
}
VARIANTS = [f"kustomize:{o}" for o in OVERLAYS] + [f"helm:{o}" for o in HELM_VALUES]
CRDS = {"ServiceMonitor", "PrometheusRule"}


def kubectl() -> str:
    """The kubectl the k8s extra installs next to this interpreter (a pinned, current
    kustomize), else the machine's."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: `make test` installs it (pyproject extra k8s)")
    return found


def kustomize(directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run(
        [kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


# Helm's Go SDK runs in a child process: loading it starts Go runtime threads, which the
# rest of the suite (forking vLLM tests among them) should not inherit.
HELM_CHILD = """
import json, sys
from helm_python import chart
chart_dir, requests = sys.argv[1], json.load(sys.stdin)
out = []
for request in requests:
    if request["lint"]:
        out.append(chart.lint(chart_dir, request["values"], strict=True,
                              kube_version="v1.37.0"))
        continue
    try:
        out.append(chart.Chart.load(chart_dir).render(request["values"], name="nightjar",
                                                      namespace="llm",
                                                      **request.get("options", {})))
    except Exception as exc:  # the values' schema or a template refused them
        out.append({"error": f"{type(exc).__name__}: {exc}"})
json.dump(out, sys.stdout)
"""


def helm(requests: list[dict[str, Any]]) -> list[Any]:
    done = subprocess.run(
        [sys.executable, "-c", HELM_CHILD, str(CHART)],
        input=json.dumps(requests),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    results: list[Any] = json.loads(done.stdout)
    return results


def manifests(rendered: dict[str, str]) -> list[dict[str, Any]]:
    assert "error" not in rendered, rendered.get("error")
    documents: list[dict[str, Any]] = []
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            documents += [d for d in yaml.safe_load_all(text) if d]
    return documents


def helm_render(*values: dict[str, Any]) -> list[list[dict[str, Any]]]:
    return [manifests(r) for r in helm([{"values": v, "lint": False} for v in values])]


@cache
def helm_variants() -> dict[str, list[dict[str, Any]]]:
    return dict(zip(HELM_VALUES, helm_render(*HELM_VALUES.values()), strict=True))


@cache
def rendered(variant: str) -> tuple[dict[str, Any], ...]:
    tool, name = variant.split(":")
    documents = (
        kustomize(KUSTOMIZE / "overlays" / name) if tool == "kustomize" else (helm_variants()[name])
    )
    return tuple(documents)


def documents_of(variant: str) -> list[dict[str, Any]]:
    return copy.deepcopy(list(rendered(variant)))


def one(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (document,) = [d for d in documents if d["kind"] == kind]
    return document


def pod_spec(variant: str) -> dict[str, Any]:
    spec: dict[str, Any] = one(documents_of(variant), "StatefulSet")["spec"]["template"]["spec"]
    return spec


def container(spec: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == name]
    return found


def flags(args: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)


def env_of(engine: dict[str, Any]) -> dict[str, Any]:
    return {item["name"]: item.get("value", item.get("valueFrom")) for item in engine["env"]}


def plugin_config(engine: dict[str, Any]) -> PluginConfig:
    env = {k: v if isinstance(v, str) else "from-the-pod" for k, v in env_of(engine).items()}
    return PluginConfig.load({k: v for k, v in env.items() if k.startswith("NIGHTJAR_")})


def load_render_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nightjar_k8s_render", KUSTOMIZE / "render.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- generated copies -------------------------------------------------------------------


def test_generated_copies_are_current() -> None:
    render = load_render_script()
    assert render.stale(render.outputs()) == [], "run `make k8s`"


def test_a_stale_copy_is_found(tmp_path: Path) -> None:
    render = load_render_script()
    current, edited, missing = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    current.write_text("x")
    edited.write_text("old")
    assert render.stale({current: "x", edited: "new", missing: "y"}) == [edited, missing]


def test_rules_and_dashboard_are_the_sources() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "nightjar-rules.yaml").read_text())
    dashboard = (DEPLOY / "grafana" / "nightjar.json").read_text()
    for variant in ("kustomize:gpu", "helm:gpu"):
        documents = documents_of(variant)
        assert one(documents, "PrometheusRule")["spec"]["groups"] == rules["groups"]
        config_map = one(documents, "ConfigMap")
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["data"] == {"nightjar.json": dashboard}


# --- schemas ----------------------------------------------------------------------------


def crd_errors(document: dict[str, Any]) -> list[str]:
    """Validate a custom resource with prometheus-operator's CRD models; a field the CRD
    does not know is dropped by the model, so a round trip that loses something names it."""
    model = getattr(prometheus_operator, document["kind"]).model_validate(document)
    back = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    return [] if back == document else [f"fields the CRD does not know: {document} != {back}"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_match_the_schemas(variant: str) -> None:
    documents = documents_of(variant)
    kinds = {d["kind"] for d in documents}
    assert {"StatefulSet", "Service", "NetworkPolicy", "ServiceAccount", "ConfigMap"} <= kinds
    assert kinds >= CRDS
    for document in documents:
        if document["kind"] in CRDS:
            assert crd_errors(document) == []
            continue
        for version in KUBERNETES_VERSIONS:
            k8s_schema.validate(document, version, strict=True)


def test_a_cluster_without_the_prometheus_operator(tmp_path: Path) -> None:
    """Your overlay: the cpu one with the component that drops the operator's resources."""
    component = KUSTOMIZE / "components" / "without-prometheus-operator"
    overlay = {
        "resources": [os.path.relpath(KUSTOMIZE / "overlays" / "cpu", tmp_path)],
        "components": [os.path.relpath(component, tmp_path)],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    documents = kustomize(tmp_path)
    full = {d["kind"] for d in documents_of("kustomize:cpu")}
    assert {d["kind"] for d in documents} == full - CRDS
    for document in documents:
        k8s_schema.validate(document, "1.37", strict=True)


def test_the_validators_reject_broken_manifests() -> None:
    documents = documents_of("kustomize:gpu")
    statefulset = one(documents, "StatefulSet")
    container(statefulset["spec"]["template"]["spec"], "vllm")["readinessProbes"] = {}
    with pytest.raises(k8s_schema.ValidationError):
        k8s_schema.validate(statefulset, "1.37", strict=True)
    monitor = one(documents, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    assert crd_errors(monitor) != []
    rule = one(documents, "PrometheusRule")
    rule["spec"]["groups"] = "not a list"
    with pytest.raises(ValueError):
        crd_errors(rule)


def test_helm_chart_lints_clean() -> None:
    for report in helm([{"values": v, "lint": True} for v in HELM_VALUES.values()]):
        assert report["errors"] == []
        # severity 1 is "info" (e.g. "icon is recommended"); 2 and 3 are warnings, errors
        assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_helm_refuses_values_its_schema_does_not_know() -> None:
    typo, wrong_type, bad_interval = helm(
        [
            {"values": {"engine": {"modle": "x"}}, "lint": False},
            {"values": {"elasticMemory": {"enabled": "yes"}}, "lint": False},
            {"values": {"metrics": {"serviceMonitor": {"interval": 15}}}, "lint": False},
        ]
    )
    assert "modle" in typo["error"]
    assert "enabled" in wrong_type["error"]
    assert "interval" in bad_interval["error"]


# --- settings through the components' own parsers ----------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_sidecar_settings_are_accepted(variant: str) -> None:
    spec = pod_spec(variant)
    sidecar = container(spec, "nightjar")
    config = load_config(parse_args(sidecar["args"]))
    policy = create_policy(config.policy, config.params)
    parse_params(MemoryParams, config.memory, "memory")
    engine = container(spec, "vllm")
    speculative = json.loads(flags(engine["args"])["--speculative-config"])
    # The sidecar explores the γ the engine can run, no more: the policy a fresh start
    # runs (nothing configured: goodput's defaults) has the engine's Γmax.
    assert policy.gamma_max == speculative["num_speculative_tokens"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_engine_settings_are_accepted(variant: str) -> None:
    spec = pod_spec(variant)
    engine = container(spec, "vllm")
    config = plugin_config(engine)
    assert config.active
    assert env_of(engine)["VLLM_USE_V2_MODEL_RUNNER"] == "0"  # draft_model honours γ
    speculative = json.loads(flags(engine["args"])["--speculative-config"])
    table = speculative["num_speculative_tokens_per_batch_size"]
    # vLLM's per-step γ path needs the table; every γ in 0..Γmax in it has its CUDA graphs
    # captured (docs/VLLM_PLUGIN.md).
    assert {g for _, _, g in table} == set(range(speculative["num_speculative_tokens"] + 1))
    sidecar = container(spec, "nightjar")
    sidecar_config = load_config(parse_args(sidecar["args"]))
    assert config.sidecar == f"unix:{sidecar_config.uds}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_sockets_and_secrets_are_shared(variant: str) -> None:
    spec = pod_spec(variant)
    sidecar, engine = container(spec, "nightjar"), container(spec, "vllm")
    server = load_config(parse_args(sidecar["args"]))
    plugin = plugin_config(engine)

    def volume_at(c: dict[str, Any], path: str) -> str:
        mounts = [m for m in c["volumeMounts"] if Path(path).is_relative_to(m["mountPath"])]
        assert mounts, f"{c['name']} has no volume at {path}"
        return str(max(mounts, key=lambda m: len(m["mountPath"]))["name"])

    socket_volume = volume_at(sidecar, server.uds)
    assert volume_at(engine, server.uds) == socket_volume
    assert volume_at(sidecar, server.admin_token_file) == "nightjar-admin-token"
    assert volume_at(sidecar, server.state_dir) == "nightjar-state"
    if plugin.memory_agent:
        assert volume_at(engine, plugin.memory_socket) == socket_volume
        assert plugin.admin_token_file == server.admin_token_file
        assert volume_at(engine, plugin.admin_token_file) == "nightjar-admin-token"
    # Each side's socket is open to the other's user through the shared group only.
    assert server.uds_mode & 0o077 == 0o060
    assert plugin.memory_socket_mode & 0o077 == 0o060
    (token,) = [v for v in spec["volumes"] if v["name"] == "nightjar-admin-token"]
    assert token["secret"]["defaultMode"] == 0o440  # group-readable: both users, one group


@pytest.mark.parametrize("variant", VARIANTS)
def test_sidecar_never_gates_engine_readiness(variant: str) -> None:
    spec = pod_spec(variant)
    sidecar, engine = container(spec, "nightjar"), container(spec, "vllm")
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar
    assert "readinessProbe" not in sidecar  # an outage must not drain the engine
    server = load_config(parse_args(sidecar["args"]))
    for probe in (sidecar["startupProbe"], sidecar["livenessProbe"]):
        command = probe["exec"]["command"]
        assert command[0] == "nightjarctl"
        args = ctl_parser().parse_args(command[1:])
        assert args.command == "health" and args.target == f"unix:{server.uds}"
        # The kubelet must not cut the command off before its own deadline answers.
        assert probe["timeoutSeconds"] > args.timeout
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert engine[kind]["httpGet"] == {"path": "/health", "port": "http"}


def scrape_job(endpoint: dict[str, Any]) -> str:
    """The job label a ServiceMonitor endpoint's targets get."""
    (job,) = [r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"]
    return str(job)


# Flags whose paths and ports the test rig chooses itself.
RIG_FLAGS = ("--uds", "--metrics-port", "--metrics-host", "--state-dir", "--admin-token-file")


@pytest.mark.parametrize("variant", ["kustomize:gpu-elastic-memory", "kustomize:cpu"])
def test_sidecar_runs_with_the_manifest_settings(variant: str, make_server: Any) -> None:
    """A real nightjar-server with the manifest's settings: the probe's own command finds
    it SERVING within the kubelet's timeout, its metrics answer where the ServiceMonitor
    scrapes, and its socket is open to the pod's shared group only."""
    sidecar = container(pod_spec(variant), "nightjar")
    settings = [a for a in sidecar["args"] if not a.startswith(RIG_FLAGS)]
    server = make_server(*settings)
    probe = sidecar["startupProbe"]
    command = [str(Path(sys.executable).parent / "nightjarctl"), *probe["exec"]["command"][1:]]
    command[command.index("--target") + 1] = server.target
    done = subprocess.run(command, capture_output=True, text=True, timeout=probe["timeoutSeconds"])
    assert done.returncode == 0 and "SERVING" in done.stdout, done.stdout + done.stderr
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as reply:
        assert "nightjar_" in reply.read().decode()
    # The engine's user reaches the socket through the pod's shared group, nobody else.
    assert stat.S_IMODE(server.uds.stat().st_mode) == 0o660


@pytest.mark.parametrize("variant", VARIANTS)
def test_metrics_are_scraped_by_port_number(variant: str) -> None:
    documents = documents_of(variant)
    spec = one(documents, "StatefulSet")["spec"]["template"]["spec"]
    server = load_config(parse_args(container(spec, "nightjar")["args"]))
    assert server.metrics_host == "0.0.0.0"
    services = [d for d in documents if d["kind"] == "Service"]
    # Numbers: a named target port on a native sidecar resolves only from Kubernetes 1.32.
    assert all(isinstance(p["targetPort"], int) for s in services for p in s["spec"]["ports"])
    monitor = one(documents, "ServiceMonitor")
    selected = [
        s
        for s in services
        if monitor["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    (scraped,) = selected
    ports = {p["name"]: p["targetPort"] for p in scraped["spec"]["ports"]}
    jobs = {ports[e["port"]]: scrape_job(e) for e in monitor["spec"]["endpoints"]}
    assert set(jobs) == {server.metrics_port, 8000}
    # The alerts find the sidecar by its job: the sidecar's, and only it, must match.
    rules = (DEPLOY / "prometheus" / "nightjar-rules.yaml").read_text()
    (sidecar_job,) = set(re.findall(r'up\{job=~"([^"]+)"\}', rules))
    assert re.fullmatch(sidecar_job, jobs[server.metrics_port])
    assert not re.fullmatch(sidecar_job, jobs[8000])
    pod_labels = one(documents, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert scraped["spec"]["selector"].items() <= pod_labels.items()


@pytest.mark.parametrize("variant", VARIANTS)
def test_network_policy_keeps_admin_private(variant: str) -> None:
    documents = documents_of(variant)
    policy = one(documents, "NetworkPolicy")["spec"]
    pod_labels = one(documents, "StatefulSet")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["policyTypes"] == ["Ingress"]
    allowed = {
        port["port"]: rule.get("from") for rule in policy["ingress"] for port in rule["ports"]
    }
    spec = one(documents, "StatefulSet")["spec"]["template"]["spec"]
    server = load_config(parse_args(container(spec, "nightjar")["args"]))
    assert server.port is None  # gRPC only on the socket, inside the pod
    assert set(allowed) == {8000, server.metrics_port}
    assert allowed[8000] is None  # clients
    (monitoring,) = allowed[server.metrics_port]
    assert monitoring["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "monitoring"
    }


def dockerfile_user(name: str) -> tuple[int, int]:
    (user,) = re.findall(r"^USER (\d+):(\d+)$", (DEPLOY / name).read_text(), re.M)
    return int(user[0]), int(user[1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_pod_security(variant: str) -> None:
    spec = pod_spec(variant)
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    # One group for both users: the 0660 sockets and the 0440 token are theirs.
    assert pod["fsGroup"] == pod["runAsGroup"]
    assert spec["automountServiceAccountToken"] is False
    images = {"nightjar": "Dockerfile", "vllm": "Dockerfile.vllm"}
    for name, dockerfile in images.items():
        c = container(spec, name)
        context = c["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert context["capabilities"] == {"drop": ["ALL"]}
        assert (context["runAsUser"], pod["runAsGroup"]) == dockerfile_user(dockerfile)
        assert {"cpu", "memory"} <= set(c["resources"]["requests"])
        assert "memory" in c["resources"]["limits"]
    # What the engine writes goes to volumes, not to the read-only root.
    engine = container(spec, "vllm")
    writable = {m["mountPath"] for m in engine["volumeMounts"] if not m.get("readOnly")}
    assert {"/tmp", "/dev/shm", env_of(engine)["HOME"]} <= writable
    assert env_of(engine)["HF_HOME"].startswith(env_of(engine)["HOME"])


@pytest.mark.parametrize("variant", VARIANTS)
def test_learned_state_survives_pod_replacement(variant: str) -> None:
    statefulset = one(documents_of(variant), "StatefulSet")
    spec = statefulset["spec"]["template"]["spec"]
    claims = {t["metadata"]["name"] for t in statefulset["spec"]["volumeClaimTemplates"]}
    assert "nightjar-state" in claims  # one volume per replica, kept when the pod goes
    assert "nightjar-state" not in {v["name"] for v in spec["volumes"]}
    # A StatefulSet pod's name is stable: so is the engine id the state is learned under.
    assert env_of(container(spec, "vllm"))["NIGHTJAR_ENGINE_ID"] == {
        "fieldRef": {"fieldPath": "metadata.name"}
    }


def test_learner_key_is_derived_unless_set() -> None:
    """No key in the manifests: the plugin derives <model>@<device> (stable across pod
    replacement); the chart's learnerKey overrides it, and a key the plugin would refuse
    is refused by the chart."""
    for variant in VARIANTS:
        assert plugin_config(container(pod_spec(variant), "vllm")).learner_key == ""
    (documents,) = helm_render({"engine": {"learnerKey": "llama-3-8b@h100"}})
    engine = container(one(documents, "StatefulSet")["spec"]["template"]["spec"], "vllm")
    assert plugin_config(engine).learner_key == "llama-3-8b@h100"
    (too_long,) = helm([{"values": {"engine": {"learnerKey": "k" * 257}}, "lint": False}])
    assert "learnerKey" in too_long["error"]
    with pytest.raises(ValueError):
        PluginConfig.load({"NIGHTJAR_LEARNER_KEY": "k" * 257})


@pytest.mark.parametrize("variant", VARIANTS)
def test_draft_offload_is_consistent_with_cuda_graphs(variant: str) -> None:
    spec = pod_spec(variant)
    engine = container(spec, "vllm")
    server = load_config(parse_args(container(spec, "nightjar")["args"]))
    memory = parse_params(MemoryParams, server.memory, "memory")
    plugin = plugin_config(engine)
    # The sidecar orders offloads only where an agent carries them out.
    assert memory.enabled == plugin.memory_agent
    gpu = "nvidia.com/gpu" in engine["resources"]["limits"]
    if memory.enabled and gpu:
        # Under CUDA graphs the agent refuses to offload a draft that keeps its own memory
        # (docs/MEMORY.md): eager mode or no offload.
        assert "--enforce-eager" in engine["args"]
    if not gpu:
        # `vllm serve` on CPU runs workers in processes of their own: no agent there.
        assert not plugin.memory_agent


# --- images ------------------------------------------------------------------------------


def image_tag(image: str) -> str:
    return image.rsplit(":", 1)[1]


def vllm_release(tag: str) -> tuple[int, int]:
    match = re.match(r"v(\d+)\.(\d+)\.\d+", tag)
    assert match, tag
    return int(match[1]), int(match[2])


@pytest.mark.parametrize("variant", VARIANTS)
def test_images_are_pinned(variant: str) -> None:
    spec = pod_spec(variant)
    assert image_tag(container(spec, "nightjar")["image"]) == __version__
    engine_tag = image_tag(container(spec, "vllm")["image"])
    # <vLLM release>[-cpu]-nightjar<version>: the release the plugin supports.
    assert vllm_release(engine_tag) in SUPPORTED
    assert engine_tag.endswith(f"-nightjar{__version__}")
    gpu = "nvidia.com/gpu" in container(spec, "vllm")["resources"]["limits"]
    assert ("-cpu-" in engine_tag) != gpu


def test_gpu_engine_has_what_it_needs() -> None:
    for variant in ("kustomize:gpu", "helm:gpu"):
        engine = container(pod_spec(variant), "vllm")
        assert engine["resources"]["requests"]["nvidia.com/gpu"] == 1
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
        hf_token = env_of(engine)["HF_TOKEN"]["secretKeyRef"]
        assert hf_token["name"] == "hf-token"
        dockerfile = (DEPLOY / "Dockerfile.vllm").read_text()
        (base,) = re.findall(r"^ARG VLLM_IMAGE=vllm/vllm-openai:(\S+)$", dockerfile, re.M)
        assert image_tag(engine["image"]).startswith(f"{base}-")


def dockerfile_stage_copies(name: str) -> set[str]:
    """Sources the wheel stage copies (first stage, up to the next FROM)."""
    text = (DEPLOY / name).read_text()
    stage = text.split("\nFROM ")[1]
    copied: set[str] = set()
    for line in re.findall(r"^COPY (?!--from)(.+)$", stage, re.M):
        copied.update(line.split()[:-1])
    return copied


def test_dockerfiles_build_the_wheel_from_every_package_source() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    package_dirs = project["tool"]["setuptools"]["package-dir"].values()
    needed = {d.split("/")[0] for d in package_dirs} | {"pyproject.toml", "README.md", "NOTICE"}
    for name in ("Dockerfile", "Dockerfile.vllm"):
        assert needed <= dockerfile_stage_copies(name), name
        assert all((REPO / source).exists() for source in dockerfile_stage_copies(name))


def test_dockerfile_vllm_keeps_the_engine_packages_and_sets_the_plugin_on() -> None:
    text = (DEPLOY / "Dockerfile.vllm").read_text()
    (base,) = re.findall(r"^ARG VLLM_IMAGE=vllm/vllm-openai:(\S+)$", text, re.M)
    assert vllm_release(base) in SUPPORTED
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}$", text, re.M)
    assert "--constraint /opt/nightjar-install/image-packages.txt" in text
    (sidecar,) = re.findall(r"^ENV NIGHTJAR_SIDECAR=(\S+)$", text, re.M)
    assert PluginConfig.load({"NIGHTJAR_SIDECAR": sidecar}).active


# --- the admin token ----------------------------------------------------------------------


def test_no_admin_token_is_shipped() -> None:
    for overlay in OVERLAYS:
        assert [d for d in documents_of(f"kustomize:{overlay}") if d["kind"] == "Secret"] == []


def generated_token(documents: list[dict[str, Any]]) -> str:
    import base64

    secret = one(documents, "Secret")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    return base64.b64decode(secret["data"]["admin-token"]).decode()


def test_helm_generates_a_random_token_or_uses_yours() -> None:
    first, second, documents = helm_render(
        {}, {}, {"adminToken": {"existingSecret": "vault-nightjar", "key": "t"}}
    )
    first_token, second_token = generated_token(first), generated_token(second)
    assert first_token != second_token and len(first_token) == 48 and first_token.isalnum()
    assert token_problem(first_token) is None  # the sidecar and the agent accept it
    assert [d for d in documents if d["kind"] == "Secret"] == []
    spec = one(documents, "StatefulSet")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "nightjar-admin-token"]
    assert volume["secret"]["secretName"] == "vault-nightjar"
    assert volume["secret"]["items"] == [{"key": "t", "path": "admin-token"}]


# --- Helm and kustomize deploy the same pod ------------------------------------------------


def normalised_pod(spec: dict[str, Any]) -> dict[str, Any]:
    """The pod with what legitimately differs taken out: object names, pull policy, list
    order of name-keyed lists, JSON flag spelling."""
    spec = copy.deepcopy(spec)
    spec.pop("serviceAccountName")
    for volume in spec["volumes"]:
        volume.get("secret", {}).pop("secretName", None)
    spec["volumes"].sort(key=lambda v: v["name"])
    for c in spec.get("initContainers", []) + spec["containers"]:
        c.pop("imagePullPolicy", None)
        c["env"] = sorted(c.get("env", []), key=lambda e: e["name"])
        c["volumeMounts"].sort(key=lambda m: m["mountPath"])
        c["args"] = [_normalised_flag(a) for a in c["args"]]
    return spec


def _normalised_flag(arg: str) -> Any:
    name, _, value = arg.partition("=")
    if value.startswith("{"):
        return name, json.loads(value)
    return arg


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_helm_and_kustomize_deploy_the_same_pod(overlay: str) -> None:
    kustomized = normalised_pod(pod_spec(f"kustomize:{overlay}"))
    charted = normalised_pod(pod_spec(f"helm:{overlay}"))
    assert charted == kustomized
