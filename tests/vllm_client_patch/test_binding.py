"""binding.check finds what a release lacks, by import and, where a module cannot be
imported, from its source: a module written to disk plays the release."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_client_patch.binding import Symbol, check

RELEASE = """
class Base:
    def __init__(self):
        self.requests = {}

class Scheduler(Base):
    limit: int = 0

    def __init__(self, config):
        super().__init__()
        self.running = []

    def update(self, scheduler_output, model_runner_output):
        return scheduler_output.num_spec_tokens_to_schedule

    @property
    def size(self):
        return len(self.requests)
"""


@pytest.fixture(params=["importable", "needs_cuda"])
def release(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A module named like a vLLM one; ``needs_cuda`` fails at import, as a CUDA build's
    runner does on a host without a GPU."""
    name = f"fake_release_{request.param}"
    prelude = "raise ImportError('needs CUDA')\n" if request.param == "needs_cuda" else ""
    (tmp_path / f"{name}.py").write_text(prelude + textwrap.dedent(RELEASE))
    sys.path.insert(0, str(tmp_path))
    try:
        yield name
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop(name, None)


def problems(*symbols: Symbol) -> list[str]:
    return [finding.problem for finding in check(symbols)]


def test_what_the_release_has_passes(release: str) -> None:
    findings = check(
        (
            Symbol(release, "Scheduler", attributes=("running", "limit", "update")),
            Symbol(
                release,
                "Scheduler.update",
                ("self", "scheduler_output"),
                mentions=("num_spec_tokens_to_schedule",),
            ),
        )
    )
    assert [f.problem for f in findings] == ["", ""]
    expected = "source" if release.endswith("needs_cuda") else "import"
    assert {f.how for f in findings} == {expected}


def test_what_the_release_lacks_is_named(release: str) -> None:
    found = problems(
        Symbol(release, "Scheduler.schedule", ("self",)),
        Symbol(release, "Scheduler.update", ("self", "output")),
        Symbol(release, "Scheduler", attributes=("running", "num_spec_tokens")),
        Symbol(release, "Scheduler.update", ("self",), mentions=("spec_token_ids",)),
        Symbol(f"{release}_gone", "Scheduler"),
    )
    assert "Scheduler.schedule does not exist" in found[0]
    assert "takes (self, scheduler_output, model_runner_output)" in found[1]
    assert found[2].endswith("has no num_spec_tokens")
    assert found[3].endswith("no longer uses spec_token_ids")
    assert "does not exist" in found[4]


def test_attributes_assigned_in_a_base_count_when_imported(release: str) -> None:
    """Imported, the class's bases are read too; from source only the class itself."""
    (finding,) = check((Symbol(release, "Scheduler", attributes=("requests",)),))
    if finding.how == "import":
        assert finding.problem == ""
    else:
        assert finding.problem.endswith("has no requests")


def test_a_propertys_mentions_are_read_in_its_getter(release: str) -> None:
    assert problems(
        Symbol(release, "Scheduler.size", mentions=("len", "requests")),
        Symbol(release, "Scheduler.size", mentions=("running",)),
    ) == ["", f"{release}.Scheduler.size no longer uses running"]
