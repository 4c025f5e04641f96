"""`make bench-memory-gpu`: the elastic-memory paths on a CUDA GPU.

Needs only torch (with CUDA), Triton and this repository — no vLLM, no transformers, no
download: KV buffers and draft models are random tensors shaped like real ones.

1. KV migration: the Triton kernel (`nightjar_kernels.kv_migrate`) moving blocks of
   vLLM-shaped KV buffers (both layout families, sorted and random moves) against torch's
   gather/scatter and a plain copy of the same bytes (the bandwidth ceiling); every row
   checks a sample of its moves bit for bit first.
2. Draft weights in memory of their own (`memory_agent/draft_weights.py`): offload (copy
   to pinned host memory, fingerprint, release), reload dispatch (what the engine's step
   waits for) against completion, verification, and matrix products on the main stream
   while a reload is in flight.
3. Draft weights in the KV buffer's top blocks (`memory_agent/draft_slot.py`): settle,
   hand-over, reload into the same addresses after KV data was written over them, and
   emptying the slot with the planner and the kernel.
4. The draft's memory under the KV buffer's top blocks through CUDA virtual memory
   (`memory_agent/vmm*.py`): blocks gained, offload, reload dispatch and completion,
   compaction, CUDA graph replay identity and free memory over the cycles.

The parts: `benchmarks/memory_gpu_kv.py` (1.), `benchmarks/memory_gpu_drafts.py` (2., 3.),
`benchmarks/memory_gpu_vmm.py` (4.),
what is measured and the clocks in `benchmarks/memory_gpu_plan.py`, the section in
`benchmarks/memory_gpu_report.py`; this module runs them and is the command line.

``--json`` keeps the raw results; ``--render`` writes the report section from such a file
(measured on another machine); ``--smoke`` runs tiny sizes on CPU (Triton interpreted) to
check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.host import cpu
from benchmarks.memory_gpu_drafts import draft_rows, slot_rows
from benchmarks.memory_gpu_kv import kv_rows
from benchmarks.memory_gpu_plan import FULL, SMOKE, Plan
from benchmarks.memory_gpu_report import render
from benchmarks.memory_gpu_vmm import vmm_rows

SECTION = "bench-memory-gpu"


def environment(device: torch.device) -> dict[str, Any]:
    import triton

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "host": cpu(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            sms=props.multi_processor_count,
            memory_gib=props.total_memory / 2**30,
            cuda=torch.version.cuda,
            driver=_driver(),
        )
    return env


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


PARTS = {"kv": kv_rows, "draft": draft_rows, "slot": slot_rows, "vmm": vmm_rows}


def measure(
    plan: Plan, device: torch.device, keep: Path | None = None, parts: Sequence[str] = tuple(PARTS)
) -> dict[str, Any]:
    """The parts named, in that order; a part that fails is recorded with its error, the
    others still run. ``keep``: the results so far are written there after each part."""
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "env": environment(device),
        "warmup": plan.warmup,
        "reps": plan.reps,
        "cycles": plan.cycles,
        "errors": {},
    }
    for name in parts:
        try:
            results[name] = PARTS[name](plan, device)
        except Exception as error:  # keep what the other parts measure
            traceback.print_exc()
            results[name] = []
            results["errors"][name] = f"{type(error).__name__}: {error}"
        if keep is not None:
            keep.write_text(json.dumps(results, indent=1))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    from benchmarks.report import write_section

    doc = (__doc__ or "").splitlines()[0]
    parser = argparse.ArgumentParser(prog="bench-memory-gpu", description=doc)
    parser.add_argument("--out", type=Path, help="report to write the section into")
    parser.add_argument("--json", type=Path, help="also keep the raw results here")
    parser.add_argument("--render", type=Path, help="render this JSON instead of measuring")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, CPU allowed")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"parts to run, in order (of {', '.join(PARTS)})"
    )
    args = parser.parse_args(argv)
    if args.render:
        results = json.loads(args.render.read_text())
    else:
        if args.smoke:
            os.environ.setdefault("TRITON_INTERPRET", "1")
        elif not torch.cuda.is_available():
            parser.error("no CUDA device: this benchmark measures the GPU paths (--smoke: CPU)")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        parts = [part for part in args.parts.split(",") if part]
        unknown = set(parts) - set(PARTS)
        if unknown:
            parser.error(f"unknown parts {sorted(unknown)}: choose from {', '.join(PARTS)}")
        results = measure(SMOKE if args.smoke else FULL, device, args.json, parts)
    text = render(results)
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
