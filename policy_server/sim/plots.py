"""PNG figures of the serving simulator, in the style of the Nightjar paper's plots.

Uses matplotlib's object API with the Agg canvas (no pyplot state, no display), so the
figures render the same on a headless CI runner. Needs the `sim` extra.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from policy_server.sim.engine import SimResult, StepRecord
from policy_server.sim.profile import HardwareProfile

# One colour per policy across every figure.
COLOURS = {
    "goodput": "tab:brown",
    "dsd": "gold",
    "ucb": "lime",
    "nightjar": "tab:red",
    "nightjar-pow2": "tab:pink",
    "off": "black",
    "static-1": "tab:blue",
    "static-2": "tab:cyan",
    "static-3": "tab:green",
    "static-4": "tab:olive",
    "table": "tab:purple",
    "ema": "tab:orange",
    "oracle": "tab:gray",
}

# (QPS, throughput tok/s, mean end-to-end latency s) per point of a sweep.
SweepPoint = tuple[float, float, float]


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    return path


def binned(steps: Sequence[StepRecord], bin_s: float) -> list[tuple[float, list[StepRecord]]]:
    """Steps grouped by the time bin they ended in: (bin start, steps)."""
    bins: dict[int, list[StepRecord]] = {}
    for step in steps:
        bins.setdefault(int(step.time_s // bin_s), []).append(step)
    return [(index * bin_s, bins[index]) for index in sorted(bins)]


def plot_profiles(
    profiles: Mapping[str, HardwareProfile],
    points: Mapping[str, Sequence[tuple[int, float]]],
    path: Path,
) -> Path:
    """Per-layer time vs tokens: vidur's measurements and the fitted flat-then-linear curve."""
    fig = Figure(figsize=(5 * len(profiles), 3.6))
    axes = fig.subplots(1, len(profiles), squeeze=False)[0]
    for ax, (name, profile) in zip(axes, profiles.items(), strict=True):
        measured = [(n, t) for n, t in points[name] if n <= 2048]
        ax.scatter([n for n, _ in measured], [t for _, t in measured], s=10, label="vidur")
        grid = range(1, 2049, 8)
        ax.plot(grid, [profile.curve.ms(n) for n in grid], color="tab:red", label="fit")
        ax.axvline(profile.curve.knee_tokens, color="gray", linestyle=":", label="knee")
        ax.set(title=name, xlabel="tokens in the forward pass", ylabel="ms per layer")
        ax.legend()
    return _save(fig, path)


def plot_qps_sweep(sweep: Mapping[str, Mapping[str, Sequence[SweepPoint]]], path: Path) -> Path:
    """Throughput and mean latency against offered load, one line per policy, per profile."""
    fig = Figure(figsize=(11, 3.6 * len(sweep)))
    axes = fig.subplots(len(sweep), 2, squeeze=False)
    for row, (profile, by_policy) in zip(axes, sweep.items(), strict=True):
        for policy, points in by_policy.items():
            style = {"color": COLOURS.get(policy), "marker": "o", "markersize": 3, "label": policy}
            row[0].plot([p[0] for p in points], [p[1] for p in points], **style)
            row[1].plot([p[0] for p in points], [p[2] for p in points], **style)
        row[0].set(title=f"{profile}: throughput", xlabel="offered QPS", ylabel="tok/s")
        row[1].set(title=f"{profile}: latency", xlabel="offered QPS", ylabel="mean e2e s")
        row[1].set_yscale("log")
        row[0].legend(fontsize=7)
    return _save(fig, path)


def plot_gamma_timeline(
    results: Mapping[str, SimResult], path: Path, title: str, bin_s: float = 2.0
) -> Path:
    """Mean γ chosen per time bin for each source, with the decode batch size beneath."""
    fig = Figure(figsize=(10, 5.5))
    top, bottom = fig.subplots(2, 1, sharex=True)
    for label, result in results.items():
        bins = binned([s for s in result.steps if s.batch_size > 0], bin_s)
        times = [start for start, _ in bins]
        top.step(
            times,
            [sum(s.gamma for s in b) / len(b) for _, b in bins],
            where="post",
            color=COLOURS.get(label),
            label=label,
        )
        bottom.step(
            times,
            [sum(s.batch_size for s in b) / len(b) for _, b in bins],
            where="post",
            color=COLOURS.get(label),
            label=label,
        )
    top.set(title=title, ylabel=f"mean γ per {bin_s:g} s")
    bottom.set(xlabel="time s", ylabel="decode batch size")
    top.legend(fontsize=8)
    return _save(fig, path)


def plot_throughput_over_time(
    results: Mapping[str, SimResult], path: Path, title: str, bin_s: float = 10.0
) -> Path:
    """Generated tokens per second in each time bin, one line per policy."""
    fig = Figure(figsize=(10, 3.8))
    ax = fig.subplots()
    for label, result in results.items():
        bins = binned(result.steps, bin_s)
        rates = [sum(s.generated for s in b) / bin_s for _, b in bins]
        ax.plot(
            [start for start, _ in bins], rates, color=COLOURS.get(label), label=label, linewidth=1
        )
    ax.set(title=title, xlabel="time s", ylabel="tok/s")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)


def plot_regret(results: Mapping[str, SimResult], path: Path, title: str) -> Path:
    """Cumulative expected tokens lost against the per-step oracle, over time."""
    fig = Figure(figsize=(10, 3.8))
    ax = fig.subplots()
    for label, result in results.items():
        total, times, cumulative = 0.0, [], []
        for step in result.steps:
            total += step.regret_tokens
            times.append(step.time_s)
            cumulative.append(total)
        ax.plot(times, cumulative, color=COLOURS.get(label), label=label, linewidth=1)
    ax.set(title=title, xlabel="time s", ylabel="cumulative regret (tokens)")
    ax.legend(fontsize=7, ncol=2)
    return _save(fig, path)
