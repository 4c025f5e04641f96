"""The one JSON reader for what comes into the sidecar (a snapshot file, a flag, params
over the wire): values of any source are checked the same way. Free of gRPC, so that
policies may use it."""

from __future__ import annotations

import json
import math
from typing import Any, NoReturn

# Deeper than any document of ours (a snapshot's state is a few levels); past ~1,000
# levels json, copy and the encoder raise RecursionError far from where the input came in.
MAX_JSON_DEPTH = 32
# The longest object key: keys are field names or ids (engine ids, learner keys, request ids:
# at most validation.MAX_ID_LENGTH, 256 characters), learner ids an id with its "shared:" or
# "engine:" prefix (policies/base.py). A longer key is no id the sidecar could have made,
# and would only be held, logged and written back (tests check the two stay in step).
MAX_KEY_LENGTH = 256 + len("shared:")


class JsonError(ValueError):
    """Text that is not JSON the sidecar accepts (see load_json)."""


def load_json(text: str | bytes) -> Any:
    """JSON from a file, a flag or the wire, as the sidecar accepts it everywhere: finite
    numbers only (no NaN or Infinity, no float literal too large such as 1e400), integers
    of at most 4,300 digits, at most MAX_JSON_DEPTH levels of nesting, object keys of at
    most MAX_KEY_LENGTH characters; JsonError says what is wrong. A NaN learned from a
    parameter would only fail later, in a snapshot."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except RecursionError:
        raise JsonError(f"nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:  # also UnicodeDecodeError, an integer of over 4,300 digits
        raise JsonError(str(exc)) from exc
    _check_shape(value)
    return value


def _refuse_constant(name: str) -> NoReturn:
    raise JsonError(f"{name} is not a finite number: numbers must be finite")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JsonError(f"{text} is too large for a float: numbers must be finite")
    return value


def _check_shape(value: Any) -> None:
    """Nesting depth and key lengths, in one walk."""
    # Iterative: a recursive walk would itself hit the recursion limit it guards against.
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise JsonError(f"nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(item, dict):
            _check_keys(item)
            stack.extend((child, depth + 1) for child in item.values())
        else:
            stack.extend((child, depth + 1) for child in item)


def _check_keys(item: dict[str, Any]) -> None:
    longest = max(map(len, item), default=0)
    if longest > MAX_KEY_LENGTH:
        key = max(item, key=len)
        raise JsonError(
            f"an object key of {longest:,} characters ({key[:32]!r}...): keys are ids of at "
            f"most {MAX_KEY_LENGTH} characters"
        )
