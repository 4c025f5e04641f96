"""vLLM scheduler subclasses that take the step's γ from the Nightjar sidecar.

Select one with ``--scheduler-cls vllm_client_patch.scheduler.NightjarScheduler`` (or
``NightjarAsyncScheduler`` with async scheduling), or let the plugin install it
(plugin.py). With the plugin off (no NIGHTJAR_SIDECAR) they behave exactly as vLLM's.

The hook is the dynamic speculative decoding path of vLLM ≥ 0.32: at the end of
``schedule()`` vLLM reads the step's number of spec tokens from
``self.dynamic_sd_lookup[number of scheduled requests]``. We put a stand-in there that
asks the sidecar, so γ is decided for the batch that will actually draft. KV blocks were
allocated earlier in that call with vLLM's look-ahead of Γmax slots per request, so the
reservation always covers γ (it cannot be cut to γ without deciding before the batch is
known). Reporting happens after ``update_from_output``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput

from vllm_client_patch.config import PluginConfig
from vllm_client_patch.controller import EngineView, GammaController, VerifiedStep

log = logging.getLogger(__name__)


class _SidecarGamma:
    """Stands in for vLLM's batch size → K table: the sidecar decides each lookup."""

    def __init__(self, decide: Callable[[int], int]) -> None:
        self._decide = decide

    def __getitem__(self, batch_size: int) -> int:
        return self._decide(batch_size)


def verified_step(output: SchedulerOutput, result: ModelRunnerOutput) -> VerifiedStep:
    """Drafted / accepted / generated tokens of a finished step, counted as vLLM counts them."""
    drafted = accepted = generated = 0
    accepts: list[tuple[str, int]] = []
    sampled = result.sampled_token_ids
    for req_id in output.num_scheduled_tokens:
        index = result.req_id_to_index.get(req_id)
        tokens = len(sampled[index]) if sampled and index is not None else 0
        generated += tokens
        drafts = output.scheduled_spec_decode_tokens.get(req_id)
        if drafts and tokens:
            taken = max(tokens - 1, 0)  # all but the bonus / corrected token
            drafted += len(drafts)
            accepted += taken
            accepts.append((req_id, taken))
    return VerifiedStep(drafted, accepted, generated, tuple(accepts))


class _NightjarMixin:
    """The hook, for vLLM's Scheduler and AsyncScheduler alike (listed first in the bases)."""

    _nightjar: GammaController | None = None

    @property
    def nightjar(self) -> GammaController | None:
        """The engine's Nightjar controller (None when the plugin is off)."""
        return self._nightjar

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._install_nightjar()

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> Any:
        outputs = super().update_from_output(  # type: ignore[misc]
            scheduler_output, model_runner_output
        )
        if self._nightjar is not None:
            self._nightjar.end_step(verified_step(scheduler_output, model_runner_output))
            if not self.running:  # type: ignore[attr-defined]
                self._nightjar.idle()
        return outputs

    def shutdown(self) -> None:
        if self._nightjar is not None:
            self._nightjar.close()
            self._nightjar = None
        super().shutdown()  # type: ignore[misc]

    def _install_nightjar(self: Any) -> None:
        config = PluginConfig.load()
        if not config.active or not self.num_spec_tokens:
            if config.active:
                log.warning("nightjar: speculative decoding is off in this engine; plugin idle")
            return
        spec = self.vllm_config.speculative_config
        table = spec.num_speculative_tokens_per_batch_size if spec is not None else None
        self._nightjar = GammaController(
            config, tuple(tuple(row) for row in table) if table else None
        )
        self.dynamic_sd_lookup = _SidecarGamma(self._decide_gamma)
        log.info(
            "nightjar: γ per step from %s (engine %s, Γmax %d, deadline %.1f ms)",
            config.sidecar, config.engine_id, self.num_spec_tokens, config.deadline_ms,
        )  # fmt: skip

    def _decide_gamma(self: Any, batch_size: int) -> int:
        gamma: int = self._nightjar.decide(self._engine_view(batch_size))
        return gamma

    def _engine_view(self: Any, batch_size: int) -> EngineView:
        pool = self.kv_cache_manager.block_pool
        return EngineView(
            batch_size=batch_size,
            waiting=self.get_request_counts()[1],
            free_kv_blocks=pool.get_num_free_blocks(),
            total_kv_blocks=pool.num_gpu_blocks - 1,  # block 0 is vLLM's null block
            max_gamma=self.num_spec_tokens,
        )


class NightjarScheduler(_NightjarMixin, Scheduler):  # type: ignore[misc]
    """vLLM's synchronous scheduler (the only one on CPU) with γ from the sidecar."""


class NightjarAsyncScheduler(_NightjarMixin, AsyncScheduler):  # type: ignore[misc]
    """vLLM's async scheduler with γ from the sidecar. Step k+1 is scheduled before step
    k's update, so several decisions can be pending; the controller keeps them in order."""
