"""Step-time model of a target/draft pair, calibrated from vidur per-operation profiles.

vidur's ``mlp.csv`` gives, per tensor-parallel degree and per number of tokens in the
forward pass, the time (ms) of every non-attention operation of *one* decoder layer.
We sum them, fit ``t(n) = max(flat, a + b·n)`` (memory-bound below the knee,
compute-bound above), and build a step time:

    step(B, γ, prefill) = layers · t(prefill + B·(γ+1))           target verify/prefill
                        + attention(context tokens read)            KV reads, memory-bound
                        + γ · draft(B) + c_switch                   draft passes, catch-up
                        + overhead

The draft is a small model whose pass is launch-bound: ``draft(B) = d0 + d1·B`` (ms).
With a γ_i per request (``Verification``), γ is the batch's cap: the drafter runs γ
passes over the batch, and the target verifies Σ(γ_i + 1) tokens.
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

# Non-attention ops of one decoder layer in vidur's mlp.csv.
OPS = (
    "emb",
    "input_layernorm",
    "attn_pre_proj",
    "attn_rope",
    "attn_post_proj",
    "post_attention_layernorm",
    "mlp_up_proj",
    "mlp_act",
    "mlp_down_proj",
    "add",
)


@dataclasses.dataclass(frozen=True, slots=True)
class LayerCurve:
    """t(n) = max(flat, intercept + slope·n), milliseconds per layer."""

    flat: float
    intercept: float
    slope: float

    def ms(self, tokens: float) -> float:
        return max(self.flat, self.intercept + self.slope * tokens)

    @property
    def knee_tokens(self) -> float:
        return (self.flat - self.intercept) / self.slope if self.slope > 0 else math.inf


def load_layer_times(path: str | Path, tensor_parallel: int) -> list[tuple[int, float]]:
    """(num_tokens, ms per layer) from a vidur mlp.csv for one TP degree."""
    points = []
    with Path(path).open(newline="") as fh:
        for row in csv.DictReader(fh):
            if int(row["num_tensor_parallel_workers"]) != tensor_parallel:
                continue
            ms = sum(float(row[f"time_stats.{op}.mean"]) for op in OPS)
            points.append((int(row["num_tokens"]), ms))
    if not points:
        raise ValueError(f"{path}: no rows for tensor parallel degree {tensor_parallel}")
    return sorted(points)


def fit_layer_curve(points: Sequence[tuple[int, float]], max_tokens: int = 2048) -> LayerCurve:
    """Least-squares fit of max(flat, a + b·n) by scanning the knee over the sample points."""
    pts = [(n, t) for n, t in points if n <= max_tokens]
    best: tuple[float, LayerCurve] | None = None
    for k in range(2, len(pts) - 2):
        low, high = pts[:k], pts[k:]
        flat = sum(t for _, t in low) / len(low)
        mean_n = sum(n for n, _ in high) / len(high)
        mean_t = sum(t for _, t in high) / len(high)
        var = sum((n - mean_n) ** 2 for n, _ in high)
        slope = sum((n - mean_n) * (t - mean_t) for n, t in high) / var if var else 0.0
        curve = LayerCurve(flat, mean_t - slope * mean_n, max(slope, 0.0))
        error = sum((curve.ms(n) - t) ** 2 for n, t in pts)
        if best is None or error < best[0]:
            best = (error, curve)
    assert best is not None, "need at least 5 sample points"
    return best[1]


@dataclasses.dataclass(frozen=True, slots=True)
class Verification:
    """The verify work of a step whose requests verify their own γ_i ≤ the drafted cap."""

    # Σ γ_i: draft tokens the target verifies (and rejection-samples).
    draft_tokens: int
    # Σ context_i · γ_i / Σ context_i: the γ by which the extra query tokens re-read the KV
    # (each request's attention grows with its own γ_i).
    attention_gamma: float

    @classmethod
    def of(cls, gammas: Sequence[int], contexts: Sequence[int]) -> Verification:
        """The verify work of requests with these γ_i and context lengths (same order)."""
        context = sum(contexts)
        weighted = sum(g * c for g, c in zip(gammas, contexts, strict=True))
        return cls(sum(gammas), weighted / context if context else 0.0)


@dataclasses.dataclass(frozen=True, slots=True)
class HardwareProfile:
    """Everything the simulator needs to time a step of one target/draft pair."""

    name: str
    layers: int
    curve: LayerCurve
    # KV bytes read per context token across all layers (this TP shard), and HBM GB/s.
    kv_bytes_per_token: float
    memory_gbps: float
    # Verify attention over γ+1 query tokens re-reads part of the KV per extra query
    # (paged-attention kernels tile queries): attention × (1 + verify_attention_factor·γ).
    verify_attention_factor: float
    # Draft pass: d0 + d1·B milliseconds.
    draft_ms: float
    draft_ms_per_request: float
    # Fixed per-step overhead (scheduler, sampling), ms.
    overhead_ms: float
    # Per draft token of the batch: proposal bookkeeping, rejection sampling and the
    # verify-side attention over γ+1 query tokens (ms). The calibration knob that places
    # the batch size where speculation stops paying (see docs/SIMULATOR.md).
    spec_token_ms: float
    # KV budget: blocks of `block_size` tokens, and the blocks the draft's weights cost.
    kv_blocks: int
    block_size: int = 16
    draft_kv_blocks: int = 0

    def target_ms(self, tokens: float) -> float:
        return self.layers * self.curve.ms(tokens) if tokens > 0 else 0.0

    def attention_ms(self, context_tokens: float) -> float:
        return context_tokens * self.kv_bytes_per_token / (self.memory_gbps * 1e6)

    def draft_pass_ms(self, batch_size: int) -> float:
        return self.draft_ms + self.draft_ms_per_request * batch_size

    def catch_up_ms(self, lag_tokens: int, batch_size: int) -> float:
        """c_prefill(L_max, B): the draft re-processes the lagging tokens of the batch."""
        if lag_tokens <= 0:
            return 0.0
        # A draft prefill over B·L tokens: launch-bound floor, then ~linear in tokens.
        return self.draft_ms + self.draft_ms_per_request * batch_size * max(1.0, lag_tokens / 16)

    def write_prefill_cost_table(
        self,
        path: str | Path,
        lags: Sequence[int] = (1, 16, 64, 256, 1024, 4096),
        batch_sizes: Sequence[int] = (1, 4, 16, 64, 256),
    ) -> Path:
        """The c_prefill CSV a profiler would measure on this engine (see prefill_cost.py)."""
        path = Path(path)
        with path.open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["lag_tokens", "batch_size", "c_prefill_ms"])
            for lag in lags:
                for batch in batch_sizes:
                    writer.writerow([lag, batch, f"{self.catch_up_ms(lag, batch):.4f}"])
        return path

    def step_seconds(
        self,
        batch_size: int,
        gamma: int,
        prefill_tokens: int = 0,
        context_tokens: int = 0,
        catch_up_lag: int = 0,
        verification: Verification | None = None,
    ) -> float:
        """Seconds of one step; ``verification``: per-request γ_i (γ is then their cap)."""
        if verification is None:  # every request verifies γ (the float operations as ever)
            verified, attention_gamma = batch_size * gamma, float(gamma)
            spec_ms = self.spec_token_ms * batch_size * gamma
        else:
            verified, attention_gamma = verification.draft_tokens, verification.attention_gamma
            # Charged per verified token: the knob is mostly rejection sampling and the
            # verify-side attention, which run on each request's own γ_i.
            spec_ms = self.spec_token_ms * verified
        tokens = prefill_tokens + batch_size + verified
        ms = (
            self.target_ms(tokens)
            + self.attention_ms(context_tokens)
            * (1 + self.verify_attention_factor * attention_gamma)
            + gamma * self.draft_pass_ms(batch_size) * (1 if batch_size else 0)
            + (self.catch_up_ms(catch_up_lag, batch_size) if gamma > 0 else 0.0)
            + spec_ms
            + self.overhead_ms
        )
        return ms / 1000.0


def _kv_bytes(layers: int, kv_heads: int, head_dim: int, tp: int, dtype_bytes: int = 2) -> float:
    return 2 * layers * (kv_heads / tp) * head_dim * dtype_bytes


# Built-in profile -> (vidur mlp.csv under the calibration directory, tensor-parallel degree).
CALIBRATION_SOURCES = {
    "llama2-7b-a100": ("a100_meta-llama_Llama-2-7b-hf_mlp.csv", 1),
    "llama2-70b-h100-tp4": ("h100_meta-llama_Llama-2-70b-hf_mlp.csv", 4),
}


def calibration_points(calibration_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """The measured per-layer times each built-in profile's curve is fitted to."""
    return {
        name: load_layer_times(Path(calibration_dir) / file, tp)
        for name, (file, tp) in CALIBRATION_SOURCES.items()
    }


def builtin_profiles(calibration_dir: str | Path) -> dict[str, HardwareProfile]:
    """The two reference profiles of the benchmark, fitted from vidur data."""
    points = calibration_points(calibration_dir)
    a100_7b = fit_layer_curve(points["llama2-7b-a100"])
    h100_70b = fit_layer_curve(points["llama2-70b-h100-tp4"])
    return {
        # Llama-2-7B on one A100-80GB with a ~68M draft (Spec-Bench's SpS pair).
        "llama2-7b-a100": HardwareProfile(
            name="llama2-7b-a100",
            layers=32,
            curve=a100_7b,
            kv_bytes_per_token=_kv_bytes(32, 32, 128, 1),
            memory_gbps=1600,
            verify_attention_factor=0.35,
            draft_ms=1.2,
            draft_ms_per_request=0.02,
            overhead_ms=1.5,
            spec_token_ms=0.03,
            kv_blocks=4096,
            draft_kv_blocks=8,
        ),
        # Llama-2-70B, TP=4 on H100s, with a 7B-class draft.
        "llama2-70b-h100-tp4": HardwareProfile(
            name="llama2-70b-h100-tp4",
            layers=80,
            curve=h100_70b,
            kv_bytes_per_token=_kv_bytes(80, 8, 128, 4),
            memory_gbps=2600,
            verify_attention_factor=0.35,
            draft_ms=3.0,
            draft_ms_per_request=0.04,
            overhead_ms=2.0,
            spec_token_ms=0.03,
            kv_blocks=16384,
            draft_kv_blocks=1000,
        ),
    }
