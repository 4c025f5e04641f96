"""`nightjar-server`'s command line agrees with its config file and its defaults."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from nightjar_common.errors import ConfigError, FailedPreconditionError
from policy_server.cli import FLAG_SETTINGS, _snapshot, load_config, parse_args
from policy_server.config import ServerConfig
from policy_server.policies import DEFAULT_POLICY, PolicyError, create_policy
from policy_server.service import DecisionService


def test_help_names_the_real_default_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"(default {DEFAULT_POLICY})" in text
    assert ServerConfig().policy == DEFAULT_POLICY


@pytest.mark.parametrize("name", FLAG_SETTINGS)
def test_each_flag_is_spelled_as_its_config_key(name: str) -> None:
    """`--snapshot-interval-s` for `snapshot_interval_s`: one name, in either place."""
    value = {"policy": "static", "log_level": "DEBUG", "log_format": "json"}.get(name, "1")
    args = parse_args([f"--{name.replace('_', '-')}", value])
    assert getattr(args, name) is not None
    assert name in {f.name for f in dataclasses.fields(ServerConfig)}


def test_the_snapshot_intervals_earlier_flag_still_works() -> None:
    config = load_config(parse_args(["--uds", "s.sock", "--snapshot-interval", "5"]))
    assert config.snapshot_interval_s == 5.0


@pytest.mark.parametrize("value", ["NaN", "Infinity", "1e400", "[" * 50 + "]" * 50])
def test_params_flag_refuses_what_json_cannot_carry(value: str) -> None:
    with pytest.raises(ConfigError, match="--params is not valid JSON"):
        load_config(parse_args(["--uds", "s.sock", "--params", f'{{"gamma": {value}}}']))


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_float_parameter_is_refused_from_any_source(value: float) -> None:
    with pytest.raises(PolicyError, match="'down_hysteresis' of policy 'ema' must be a finite"):
        create_policy("ema", {"down_hysteresis": value})


def test_a_failing_snapshot_never_ends_the_process(tmp_path: Path) -> None:
    """The periodic snapshot logs and counts a failure, whatever it is, and returns."""
    service = DecisionService("ema", state_dir=tmp_path)
    failed = "nightjar_snapshots_total{result='failed'}"

    def count() -> float:
        value = service.metrics.registry.get_sample_value(
            "nightjar_snapshots_total", {"result": "failed"}
        )
        return value or 0.0

    state = service.active.policy.state
    service.active.policy.state = lambda engine_id=None: {**state(), "x": math.nan}  # type: ignore[method-assign]
    with pytest.raises(FailedPreconditionError, match="cannot write snapshot"):
        service.write_snapshot()
    _snapshot(service)  # a NightjarError: logged, counted
    assert count() == 2, failed

    def broken(engine_id: str | None = None) -> dict[str, object]:
        raise RuntimeError("a defect in state()")

    service.active.policy.state = broken  # type: ignore[method-assign]
    _snapshot(service)  # any other exception: logged, counted, not raised
    assert count() == 3, failed
    assert not (tmp_path / "snapshot.json").exists()
