"""load_json: the one JSON reader for files, flags and the wire refuses what would break
the sidecar later (non-finite numbers, huge integers, deep nesting) with a clear message."""

from __future__ import annotations

import pytest

from nightjar_common.json_input import MAX_JSON_DEPTH, MAX_KEY_LENGTH, JsonError, load_json
from nightjar_common.validation import MAX_ID_LENGTH
from policy_server.policies.base import learner_id_of_key, own_learner


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ('{"x": NaN}', "NaN is not a finite number"),
        ('{"x": Infinity}', "Infinity is not a finite number"),
        ("[-Infinity]", "-Infinity is not a finite number"),
        ('{"x": 1e400}', "1e400 is too large for a float"),
        ('{"x": -1e400}', "-1e400 is too large for a float"),
        ('{"x": ' + "9" * 5000 + "}", "4300"),
        ("[" * 100_000 + "]" * 100_000, f"nested more than {MAX_JSON_DEPTH} levels deep"),
        ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), "nested more than"),
        ('{"a": ' * 40 + "1" + "}" * 40, "nested more than"),
        (b'{"x": "\xff"}', "can't decode"),
        ("{]", "Expecting"),
        ('{"learners": {"shared:' + "k" * 300_000 + '": {}}}', "an object key of 300,007"),
        ('[{"a": {"' + "r" * (MAX_KEY_LENGTH + 1) + '": 1}}]', f"at most {MAX_KEY_LENGTH}"),
    ],
)
def test_refused(text: str | bytes, fragment: str) -> None:
    with pytest.raises(JsonError) as info:
        load_json(text)
    assert fragment in str(info.value)


def test_accepted() -> None:
    nested = "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH
    assert load_json(nested) is not None
    assert load_json('{"x": 1.5e300, "n": ' + "9" * 4000 + "}")["x"] == 1.5e300
    assert load_json(b'{"a": [1, 2.5, "s", null, true]}') == {"a": [1, 2.5, "s", None, True]}


def test_the_key_bound_is_the_longest_id_the_sidecar_makes() -> None:
    longest = max(
        len(learner_id_of_key("k" * MAX_ID_LENGTH)), len(own_learner("e" * MAX_ID_LENGTH))
    )
    assert longest == MAX_KEY_LENGTH
    assert load_json('{"' + learner_id_of_key("k" * MAX_ID_LENGTH) + '": 1}')
