"""Shared set-up of the real-vLLM tests: the CPU environment, models, one engine run.

`python tests/rigs/vllm_engine.py SPEC.json OUT.json` runs one offline engine in its own
process (vLLM keeps per-process state, so reference runs and other speculative methods
get their own), generating greedily and writing token ids and spec-decode counters.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.rigs.sidecar import ServerProcess

# The fastest stable vLLM-on-CPU settings on a 2-core machine (vLLM's CPU backend variables).
CPU_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
GAMMA_MAX = 3
SHORT, LONG = 48, 160  # output tokens per prompt; LONG leaves room for mid-run actions
HERE = Path(__file__).resolve().parent
PROMPTS = [
    "the quick brown fox",
    "hello world this is",
    "one two three four",
    "a b c d e f",
    "speculative decoding uses a draft",
    "the target model verifies",
]


def _dynamic_schedule() -> dict[str, Any]:
    # The dynamic-SD schedule turns on vLLM's per-step K path; it is also the fallback table.
    return {
        "num_speculative_tokens": GAMMA_MAX,
        "num_speculative_tokens_per_batch_size": [[1, 1024, GAMMA_MAX]],
    }


def draft_model_config(draft: Path | str) -> dict[str, Any]:
    """vLLM's speculative config of `draft` as the draft model, Γmax GAMMA_MAX: what the
    offline engines and the OpenAI servers of the tests and tools speculate with."""
    return {"method": "draft_model", "model": str(draft), **_dynamic_schedule()}


def speculative_config(method: str, draft: Path | None) -> dict[str, Any] | None:
    if method == "none":
        return None
    if method == "draft_model":
        return draft_model_config(str(draft))
    if method == "eagle3":  # `draft`: the head (tiny_models.build_eagle3_head)
        return {"method": "eagle3", "model": str(draft), **_dynamic_schedule()}
    if method == "mtp":  # the target's own MTP layers (tiny_models.build_mtp_target)
        return {"method": "mtp", **_dynamic_schedule()}
    return {
        "method": "ngram",
        "prompt_lookup_min": 1,
        "prompt_lookup_max": 3,
        **_dynamic_schedule(),
    }


def engine_env(
    sidecar: ServerProcess, engine_id: str, deadline_ms: int, memory_socket: Path | None = None
) -> dict[str, str]:
    """The environment of a CPU engine whose plugin `sidecar` steers: CPU_ENV and the
    plugin's settings; with `memory_socket`, the memory agent on, serving there and
    checking the sidecar's admin token."""
    env = {
        **CPU_ENV,
        "NIGHTJAR_SIDECAR": sidecar.target,
        "NIGHTJAR_ENGINE_ID": engine_id,
        "NIGHTJAR_DEADLINE_MS": str(deadline_ms),
    }
    if memory_socket is not None:
        env |= {
            "NIGHTJAR_MEMORY_AGENT": "1",
            "NIGHTJAR_MEMORY_SOCKET": str(memory_socket),
            "NIGHTJAR_ADMIN_TOKEN_FILE": str(sidecar.token_file),
        }
    return env


@contextlib.contextmanager
def engine_environ(
    sidecar: ServerProcess, engine_id: str, deadline_ms: int, **extra: str
) -> Iterator[Path]:
    """os.environ for an engine in this process (vLLM and the plugin read their settings
    from it): engine_env with the memory agent on, and `extra`. Yields the agent's socket
    path; os.environ is as it was again after."""
    saved = dict(os.environ)
    socket = Path(tempfile.mkdtemp(prefix="nj-")) / "memory.sock"
    os.environ.update(engine_env(sidecar, engine_id, deadline_ms, socket), **extra)
    try:
        yield socket
    finally:
        os.environ.clear()
        os.environ.update(saved)


def api_server_command(
    target: Path,
    port: int,
    speculative: dict[str, Any],
    *,
    served_model_name: str = "tiny",
    max_model_len: int = 512,
    max_num_seqs: int = 8,
    extra_flags: Sequence[str] = (),
) -> list[str]:
    """`python -m vllm.entrypoints.openai.api_server` serving `target` on 127.0.0.1:`port`
    with `speculative` as its speculative config. The defaults are make_llm's settings, so
    that a served engine runs as the offline ones do; `extra_flags` go before the config."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(target),
        "--served-model-name",
        served_model_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--max-num-seqs",
        str(max_num_seqs),
        "--seed",
        "0",
        *extra_flags,
        "--speculative-config",
        json.dumps(speculative),
    ]


def make_llm(
    target: Path,
    method: str,
    draft: Path | None = None,
    scheduler_cls: str | None = None,
    block_size: int | None = None,
) -> Any:
    from vllm import LLM

    return LLM(
        block_size=block_size,
        model=str(target),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        seed=0,
        max_num_seqs=8,
        disable_log_stats=False,
        scheduler_cls=scheduler_cls,
        speculative_config=speculative_config(method, draft),
    )


def generate(llm: Any, max_tokens: int = 48) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [list(out.outputs[0].token_ids) for out in llm.generate(PROMPTS, params, use_tqdm=False)]


def spec_counters(llm: Any) -> dict[str, float]:
    return {
        metric.name.removeprefix("vllm:spec_decode_"): metric.value
        for metric in llm.get_metrics()
        if metric.name.startswith("vllm:spec_decode") and hasattr(metric, "value")
    }


def prefix(reference: list[list[int]], tokens: int = SHORT) -> list[list[int]]:
    return [row[:tokens] for row in reference]


def run_engine(tmp: Path, spec: dict[str, Any], env: dict[str, str] | None = None) -> Any:
    """One offline engine in a fresh process (this file's main)."""
    spec_file, out = tmp / "spec.json", tmp / "out.json"
    spec_file.write_text(json.dumps(spec))
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NIGHTJAR_")}
    subprocess.run(
        [sys.executable, str(HERE / "vllm_engine.py"), str(spec_file), str(out)],
        env={**environ, **CPU_ENV, **(env or {})},
        check=True,
        timeout=300,
        capture_output=True,
    )
    return json.loads(out.read_text())


def when(condition: Callable[[], bool], action: Callable[[], None]) -> threading.Thread:
    """Run `action` on a thread as soon as `condition` holds (mid-generation triggers)."""

    def watch() -> None:
        deadline = time.monotonic() + 60
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.002)
        action()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def main() -> int:
    spec, out = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
    os.environ.update(CPU_ENV)
    draft = Path(spec["draft"]) if spec.get("draft") else None
    llm = make_llm(Path(spec["target"]), spec["method"], draft, spec.get("scheduler_cls"))
    tokens = generate(llm, spec.get("max_tokens", 48))
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    controller = getattr(scheduler, "nightjar", None)
    stats = controller.stats() if controller is not None else None
    out.write_text(
        json.dumps(
            {
                "tokens": tokens,
                "spec": spec_counters(llm),
                "nightjar": stats,
                "scheduler": type(scheduler).__name__,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
