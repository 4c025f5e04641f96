"""A JSON object as small pieces, so that decoding it never holds the GIL for long.

One json.loads of a state of tens of MB holds the GIL for hundreds of milliseconds, and
so would one of a single engine's part of it (its per-request records: an MB). The
encoder splits every object whose JSON is larger than a limit into pieces of its members
(recursing into members that are themselves large objects); the decoder loads piece by
piece, each a short call, with the GIL handed over between them. A large list, or any
other large value, is one piece (the learned states keep their bulk in objects).

The form: for each piece, a line holding the JSON path of the object it belongs to (a
list of keys), then a line holding a JSON object of some of its members.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from typing import Any

# A piece's JSON: decoded in well under a millisecond.
PIECE_BYTES = 32 << 10


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def encode(value: Mapping[str, Any], limit: int = PIECE_BYTES) -> Iterator[bytes]:
    """``value``'s pieces (ValueError for a NaN or infinity, as snapshots refuse)."""
    yield from _pieces([], value, limit)


def _pieces(path: list[str], value: Mapping[str, Any], limit: int) -> Iterator[bytes]:
    head = _dumps(path).encode() + b"\n"
    members: list[str] = []
    size = 0

    def piece() -> bytes:
        return head + ("{" + ",".join(members) + "}").encode() + b"\n"

    yield piece()  # the object itself, even when empty or made of large members only
    for key, item in value.items():
        text = _dumps(item)
        if len(text) > limit and isinstance(item, Mapping):
            if members:  # members in their order: those before it first
                yield piece()
                members, size = [], 0
            yield from _pieces([*path, str(key)], item, limit)
            continue
        member = _dumps(str(key)) + ":" + text
        if members and size + len(member) > limit:
            yield piece()
            members, size = [], 0
        members.append(member)
        size += len(member) + 1  # and its comma
    if members:
        yield piece()


def release(value: dict[str, Any]) -> None:
    """Empty ``value`` (JSON data this caller holds the only reference to) a member at a
    time, descending into members only it holds: dropped whole, the objects of tens of
    MB are freed in one deallocation that holds the GIL for tens of milliseconds. A member
    something else also holds (a policy that kept it) is only let go of, never changed."""
    stack: list[dict[str, Any] | list[Any]] = [value]
    while stack:
        node = stack[-1]
        if not node:
            stack.pop()
            continue
        member = node.popitem()[1] if isinstance(node, dict) else node.pop()
        # Referenced by `member` and getrefcount's argument only: this caller's alone.
        if isinstance(member, dict | list) and member and sys.getrefcount(member) == 2:
            stack.append(member)


def decode(data: bytes) -> dict[str, Any]:
    """The object ``encode`` split into ``data`` (its pieces joined)."""
    root: dict[str, Any] = {}
    start = 0
    while start < len(data):
        middle = data.index(b"\n", start)
        end = data.index(b"\n", middle + 1)
        target = root
        for key in json.loads(data[start:middle]):
            target = target.setdefault(key, {})
        target.update(json.loads(data[middle + 1 : end]))
        start = end + 1
    return root
