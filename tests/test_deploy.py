"""The Kubernetes manifest is valid YAML and every setting in it is one the sidecar and the
plugin accept (a JSON flag that YAML mangles would otherwise only fail in a cluster)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from policy_server.cli import load_config, parse_args
from policy_server.memory import MemoryParams
from policy_server.policies import create_policy
from policy_server.policies.base import parse_params
from vllm_client_patch.config import PluginConfig

MANIFEST = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes" / "vllm-with-nightjar.yaml"


def pod_spec() -> dict[str, Any]:
    documents = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def test_sidecar_arguments_are_accepted() -> None:
    (sidecar,) = [c for c in pod_spec()["initContainers"] if c["name"] == "nightjar"]
    config = load_config(parse_args(sidecar["args"]))
    create_policy(config.policy, config.params)
    memory = parse_params(MemoryParams, config.memory, "memory")
    assert memory.enabled and memory.draft_blocks > 0


def test_engine_settings_are_accepted() -> None:
    (engine,) = [c for c in pod_spec()["containers"] if c["name"] == "vllm"]
    env = {item["name"]: item.get("value", "pod-name") for item in engine["env"]}
    config = PluginConfig.load(env)
    assert config.active and config.memory_agent and config.memory_socket
    spec = next(a for a in engine["args"] if a.startswith("--speculative-config="))
    speculative = json.loads(spec.split("=", 1)[1])
    assert speculative["num_speculative_tokens_per_batch_size"]  # the per-step γ path
    mounts = {m["mountPath"] for m in engine["volumeMounts"]}
    assert str(Path(config.admin_token_file).parent) in mounts
    assert str(Path(config.memory_socket).parent) in mounts
