"""`nightjar-server`'s command line agrees with its config file and its defaults."""

from __future__ import annotations

import dataclasses

import pytest

from policy_server.cli import FLAG_SETTINGS, load_config, parse_args
from policy_server.config import ServerConfig
from policy_server.policies import DEFAULT_POLICY


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
