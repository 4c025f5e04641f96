"""Regenerate (or check) the Python gRPC stubs that live next to the .proto files.

The stubs are checked in so that installing Nightjar needs no protoc; a test runs
``--check`` so they can never drift from the contract.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "nightjar" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Run protoc over every .proto of nightjar/v1 into ``out_dir``; return the files made."""
    from grpc_tools import protoc  # dev dependency only

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PACKAGE_DIR.glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_dir / "nightjar" / "v1").glob("*_pb2*"))


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
