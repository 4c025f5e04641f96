"""A policy's learned state as JSON text, built from the parts of its engines as they are read.

The service reads a whole state an engine at a time, taking its lock for each few engines
(DecisionService._read_state). Each part (LearnedState.state of an engine, or of UNOWNED)
is encoded here as soon as it is read, outside the lock, so that what a read of 10,000
engines keeps is text: a document of millions of dicts and lists would make the cyclic
garbage collector scan them again and again (each gen-2 pass stops every thread for
tens of milliseconds), and one json.dumps of it holds the GIL for hundreds of
milliseconds. The text is the JSON of policies.base.merge_state_parts of the parts, with
every object's keys sorted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class StateText:
    """The parts added so far (merged as merge_state_parts merges them), as JSON text.

    ``allow_nan`` False: a NaN or infinity in a part raises ValueError when it is added
    (what a snapshot must refuse); True: encoded as Python's json does (NaN, Infinity)."""

    def __init__(self, allow_nan: bool = False) -> None:
        self._allow_nan = allow_nan
        # Members holding objects (engines, learners, slots): key -> the value's JSON.
        self._objects: dict[str, dict[str, str]] = {}
        # Other members (schema, gamma_max): their JSON, from the first part.
        self._scalars: dict[str, str] = {}

    def _encode(self, value: Any) -> str:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=self._allow_nan)

    def add(self, part: Mapping[str, Any]) -> None:
        for member, value in part.items():
            if isinstance(value, Mapping):
                entries = self._objects.setdefault(member, {})
                for key, entry in value.items():
                    entries[str(key)] = self._encode(entry)
            elif member not in self._scalars and member not in self._objects:
                self._scalars[member] = self._encode(value)

    def __bool__(self) -> bool:
        return bool(self._objects or self._scalars)

    def text(self) -> str:
        members = dict(self._scalars)
        for member, entries in self._objects.items():
            members[member] = _object(entries)
        return _object(members)


def _object(encoded: Mapping[str, str]) -> str:
    """A JSON object of already encoded values, keys sorted."""
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in sorted(encoded.items())) + "}"


def round_trip(state: Mapping[str, Any]) -> tuple[dict[str, Any], int]:
    """``state`` encoded as a snapshot holds it (no NaN or infinity: ValueError) and
    decoded again, and the length of its text: an entry of each object member at a time,
    so that neither json.dumps nor json.loads holds the GIL for the whole state (a
    restore's state may be tens of MB: hundreds of milliseconds in one call)."""
    text = StateText(allow_nan=False)
    text.add(state)
    loaded: dict[str, Any] = {key: json.loads(value) for key, value in text._scalars.items()}
    size = len(text.text())
    for member, entries in text._objects.items():
        loaded[member] = {key: json.loads(value) for key, value in entries.items()}
    return loaded, size
