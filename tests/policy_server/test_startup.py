"""What a sidecar starts with: configured parameters win over a snapshot's, its learned
state is kept where it fits them, and the log says where each parameter came from."""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any

import pytest
from nightjar_proto.v1 import admin_pb2

from nightjar_common.errors import ConfigError
from nightjar_common.types import StepContext, StepOutcome
from policy_server import snapshot, startup
from policy_server.cli import load_config, parse_args
from policy_server.policies.base import MalformedStateError
from policy_server.service import DecisionService

TABLE = Path(__file__).resolve().parents[2] / "deploy" / "c_prefill_example.csv"


def configured(tmp_path: Path, *flags: str, toml: str = "") -> startup.Configured:
    args = ["--uds", str(tmp_path / "s.sock"), *flags]
    if toml:
        args += ["--config", str(write(tmp_path, toml))]
    return startup.Configured.of(load_config(parse_args(args)))


def learned_snapshot(state_dir: Path, policy: str = "goodput", **params: Any) -> dict[str, Any]:
    """A snapshot of ``policy`` after some steps, written where a restart finds it."""
    service = DecisionService(policy, params, state_dir=state_dir)
    for step in range(30):
        decision = service.run_step(StepContext("e", batch_size=4, step_index=step))
        service.report(
            StepOutcome(decision.decision_id, "e", decision.gamma, 0.01, 4 * (1 + decision.gamma))
        )
    service.write_snapshot()
    return snapshot.read(state_dir / snapshot.SNAPSHOT_NAME)


def restart(state_dir: Path, config: startup.Configured) -> DecisionService:
    service = DecisionService(config.policy, config.values(), state_dir=state_dir)
    startup.start(service, state_dir, config)
    return service


def test_flags_override_the_config_files_parameters_key_by_key(tmp_path: Path) -> None:
    config = load_config(
        parse_args(
            [
                *("--uds", "s.sock", "--params", '{"gamma_max": 6}'),
                *("--config", str(write(tmp_path, "params = {gamma_max = 3, warmup_steps = 7}"))),
            ]
        )
    )
    assert config.params == {"gamma_max": 6, "warmup_steps": 7}
    assert config.origins["params.gamma_max"] == "command line"
    assert config.origins["params.warmup_steps"] == str(tmp_path / "nightjar.toml")
    assert "policy" not in config.origins


def test_parameters_of_the_files_policy_do_not_follow_another_policy(tmp_path: Path) -> None:
    toml = write(tmp_path, 'policy = "goodput"\nparams = {warmup_steps = 7}')
    args = ["--uds", "s.sock", "--config", str(toml), "--policy", "static"]
    config = load_config(parse_args([*args, "--params", '{"gamma": 2}']))
    assert (config.policy, config.params) == ("static", {"gamma": 2})
    assert config.origins["policy"] == "command line"
    with pytest.raises(ConfigError, match="params must be a table"):
        load_config(parse_args(["--uds", "s.sock", "--params", "[1]"]))


def test_configured_parameters_win_and_unfit_state_is_dropped_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The issue's case: gamma_max and prefill_cost_table set at restart take effect."""
    state_dir = tmp_path / "state"
    learned_snapshot(state_dir, gamma_max=4)
    config = configured(
        tmp_path,
        *("--policy", "goodput", "--params", '{"gamma_max": 6}'),
        toml=f'params = {{prefill_cost_table = "{TABLE}"}}',
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):
        service = restart(state_dir, config)
    view = service.state_view()
    assert view.params["gamma_max"] == 6 and view.params["prefill_cost_table"] == str(TABLE)
    assert view.state["learners"] == {}
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "learned state in" in m and "gamma_max=6 (command line)" in m and "gamma_max=4" in m
        for m in warning
    ), warning
    assert "no prefill_cost_table given" not in caplog.text  # the configured one runs
    sources = caplog.messages[-1]
    assert "policy goodput" in sources and "from command line" in sources
    assert "gamma_max=6 (command line)" in sources
    assert f"prefill_cost_table='{TABLE}' ({tmp_path / 'nightjar.toml'})" in sources
    # Not quarantined: the snapshot was fine, the configuration moved on.
    assert (state_dir / snapshot.SNAPSHOT_NAME).exists()


def test_state_that_fits_is_kept_and_run_time_parameters_survive(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    document = learned_snapshot(state_dir, gamma_max=4, warmup_steps=3)
    config = configured(tmp_path, "--params", json.dumps({"gamma_max": 4, "ridge": 2.0}))
    with caplog.at_level(logging.INFO):
        service = restart(state_dir, config)
    view = service.state_view()
    learned = document["policy"]["state"]["learners"]["engine:e"]
    assert view.state["learners"]["engine:e"]["acceptance"] == learned["acceptance"]
    assert (view.params["ridge"], view.params["warmup_steps"]) == (2.0, 3)
    assert "restored goodput" in caplog.text
    sources = caplog.messages[-1]
    assert "gamma_max=4 (command line)" in sources and "ridge=2.0 (command line)" in sources
    assert "warmup_steps=3 (snapshot)" in sources
    assert "from default" in sources  # --policy was not given: the default policy


def test_a_snapshot_of_another_policy_is_not_restored_over_the_configured_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    learned_snapshot(state_dir, "nightjar")
    config = configured(tmp_path, "--params", '{"gamma_max": 5}')
    with caplog.at_level(logging.INFO):
        service = restart(state_dir, config)
    assert (service.active.name, service.state_view().params["gamma_max"]) == ("goodput", 5)
    assert "holds policy 'nightjar', but 'goodput' is configured (parameters for it from " in (
        caplog.text
    )


def test_with_nothing_configured_the_snapshot_is_taken_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    document = learned_snapshot(state_dir, "nightjar", seed=9)
    with caplog.at_level(logging.INFO):
        service = restart(state_dir, configured(tmp_path))
    assert service.active.name == "nightjar"
    assert service.state_view().state == document["policy"]["state"]
    assert "policy nightjar" in caplog.messages[-1] and "from snapshot" in caplog.messages[-1]
    assert "seed=9 (snapshot)" in caplog.messages[-1]


def test_state_that_fits_no_parameters_is_still_moved_aside(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    document = learned_snapshot(state_dir)
    document["policy"]["state"]["schema"] = "goodput/0"
    snapshot.write_atomic(state_dir / snapshot.SNAPSHOT_NAME, document)
    service = restart(state_dir, configured(tmp_path, "--params", '{"gamma_max": 6}'))
    assert service.state_view().params["gamma_max"] == 6
    assert len(list(state_dir.glob("snapshot.json.corrupt-*"))) == 1


def test_a_restarted_process_takes_a_changed_configuration(make_server: Any) -> None:
    """End to end, as on a StatefulSet's persistent volume: snapshot, change, restart."""
    server = make_server("--params", '{"gamma_max": 4}')
    server.admin.Snapshot(admin_pb2.SnapshotRequest(), metadata=server.auth, timeout=5)
    assert server.terminate() == 0
    toml = write(server.workdir, f'params = {{prefill_cost_table = "{TABLE}"}}')
    server.args += ["--config", str(toml), "--policy", "goodput", "--params", '{"gamma_max": 6}']
    server.start()
    params = server.state()["params"]
    assert (params["gamma_max"], params["prefill_cost_table"]) == (6, str(TABLE))
    assert "gamma_max=6 (command line)" in server.log()


def write(directory: Path, text: str) -> Path:
    path = directory / "nightjar.toml"
    path.write_text(text)
    return path


def ema_text(state_dir: Path, **slot: Any) -> str:
    """An ema snapshot after some steps, its slot of engine "e" changed by ``slot``."""
    document = learned_snapshot(state_dir, "ema")
    document["policy"]["state"]["slots"]["e"]["1"].update(slot)
    return json.dumps(document)


CREATED = r'"created_unix": [0-9.e+]+'
DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (lambda t: t.replace('"batches":', '"batches": 1e400, "x":', 1), "too large for a float"),
        (lambda t: t.replace('"batches":', '"batches": ' + "9" * 5000 + ', "x":', 1), "4300"),
        (lambda t: t.replace('"batches":', f'"batches": {DEEP}, "x":', 1), "nested more than"),
        (lambda t: re.sub(CREATED, '"created_unix": "now"', t), "created_unix must be a number"),
        (lambda t: re.sub(CREATED, '"created_unix": [1]', t), "created_unix must be a number"),
        (lambda t: t.replace('"engines": [', '"engines": [7, ', 1), "engines must be a list"),
        (lambda t: t.replace('"name": "ema"', '"name": 5', 1), "policy name must be a string"),
    ],
)
def test_an_unusable_snapshot_is_moved_aside_and_the_server_starts_fresh(
    tmp_path: Path, corrupt: Any, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    (state_dir / snapshot.SNAPSHOT_NAME).write_text(corrupt(ema_text(state_dir)))
    service = assert_fresh_start(tmp_path, state_dir, caplog)
    assert reason in caplog.text
    assert service.state_view().state["slots"] == {}


@pytest.mark.parametrize(
    ("slot", "reason"),
    [
        ({"candidates": [-5]}, "candidates must be in 0..7 (gamma_max), got [-5]"),
        ({"candidates": [1, 1000]}, "candidates must be in 0..7"),
        ({"candidates": []}, "candidates must be a list of 1..65 steps"),
        ({"index": 7}, "index must be in 0..2, got 7"),
        ({"index": -1}, "index must be in 0..2, got -1"),
        ({"ema": "high"}, "ema must be a finite number"),
        ({"ema": 10**400}, "ema must be a finite number"),
        ({"batches": -1}, "batches must be an integer >= 0"),
        ({"candidates": "137"}, "candidates must be a list"),
    ],
)
def test_learned_ema_state_out_of_range_is_refused(
    tmp_path: Path, slot: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    (state_dir / snapshot.SNAPSHOT_NAME).write_text(ema_text(state_dir, **slot))
    service = assert_fresh_start(tmp_path, state_dir, caplog)
    assert reason in caplog.text
    # Decisions stay within 0..Γmax: nothing of the refused state was loaded.
    assert 0 <= service.run_step(StepContext("e", batch_size=4)).gamma <= 7


def test_ema_load_state_is_all_or_nothing(tmp_path: Path) -> None:
    document = learned_snapshot(tmp_path / "state", "ema")
    policy = DecisionService("ema").active.policy
    good = document["policy"]["state"]
    policy.load_state(good)
    bad = json.loads(json.dumps(good))
    bad["slots"]["f"] = {"1": {**good["slots"]["e"]["1"], "index": 9}}
    with pytest.raises(MalformedStateError, match="engine 'f' tier 1: index"):
        policy.load_state(bad)
    assert policy.state() == good


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "directory", "huge"])
def test_a_snapshot_that_is_no_regular_file_or_too_large_never_hangs_start_up(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    path = state_dir / snapshot.SNAPSHOT_NAME
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "directory":
        path.mkdir()
    else:
        with path.open("wb") as fh:
            fh.truncate(snapshot.MAX_BYTES + 1)  # sparse
    assert_fresh_start(tmp_path, state_dir, caplog, policy="goodput")
    reason = "is larger than" if kind == "huge" else "is not a regular file"
    assert reason in caplog.text


def assert_fresh_start(
    tmp_path: Path, state_dir: Path, caplog: pytest.LogCaptureFixture, policy: str = "ema"
) -> DecisionService:
    """Start-up in a thread (a blocking read fails the test, not hangs it): it must move the
    snapshot aside and start fresh."""
    started: list[DecisionService] = []
    config = configured(tmp_path, "--policy", policy)
    with caplog.at_level(logging.ERROR, logger="nightjar.server"):
        runner = threading.Thread(target=lambda: started.append(restart(state_dir, config)))
        runner.start()
        runner.join(30)
    assert started, "start-up blocked"
    assert "is unusable" in caplog.text and "starting fresh" in caplog.text
    assert not os.path.lexists(state_dir / snapshot.SNAPSHOT_NAME)
    assert len(list(state_dir.glob("snapshot.json.corrupt-*"))) == 1
    return started[0]
