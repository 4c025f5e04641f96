"""docs/BENCHMARKS.md is shared by several `make bench…` targets; each owns one section.

A section is delimited by `<!-- NAME:begin -->` / `<!-- NAME:end -->` markers and is
replaced in place, so re-running one benchmark never touches another's figures. Also the
small pieces every report shares: a percentile of sorted figures, a target met or not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

HEADER = (
    "# Benchmarks\n\nEvery figure below was measured by the `make` target named in its "
    "section, on the machine it names.\n\n"
)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(path: Path, name: str, body: str) -> None:
    """Write `body` as section `name` of the report at `path`, in place or appended."""
    begin, end = markers(name)
    section = f"{begin}\n{body.strip(chr(10))}\n{end}\n"
    text = path.read_text() if path.exists() else HEADER
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        # The newline after the old end marker is the new section's own.
        text = head + section + rest.split(end, 1)[1].removeprefix("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The value at quantile ``q`` (nearest rank) of already sorted values."""
    index = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[index]


def met(ok: bool) -> str:
    """A target's verdict as the reports write it."""
    return "met" if ok else "**not met**"


def shown_command(
    module: str,
    argv: Sequence[str],
    output_options: Mapping[str, int],
    targets: Mapping[tuple[str, ...], str],
) -> str:
    """The command as a report states it: ``python -m MODULE`` and the options that set the
    measured conditions (not ``output_options``, which say where results go and how many
    values follow each), or the make target whose options those are (``targets``)."""
    shown: list[str] = []
    skip = 0
    for arg in argv:
        name = arg.split("=", 1)[0]
        if skip:
            skip -= 1
        elif name in output_options:
            skip = output_options[name] if "=" not in arg else 0
        else:
            shown.append(arg)
    target = targets.get(tuple(shown))
    return target if target is not None else " ".join(["python -m " + module, *shown])
