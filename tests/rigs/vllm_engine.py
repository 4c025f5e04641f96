"""Shared set-up of the real-vLLM tests: the CPU environment, models, one engine run.

`python tests/rigs/vllm_engine.py SPEC.json OUT.json` runs one offline engine in its own
process (vLLM keeps per-process state, so reference runs and other speculative methods
get their own), generating greedily and writing token ids and spec-decode counters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def speculative_config(method: str, draft: Path | None) -> dict[str, Any] | None:
    if method == "none":
        return None
    # The dynamic-SD schedule turns on vLLM's per-step K path; it is also the fallback table.
    common = {
        "num_speculative_tokens": GAMMA_MAX,
        "num_speculative_tokens_per_batch_size": [[1, 1024, GAMMA_MAX]],
    }
    if method == "draft_model":
        return {"method": "draft_model", "model": str(draft), **common}
    return {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, **common}


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
