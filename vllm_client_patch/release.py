"""The vLLM releases the plugin hooks, and the installed one."""

from __future__ import annotations

import re

# vLLM releases whose scheduler internals we hook (the dynamic-SD path,
# _update_after_schedule, update_from_output), checked here and by the scheduler.
SUPPORTED = ((0, 32), (0, 33))


def vllm_release() -> tuple[int, int] | None:
    """(major, minor) of the installed vLLM; None when its version string is unusual
    (a source build may say "dev" or "unknown"), which the guard treats as unsupported."""
    import vllm

    match = re.match(r"(\d+)\.(\d+)", str(getattr(vllm, "__version__", "")))
    return (int(match[1]), int(match[2])) if match else None
