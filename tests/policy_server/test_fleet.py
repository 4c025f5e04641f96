"""Fleet warm start: a learner exported from one sidecar starts a new pod's sidecar."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from nightjar_common import wire
from nightjar_common.types import BinType, StepContext, StepOutcome
from tests.rigs.sidecar import RanDecision

KEY = "Llama-3.1-8B@NVIDIA H100 80GB HBM3"


def ctl(server: Any, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "policy_server.ctl",
            "--target",
            server.target,
            "--token-file",
            str(server.token_file),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def serve_steps(server: Any, engine: str, steps: int) -> list[RanDecision]:
    """``steps`` steps of ``engine`` on its stream, each run from the table the sidecar
    sends for its context and reported with its outcome."""
    decisions = []
    with server.engine() as stream:
        for i in range(steps):
            batch = (2, 8, 32, 64)[i % 4]
            ctx = StepContext(
                engine,
                batch,
                step_index=i,
                max_gamma=4,
                learner_key=KEY,
                context_tokens=500 * batch,
            )
            decision = stream.decide(wire.context_to_pb(ctx))
            decisions.append(decision)
            gamma = decision.gamma
            seconds = (10 + 0.1 * batch * (gamma + 1)) / 1000
            outcome = StepOutcome(
                decision.decision_id,
                engine,
                gamma,
                seconds,
                batch * (1 + gamma // 2),
                drafted_tokens=batch * gamma,
                accepted_tokens=batch * gamma // 2,
            )
            assert stream.report(wire.outcome_to_pb(outcome)).skipped == 0
    return decisions


def test_a_new_pods_sidecar_starts_from_an_exported_learner(
    make_server: Any, tmp_path: Path
) -> None:
    old = make_server(name="old")
    serve_steps(old, "pod-a", 80)
    learned = old.state()["state"]["learners"][f"shared:{KEY}"]
    assert learned["steps"] == 80

    exported = tmp_path / "learner.json"
    assert ctl(old, "export", "--learner-key", KEY, "--out", str(exported)).returncode == 0
    new = make_server(name="new")
    # Another learner already on the new sidecar stays as it was.
    serve_steps(new, "pod-c", 3)
    other_before = new.state()["state"]["learners"]
    imported = ctl(new, "import", str(exported))
    assert imported.returncode == 0, imported.stderr
    after = new.state()["state"]["learners"]
    assert after[f"shared:{KEY}"]["step_time"] == learned["step_time"]
    assert after[f"shared:{KEY}"]["steps"] == 80
    assert set(after) == set(other_before) | {f"shared:{KEY}"}
    assert new.state()["state"]["engines"].keys() == {"pod-c"}
    # A new engine on the new pod decides from the model at once: past the prior table's
    # warm-up, so its first decision is the model's (exploit or explore), never the table's.
    first = serve_steps(new, "pod-b", 1)[0]
    assert first.reason in (BinType.EXPLOIT.value, BinType.EXPLORE.value)
    assert new.state()["state"]["learners"][f"shared:{KEY}"]["steps"] == 81


def test_export_and_import_refuse_what_does_not_fit(make_server: Any, tmp_path: Path) -> None:
    server = make_server()
    missing = ctl(server, "export", "--learner-key", "no-such-key")
    assert missing.returncode == 2 and "no learner 'shared:no-such-key'" in missing.stderr
    serve_steps(server, "pod-a", 5)
    exported = tmp_path / "learner.json"
    assert ctl(server, "export", "--learner-key", KEY, "--out", str(exported)).returncode == 0
    # The receiving sidecar runs another policy: refused, nothing changes.
    other = make_server("--policy", "nightjar", name="other")
    before = other.state()
    refused = ctl(other, "import", str(exported))
    assert refused.returncode == 2
    assert "exported with policy='goodput'; the active policy has policy='nightjar'" in (
        refused.stderr
    )
    assert other.state() == before
    document = json.loads(exported.read_text())
    assert document["format"] == "nightjar-learner/1" and document["learner"] == f"shared:{KEY}"
