"""The step budget rule of ``bucket_scheduler`` (the engine-level check, same
results and every cut at a bucket edge, is in the repository's
``tests/test_bucket_scheduler.py``)."""

from __future__ import annotations

import pytest

from spyre_inference.platform.bucket_scheduler import MIN_CUT_BUCKET, aligned_budget

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@pytest.mark.parametrize(
    ("protected", "demand", "expected"),
    [
        # A 128-token prompt joining seven decodes: 135 would pad to 256.
        (7, 135, 128),
        # Already a bucket, or above the budget (capped to it): nothing to cut.
        (7, 128, 512),
        (7, 900, 512),
        # Upper half of the gap: padding (at most half of it) is kept.
        (7, 193, 512),
        # Exactly half way still cuts: 64 deferred rows against 64 padded.
        (7, 192, 128),
        # Between 256 and the 512 budget.
        (40, 300, 256),
    ],
)
def test_cuts_only_in_the_lower_half_of_a_gap(protected, demand, expected) -> None:
    assert aligned_budget(BUCKETS, 512, protected, demand) == expected


def test_never_cuts_into_decodes_or_stalls_a_prompt() -> None:
    # 128 decodes plus one prefill token: cutting to 128 would leave the
    # prompt no token this step (and every later one while the decodes run).
    assert aligned_budget(BUCKETS, 512, 128, 129) == 512
    assert aligned_budget(BUCKETS, 512, 130, 140) == 512
    # One token of prefill left above the decodes is enough.
    assert aligned_budget(BUCKETS, 512, 127, 130) == 128


def test_custom_buckets_and_small_steps() -> None:
    assert aligned_budget((16, 64, 100), 100, 3, 70) == 64
    assert aligned_budget((16, 64, 100), 100, 3, 90) == 100
    # Below MIN_CUT_BUCKET a step's fixed cost outweighs the padding saved.
    assert MIN_CUT_BUCKET == 64
    assert aligned_budget((16, 64, 100), 100, 3, 20) == 100
    assert aligned_budget(BUCKETS, 512, 0, 3) == 512
    assert aligned_budget(BUCKETS, 512, 0, 40) == 512
    # Below the smallest bucket there is no edge to cut at.
    assert aligned_budget((100, 200), 200, 1, 9) == 200
