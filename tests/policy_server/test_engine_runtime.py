"""An engine's runtime (runner, scheduling, method) travels with its contexts, is checked,
and shows in the state operators read."""

from __future__ import annotations

import pytest

from nightjar_common.errors import InvalidArgumentError
from nightjar_common.types import EngineRuntime, StepContext
from nightjar_common.wire import context_from_pb, context_to_pb
from policy_server.service import DecisionService

V2 = EngineRuntime("0.33.0", "v2", True, "draft_model")


def context(engine_id: str, runtime: EngineRuntime | None, passes: int = 4) -> StepContext:
    return StepContext(
        engine_id=engine_id, batch_size=8, max_gamma=4, min_draft_passes=passes, runtime=runtime
    )


def test_the_runtime_survives_the_wire() -> None:
    assert context_from_pb(context_to_pb(context("e", V2))).runtime == V2
    assert context_from_pb(context_to_pb(context("e", None))).runtime is None


def test_state_shows_each_engines_runtime_as_it_last_said() -> None:
    service = DecisionService("static", {"gamma": 2})
    service.run_step(context("gpu-0", V2))
    service.run_step(context("old-plugin", None))
    service.run_step(context("gpu-0", None))  # saying nothing keeps what it said
    engines = service.state_view().engines
    assert engines == {
        "gpu-0": {
            "engine_version": "0.33.0",
            "model_runner": "v2",
            "async_scheduling": True,
            "method": "draft_model",
            "min_draft_passes": 4,
        }
    }
    assert service.state_view("gpu-0").engines.keys() == {"gpu-0"}
    assert service.state_view("old-plugin").engines == {}


def test_an_oversized_runtime_is_refused() -> None:
    service = DecisionService("static", {"gamma": 2})
    runtime = EngineRuntime("0.33.0", "v2" * 1000, True, "draft_model")
    with pytest.raises(InvalidArgumentError, match=r"runtime\.model_runner is longer"):
        service.run_step(context("gpu-0", runtime))
    assert service.state_view().engines == {}
