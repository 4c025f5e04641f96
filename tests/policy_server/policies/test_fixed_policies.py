"""static, off and table policies, and the c_prefill table they share files with."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from nightjar_common.types import BinType, StepContext
from policy_server.policies import REGISTRY, PolicyError, UnknownPolicyError, create_policy
from policy_server.policies.fixed import TablePolicy
from policy_server.prefill_cost import MAX_BYTES as PREFILL_MAX_BYTES
from policy_server.prefill_cost import PrefillCostError, PrefillCostTable


def ctx(batch_size: int, **kw: Any) -> StepContext:
    return StepContext(engine_id="e", batch_size=batch_size, **kw)


def test_static_and_off() -> None:
    static = create_policy("static", {"gamma": 2})
    assert [static.decide(ctx(b)).gamma for b in (1, 64, 512)] == [2, 2, 2]
    assert static.decide(ctx(1, draft_resident=False)).bin_type is BinType.FORCED
    assert static.decide(ctx(1, draft_resident=False)).gamma == 0
    assert static.decide(ctx(1, max_gamma=1)).gamma == 1  # the engine's limit bounds it
    off = create_policy("off")
    assert {off.decide(ctx(b)).gamma for b in (1, 8, 64)} == {0}


def test_table_matches_vllm_dynamic_sd_ranges() -> None:
    table = TablePolicy({"schedule": [[1, 4, 3], [5, 16, 1], [17, 32, 0]], "default_gamma": 2})
    got = {b: table.decide(ctx(b)).gamma for b in (1, 4, 5, 16, 17, 32, 33, 10_000)}
    assert got == {1: 3, 4: 3, 5: 1, 16: 1, 17: 0, 32: 0, 33: 2, 10_000: 2}
    assert table.decide(ctx(1, max_gamma=2)).gamma == 2
    assert table.gamma_max == 3


@pytest.mark.parametrize(
    "params",
    [
        {"schedule": [[1, 8, 3], [8, 16, 1]]},  # overlap
        {"schedule": [[0, 8, 3]]},
        {"schedule": [[4, 2, 3]]},
        {"schedule": [[1, 2]]},
        {"schedule": [[1, 2, -1]]},
        {"default_gamma": 99},
    ],
)
def test_bad_tables_are_rejected(params: dict[str, Any]) -> None:
    with pytest.raises(PolicyError):
        TablePolicy(params)


def test_unknown_policy_name() -> None:
    registered = ", ".join(sorted(REGISTRY))
    assert "goodput" in registered and "nightjar" in registered
    with pytest.raises(UnknownPolicyError, match=f"registered: {registered}$"):
        create_policy("eagle-magic")


def test_prefill_cost_interpolates_bilinearly_and_clamps(tmp_path: Path) -> None:
    # The paper's Table 3 (7B on an RTX 4090), in ms.
    path = tmp_path / "table3.csv"
    path.write_text(
        "lag_tokens,batch_size,c_prefill_ms\n"
        "128,32,17.87\n128,64,28.53\n256,32,20.65\n256,64,22.33\n512,32,24.30\n512,64,102.03\n"
    )
    table = PrefillCostTable.from_csv(path)
    assert table.seconds_at(128, 32) == pytest.approx(0.01787)
    assert table.seconds_at(512, 64) == pytest.approx(0.10203)
    assert table.seconds_at(192, 32) == pytest.approx((0.01787 + 0.02065) / 2)
    centre = (0.02065 + 0.02233 + 0.02430 + 0.10203) / 4
    assert table.seconds_at(384, 48) == pytest.approx(centre)
    assert table.seconds_at(10, 1) == pytest.approx(0.01787)  # clamped low
    assert table.seconds_at(4096, 1024) == pytest.approx(0.10203)  # clamped high


@pytest.mark.parametrize(
    "text",
    [
        "lag_tokens,batch_size\n1,2\n",
        "lag_tokens,batch_size,c_prefill_ms\n1,2,x\n",
        "lag_tokens,batch_size,c_prefill_ms\n1,2,3\n2,4,5\n",  # grid point (1,4) missing
        "lag_tokens,batch_size,c_prefill_ms\n1,2,-3\n",
        "lag_tokens,batch_size,c_prefill_ms\n",
    ],
)
def test_bad_prefill_tables_fail_clearly(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(PrefillCostError, match=r"bad\.csv"):
        PrefillCostTable.from_csv(path)


def test_random_covers_every_gamma_reproducibly_per_engine() -> None:
    a, b = (
        create_policy("random", {"gamma_max": 3, "seed": 7}),
        create_policy("random", {"gamma_max": 3, "seed": 7}),
    )
    draws = [a.decide(ctx(4)).gamma for _ in range(400)]
    assert set(draws) == {0, 1, 2, 3}
    assert draws == [b.decide(ctx(4)).gamma for _ in range(400)]  # same seed, same sequence
    other = [a.decide(StepContext(engine_id="f", batch_size=4)).gamma for _ in range(400)]
    assert other != draws  # engines draw from their own streams
    assert a.decide(ctx(4, max_gamma=1)).gamma in (0, 1)
    assert a.decide(ctx(4, draft_resident=False)).bin_type is BinType.FORCED
    with pytest.raises(PolicyError):
        create_policy("random", {"gamma_max": -1})


def test_a_prefill_table_that_is_no_regular_file_or_too_large_is_refused(tmp_path: Path) -> None:
    """A client may name it (SwapPolicy params): the reader must not block or read at will."""
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    with pytest.raises(PrefillCostError, match="is not a regular file"):
        PrefillCostTable.from_csv(fifo)  # returns at once: opened without blocking
    huge = tmp_path / "huge.csv"
    with huge.open("wb") as fh:
        fh.truncate(PREFILL_MAX_BYTES + 1)  # sparse
    with pytest.raises(PrefillCostError, match="is larger than"):
        PrefillCostTable.from_csv(huge)
