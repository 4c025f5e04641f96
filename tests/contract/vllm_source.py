"""The Python source of a pinned vLLM release's CUDA wheel, fetched once and cached.

The plugin claims vLLM releases it cannot run here (the CUDA builds need a GPU and are
several hundred MB of kernels); their Python source is what the plugin binds to. The wheel
is downloaded with ``pip download --no-deps`` (PyPI is reachable from CI), checked against
its pinned SHA-256, and only its ``.py`` files and metadata are kept, under ``build/``
(git-ignored; ``make clean`` removes it).

    python -m tests.contract.vllm_source [VERSION]   # prints the source directory
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "build" / "vllm-releases"

# version -> (wheel file on PyPI, its SHA-256 as PyPI lists it).
PINNED: dict[str, tuple[str, str]] = {
    "0.32.0": (
        "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "5e2ecdc5b0baf72921c288486417ca82778456a448e4fe60b62ee43c0dfc8611",
    ),
    "0.33.0": (
        "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl",
        "4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa",
    ),
}
_DONE = ".extracted"


class FetchError(RuntimeError):
    pass


def source_dir(version: str, cache: Path = CACHE) -> Path:
    """A directory holding ``vllm/`` of the pinned ``version``'s CUDA wheel (its Python
    files only), fetched and extracted on the first call."""
    wheel_name, digest = PINNED[version]
    out = cache / f"vllm-{version}"
    marker = out / _DONE
    if marker.exists() and marker.read_text().strip() == digest:
        return out
    cache.mkdir(parents=True, exist_ok=True)
    wheel = cache / wheel_name
    if not wheel.exists() or _sha256(wheel) != digest:
        _download(version, cache)
    if _sha256(wheel) != digest:
        wheel.unlink()
        raise FetchError(f"{wheel_name}: SHA-256 is not the pinned {digest}")
    shutil.rmtree(out, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        members = [
            name
            for name in archive.namelist()
            if name.endswith(".py") or (".dist-info/" in name and name.startswith("vllm-"))
        ]
        archive.extractall(out, members)
    wheel.unlink()  # 0.3 GB of kernels; pip's cache keeps the download
    marker.write_text(digest + "\n")
    return out


def _download(version: str, cache: Path) -> None:
    # The x86-64 CUDA wheel whatever this host is: the hash pins that one file.
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        "manylinux_2_28_x86_64",
        "--dest",
        str(cache),
        f"vllm=={version}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise FetchError(f"pip download vllm=={version} failed:\n{done.stderr[-2000:]}")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as data:
        for chunk in iter(lambda: data.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


if __name__ == "__main__":
    print(source_dir(sys.argv[1] if len(sys.argv) > 1 else "0.33.0"))
