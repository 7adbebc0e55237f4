"""The pure part of benchmarks/engine_steps.py: the scheduler's prediction
for the last request of a burst, by hand."""

from __future__ import annotations

import sys

import pytest

from paths import REPO

sys.path.insert(0, str(REPO / "benchmarks"))

from engine_steps import PREFIX_TOKENS, predicted_last_s  # noqa: E402

# 10 ms fixed + 1 ms per new token; the cached prefix costs nothing.
COEFFS = {"c0": 0.010, "n": 1e-3}


def test_a_burst_pays_the_fixed_part_once():
    # Alone: 10 + 16 ms.
    assert predicted_last_s(COEFFS, 0.0, 16, 1, 2048) == pytest.approx(0.026)
    # Four at once: the first whole (26 ms), the others 16 ms each behind it.
    assert predicted_last_s(COEFFS, 0.0, 16, 4, 2048) == pytest.approx(0.074)
    # A decode step of 5 ms: the first decodes once answered, and the one
    # step that prefills the other three (the third and fourth join the
    # second's) carries one of its decode steps: 74 + 5 ms.
    assert predicted_last_s(COEFFS, 0.005, 16, 4, 2048) == pytest.approx(0.079)
    assert PREFIX_TOKENS == 1536
