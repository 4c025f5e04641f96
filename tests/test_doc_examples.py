"""Speculative configs shown to operators obey the rule docs/VLLM_PLUGIN.md states beside
them: the dynamic-SD schedule lists every γ in 0…Γmax at least once (vLLM captures a CUDA
graph only for the γ it lists, and the plugin's fallback table is that schedule)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# Where a speculative config is written out for users to copy.
SOURCES = [
    "docs/VLLM_PLUGIN.md",
    "README.md",
    "deploy/README.md",
    "deploy/kubernetes/overlays/cpu/engine.yaml",
    "deploy/kubernetes/overlays/gpu/engine.yaml",
]
CONFIG = re.compile(r"\{[^{}]*\"num_speculative_tokens_per_batch_size\"[^{}]*\}", re.S)


def configs() -> list[tuple[str, dict[str, object]]]:
    found = []
    for name in SOURCES:
        path = REPO / name
        if not path.exists():
            continue
        for match in CONFIG.finditer(path.read_text()):
            found.append((name, json.loads(match.group(0))))
    return found


def test_the_examples_are_found() -> None:
    assert {name for name, _ in configs()} >= {
        "docs/VLLM_PLUGIN.md",
        "deploy/kubernetes/overlays/gpu/engine.yaml",
    }


@pytest.mark.parametrize(("source", "config"), configs())
def test_every_gamma_up_to_the_maximum_is_listed(source: str, config: dict[str, object]) -> None:
    gamma_max = config["num_speculative_tokens"]
    schedule = config["num_speculative_tokens_per_batch_size"]
    assert isinstance(gamma_max, int) and isinstance(schedule, list)
    listed = {row[2] for row in schedule}
    assert listed == set(range(gamma_max + 1)), f"{source}: lists γ {sorted(listed)}"
