"""Regenerate (or check) the Python gRPC stubs that live next to the .proto files.

The stubs are checked in so that installing Nightjar needs no protoc; a test runs
``--check`` so they can never drift from the contract.

They are generated with an old, pinned grpcio-tools on purpose: generated code demands a
runtime at least as new as its generator (protobuf's gencode version check, grpc's
``GRPC_GENERATED_VERSION``), so the generator sets the floor of ``grpcio`` and
``protobuf`` in pyproject.toml. Old enough means Nightjar installs into a vLLM image
without upgrading either (vLLM accepts protobuf >= 5.29). The toolchain is installed
on first use into ``build/`` (pip, from PyPI), apart from the project's environment,
whose newer protobuf and grpcio then load the stubs.

The contract lives in ``proto/nightjar/v1/`` (the path of package ``nightjar.v1``, for
other languages); the Python stubs are generated from a copy placed at
``nightjar_proto/v1/`` so that they import as ``nightjar_proto.v1``, a name no other
project on PyPI uses (``nightjar`` is one).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
CONTRACT_DIR = PROTO_ROOT / "nightjar" / "v1"
PYTHON_PACKAGE = "nightjar_proto"
PACKAGE_DIR = PROTO_ROOT / PYTHON_PACKAGE / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
# protobuf gencode 5.29.0, GRPC_GENERATED_VERSION 1.70.0: the floors in pyproject.toml.
GRPC_TOOLS = "grpcio-tools==1.70.0"
TOOLCHAIN = PROTO_ROOT.parent / "build" / GRPC_TOOLS.replace("==", "-")


def toolchain() -> Path:
    """The pinned grpcio-tools (and the protobuf it needs), installed once into build/."""
    if not (TOOLCHAIN / ".complete").exists():
        shutil.rmtree(TOOLCHAIN, ignore_errors=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                "--no-warn-conflicts",
                "--target",
                str(TOOLCHAIN),
                GRPC_TOOLS,
            ],
            check=True,
        )
        (TOOLCHAIN / ".complete").touch()
    return TOOLCHAIN


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every .proto of the contract into ``out_dir``; return the files made."""
    sources = out_dir / "sources"
    shutil.copytree(CONTRACT_DIR, sources / PYTHON_PACKAGE / "v1")
    protos = sorted(
        str(p.relative_to(sources)) for p in (sources / PYTHON_PACKAGE).rglob("*.proto")
    )
    args = [
        f"-I{sources}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    # The toolchain's own protobuf must win over the environment's: a separate process.
    env = {**os.environ, "PYTHONPATH": str(toolchain()), "PYTHONNOUSERSITE": "1"}
    done = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", *args], env=env)
    if done.returncode != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / PYTHON_PACKAGE / "v1").glob("*_pb2*"))


def stale_files() -> list[str]:
    """Names of generated files that differ from what protoc makes now (empty = current)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p for p in generate(Path(tmp))}
        current = {p.name for p in PACKAGE_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES)}
        stale = sorted(current.symmetric_difference(fresh))
        stale += [
            name
            for name, path in fresh.items()
            if name in current and not filecmp.cmp(path, PACKAGE_DIR / name, shallow=False)
        ]
        return stale


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the stubs are stale")
    args = parser.parse_args()
    if args.check:
        stale = stale_files()
        if stale:
            print("stale generated stubs (run `make proto`):", ", ".join(stale), file=sys.stderr)
            return 1
        print("generated stubs are current")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copyfile(path, PACKAGE_DIR / path.name)
            print("wrote", (PACKAGE_DIR / path.name).relative_to(PROTO_ROOT.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
