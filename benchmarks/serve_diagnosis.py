"""What each pass of a `make bench-vllm` run did, phase by phase, from its own records.

    python -m benchmarks.serve_diagnosis RUN_DIR [--learner-params JSON]

RUN_DIR is the directory a `benchmarks.vllm_serve` run names on its first line (it holds
the sidecar's `decisions.jsonl`, the plugin's `plugin-stats.json` and `results/`). For
every pass (a policy activation in the decision log) and phase (the time span of vLLM's
result file of that phase): the steps by batch size, the γ chosen and how (exploit,
explore or fixed), the share of steps that carried prefill, the step times measured, and
for learning passes the step time the default policy's model predicted for each step
before it learned from it (the pass's steps replayed in order into a fresh `goodput`
learner with the pass's parameters), split by whether the step carried prefill; at the
low-load batch sizes, the steps cell by cell and the replayed point estimate for every γ
at the span's end; and the per-request mode the replay was in step by step (whether
`per_request: "auto"` had engaged, and why). The plugin's table misses and fallbacks per
pass come from `results/runs.json`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from nightjar_common.types import BinType, Choice, StepContext, StepOutcome
from policy_server.decision_log import context_from_json, outcome_from_json
from policy_server.policies import create_policy
from policy_server.policies.goodput import GoodputModelPolicy, Prediction

# Batch-size buckets: the fallback table's rows, then the saturated engine's sizes.
BUCKETS = ((1, 8), (9, 24), (25, 48), (49, 4096))


@dataclasses.dataclass
class Step:
    ts: float
    policy: str
    version: str
    bin_type: str
    ctx: StepContext
    choice_gamma: int
    outcome: StepOutcome
    predicted_ms: float | None = None
    # The point estimate per γ before the step (decode steps of a low-load batch size).
    estimate: Prediction | None = None
    # The replayed engine's per-request mode after the step: (mode, reason).
    mode: tuple[str, str] | None = None


@dataclasses.dataclass
class PhaseSpan:
    label: str
    start: float
    end: float


def read_steps(log: Path) -> tuple[list[Step], list[dict[str, Any]]]:
    """Decided steps joined with their outcomes, in the order of the outcomes, and the
    policy events."""
    decisions: dict[str, dict[str, Any]] = {}
    events: list[dict[str, Any]] = []
    steps: list[Step] = []
    for line in log.read_text().splitlines():
        record = json.loads(line)
        kind = record["kind"]
        if kind == "policy":
            events.append(record)
        elif kind == "decision":
            decisions[record["decision_id"]] = record
        elif kind == "outcome":
            decided = decisions.pop(record["decision_id"], None)
            if decided is None:
                continue
            steps.append(
                Step(
                    ts=record["ts"],
                    policy=decided["policy"],
                    version=decided["policy_version"],
                    bin_type=decided.get("bin_type", ""),
                    ctx=context_from_json(decided["context"]),
                    choice_gamma=int(decided["gamma"]),
                    outcome=outcome_from_json(record["outcome"]),
                )
            )
    return steps, events


def phase_spans(results: Path) -> list[PhaseSpan]:
    """Each reported phase's wall-clock span, from vLLM's result files: vLLM stamps a
    file's `date` (local time, whole seconds) when the run ends, `duration` before it."""
    spans = []
    for manifest in json.loads((results / "runs.json").read_text()):
        for name in manifest["results"]:
            data = json.loads((results / name).read_text())
            end = datetime.datetime.strptime(data["date"], "%Y%m%d-%H%M%S").timestamp() + 1.0
            spans.append(PhaseSpan(name.removesuffix(".json"), end - data["duration"] - 1.0, end))
    return spans


def predict_pass(steps: Sequence[Step], params: dict[str, Any]) -> None:
    """Each step's predicted duration by the default policy's step-time model as it stood
    before the step (the pass replayed in order into a fresh learner), and the engine's
    per-request mode after it. The log does not hold the γ_i a per-request plan gave each
    request, so the replay takes every request at the step's γ: a cut request's accepts
    count against it (the records, and the mode that reads them, lean to the batch γ)."""
    policy = create_policy("goodput", params)
    assert isinstance(policy, GoodputModelPolicy)
    for step in steps:
        try:
            learner = policy.learner_of(step.ctx.engine_id)
        except KeyError:  # its first step: nothing learned yet
            learner = None
        if learner is not None:
            step.predicted_ms = policy.predicted_step_ms(learner, step.ctx, step.outcome)
            if _low_load_decode(step):
                step.estimate = policy.point_prediction(learner, step.ctx)
        policy.observe(step.ctx, Choice(step.choice_gamma, BinType.EXPLOIT), step.outcome)
        step.mode = policy.request_modes().get(step.ctx.engine_id)


def bucket_of(batch: int) -> str:
    for low, high in BUCKETS:
        if low <= batch <= high:
            return f"{low}-{high}" if high < 4096 else f"{low}+"
    return "?"


# Batch sizes whose decode-only steps are shown cell by cell (batch, γ): where low load
# runs, and where a request's token time (TPOT) is decided.
CELL_BATCHES = 4


def _low_load_decode(step: Step) -> bool:
    return step.outcome.prefill_tokens == 0 and step.ctx.batch_size <= CELL_BATCHES


def cells(steps: Sequence[Step]) -> dict[str, dict[str, float]]:
    """Decode-only steps of batch ≤ CELL_BATCHES by (batch, γ run): their count, mean step
    time, tokens a step, a request's time per token (step time × batch / tokens: what
    TPOT averages) and, where the pass was replayed, the model's mean prediction."""
    grouped: dict[tuple[int, int], list[Step]] = collections.defaultdict(list)
    for step in steps:
        if _low_load_decode(step):
            grouped[(step.ctx.batch_size, step.outcome.gamma)].append(step)
    shown: dict[str, dict[str, float]] = {}
    for (batch, gamma), group in sorted(grouped.items()):
        ms = 1000 * sum(s.outcome.step_seconds for s in group)
        tokens = sum(s.outcome.generated_tokens for s in group)
        cell = {
            "steps": len(group),
            "step_ms": ms / len(group),
            "tokens_per_step": tokens / len(group),
            "request_ms_per_token": ms * batch / tokens,
        }
        predicted = [s.predicted_ms for s in group if s.predicted_ms]
        if predicted:
            cell["predicted_step_ms"] = float(np.mean(predicted))
        shown[f"B{batch} γ{gamma}"] = cell
    return shown


def estimates(steps: Sequence[Step]) -> dict[str, dict[str, list[float]]]:
    """Per low-load batch size, the replayed point estimate before the last of the span's
    decode steps there, for every γ — run or not: tokens per request, step ms, and their
    ratio in tokens a request a second (what the decision ranks). A γ whose cell never ran
    is priced by the regression alone: set beside ``cells``, this shows a choice the
    estimate got wrong and why."""
    last: dict[int, Prediction] = {}
    for step in steps:
        if step.estimate is not None:
            last[step.ctx.batch_size] = step.estimate
    return {
        f"B{batch}": {
            "tokens_per_request": list(estimate.tokens),
            "step_ms": estimate.step_ms.tolist(),
            "request_tokens_per_s": [
                1000.0 * t / ms for t, ms in zip(estimate.tokens, estimate.step_ms, strict=True)
            ],
        }
        for batch, estimate in sorted(last.items())
    }


def summarize(steps: Iterable[Step]) -> dict[str, Any]:
    steps = list(steps)
    if not steps:
        return {"steps": 0}
    by_bucket: dict[str, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for step in steps:
        by_bucket[bucket_of(step.ctx.batch_size)][step.outcome.gamma] += 1
    prefill = [s for s in steps if s.outcome.prefill_tokens > 0]
    measured = np.array([1000 * s.outcome.step_seconds for s in steps])
    errors: dict[str, list[float]] = {"decode": [], "prefill": []}
    for step in steps:
        if step.predicted_ms is not None and step.predicted_ms > 0:
            key = "prefill" if step.outcome.prefill_tokens > 0 else "decode"
            errors[key].append(1000 * step.outcome.step_seconds / step.predicted_ms - 1.0)
    generated = sum(s.outcome.generated_tokens for s in steps)
    return {
        "steps": len(steps),
        "mean_batch": float(np.mean([s.ctx.batch_size for s in steps])),
        "gamma_by_batch": {b: dict(sorted(c.items())) for b, c in sorted(by_bucket.items())},
        "how": dict(collections.Counter(s.bin_type for s in steps)),
        "prefill_steps": len(prefill),
        "mean_prefill_tokens": float(np.mean([s.outcome.prefill_tokens for s in prefill]))
        if prefill
        else 0.0,
        "step_ms_mean": float(measured.mean()),
        "tokens_per_s_of_steps": 1000 * generated / float(measured.sum()),
        "model_error": {
            key: {
                "n": len(values),
                "mean": float(np.mean(values)) if values else None,
                "p90_abs": float(np.quantile(np.abs(values), 0.9)) if values else None,
            }
            for key, values in errors.items()
        },
        "cells": cells(steps),
        "estimates": estimates(steps),
        "request_mode": request_mode(steps),
    }


def request_mode(steps: Sequence[Step]) -> dict[str, Any]:
    """The replayed per-request mode: steps after which the engine planned per request or
    took the batch γ, and the mode and why at the span's last step ({} where the pass was
    not replayed)."""
    modes = [s.mode for s in steps if s.mode is not None]
    if not modes:
        return {}
    counted = collections.Counter(mode for mode, _ in modes)
    return {"steps": dict(sorted(counted.items())), "last": list(modes[-1])}


def diagnose(run_dir: Path, learner_params: dict[str, Any] | None = None) -> dict[str, Any]:
    steps, events = read_steps(run_dir / "decisions.jsonl")
    spans = phase_spans(run_dir / "results")
    by_version: dict[str, list[Step]] = collections.defaultdict(list)
    for step in steps:
        by_version[step.version].append(step)
    params = {e["policy_version"]: e.get("params", {}) for e in events}
    report: dict[str, Any] = {}
    for version, pass_steps in by_version.items():
        if pass_steps[0].policy == "goodput":
            predict_pass(pass_steps, {**params.get(version, {}), **(learner_params or {})})
        phases = {}
        for span in spans:
            inside = [s for s in pass_steps if span.start <= s.ts <= span.end]
            if inside:
                phases[span.label] = summarize(inside)
        report[f"{pass_steps[0].policy} {version}"] = phases
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--learner-params", type=json.loads, default=None)
    args = parser.parse_args(argv)
    print(json.dumps(diagnose(args.run_dir, args.learner_params), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
