"""benchmarks.serve_diagnosis on a run directory written to disk: passes split by policy
activation, phases by vLLM's result files, γ by batch size, how each was chosen, the
learner's predictions set beside the measured step times, and its point estimate for
every γ at the low-load batch sizes."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from benchmarks.serve_diagnosis import diagnose

START = 1_795_000_000.0


def decision(step: int, ts: float, policy: str, version: str, batch: int, gamma: int) -> list[Any]:
    decision_id = f"d{version}-{step}"
    # A field this version's StepContext does not have (a log outlives its writer).
    ctx = {"engine_id": "e", "batch_size": batch, "step_index": step, "max_gamma": 3}
    ctx["dropped_since"] = 1
    ms = 20.0 + 2.0 * batch * (gamma + 1) + 5.0 * max(gamma, 1)
    prefill = 64 if step % 10 == 0 else 0
    return [
        {
            "kind": "decision",
            "ts": ts,
            "decision_id": decision_id,
            "policy": policy,
            "policy_version": version,
            "context": ctx,
            "gamma": gamma,
            "bin_type": "fixed" if policy == "static" else "exploit",
        },
        {
            "kind": "outcome",
            "ts": ts + ms / 1000,
            "decision_id": decision_id,
            "outcome": {
                "decision_id": decision_id,
                "engine_id": "e",
                "gamma": gamma,
                "step_seconds": ms / 1000,
                "generated_tokens": batch * (1 + gamma // 2),
                "drafted_tokens": batch * gamma,
                "accepted_tokens": batch * (gamma // 2),
                "prefill_tokens": prefill,
            },
        },
    ]


def result_file(results: Path, name: str, start: float, duration: float) -> None:
    end = datetime.datetime.fromtimestamp(start + duration).strftime("%Y%m%d-%H%M%S")
    (results / f"{name}.json").write_text(json.dumps({"date": end, "duration": duration}))


def test_each_pass_and_phase_is_summarized(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    records: list[Any] = []
    manifest = []
    for number, policy in enumerate(("static", "goodput")):
        version = f"r{number + 1}"
        begin = START + 1000 * number
        records.append(
            {
                "kind": "policy",
                "ts": begin,
                "event": "swap",
                "policy": policy,
                "policy_version": version,
                "params": {"gamma_max": 3},
            }
        )
        names = []
        for phase, (batch, steps) in enumerate(((2, 40), (48, 60))):
            first = begin + 10 + 300 * phase
            for step in range(steps):
                gamma = 1 if policy == "static" or batch > 8 else 3
                records += decision(
                    phase * 100 + step, first + 0.2 * step, policy, version, batch, gamma
                )
            name = f"r0-{policy}-p{phase}"
            result_file(results, name, first - 1, 0.2 * steps + 3)
            names.append(f"{name}.json")
        manifest.append({"results": names})
    (results / "runs.json").write_text(json.dumps(manifest))
    (tmp_path / "decisions.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")

    report = diagnose(tmp_path)
    static, goodput = report["static r1"], report["goodput r2"]
    assert set(static) == {"r0-static-p0", "r0-static-p1"}
    low, high = goodput["r0-goodput-p0"], goodput["r0-goodput-p1"]
    assert (low["steps"], high["steps"]) == (40, 60)
    assert low["gamma_by_batch"] == {"1-8": {3: 40}} and high["gamma_by_batch"] == {
        "25-48": {1: 60}
    }
    assert low["how"] == {"exploit": 40} and static["r0-static-p0"]["how"] == {"fixed": 40}
    assert low["prefill_steps"] == 4 and low["mean_prefill_tokens"] == 64.0
    # Static passes are not replayed; the goodput pass's learner predicts every step but
    # its first, and on these noiseless linear steps it ends up close.
    assert static["r0-static-p0"]["model_error"]["decode"]["n"] == 0
    errors = high["model_error"]["decode"]
    assert errors["n"] == 54 and abs(errors["mean"]) < 0.25
    # Low load cell by cell: 36 decode-only steps of batch 2 at γ = 3, each 2 × 2 tokens
    # in 20 + 2·2·4 + 15 = 51 ms: a request's token every 51 × 2 / 4 ms.
    cell = low["cells"]["B2 γ3"]
    assert cell["steps"] == 36 and cell["tokens_per_step"] == 4.0
    assert abs(cell["step_ms"] - 51.0) < 1e-6 and abs(cell["request_ms_per_token"] - 25.5) < 1e-6
    assert (
        "predicted_step_ms" in cell
        and "predicted_step_ms" not in (static["r0-static-p0"]["cells"]["B2 γ1"])
    )
    assert high["cells"] == {}  # batch 48: not a low-load cell
    # The replayed point estimate at batch 2, for every γ — the one run there (γ = 3) at
    # what its steps measured, the others priced by the regression alone; none for a
    # pass that learns nothing, or for a batch size that is not low load.
    estimate = low["estimates"]["B2"]
    assert len(estimate["step_ms"]) == len(estimate["tokens_per_request"]) == 4
    assert abs(estimate["step_ms"][3] - 51.0) < 0.5
    assert estimate["tokens_per_request"] == sorted(estimate["tokens_per_request"])
    pairs = zip(estimate["tokens_per_request"], estimate["step_ms"], strict=True)
    assert estimate["request_tokens_per_s"] == [1000 * t / ms for t, ms in pairs]
    assert static["r0-static-p0"]["estimates"] == {} and high["estimates"] == {}
    # The replayed per-request mode, step by step: "auto" with no request named stays on
    # the batch γ, still learning whether to plan; a pass not replayed has none.
    assert low["request_mode"] == {"steps": {"batch": 40}, "last": ["batch", "learning"]}
    assert static["r0-static-p0"]["request_mode"] == {}
    # Parameters given to the replay (the mode forced on here) decide its mode.
    forced = diagnose(tmp_path, {"per_request": True})["goodput r2"]["r0-goodput-p1"]
    assert forced["request_mode"] == {
        "steps": {"per-request": 60},
        "last": ["per-request", "forced_on"],
    }
