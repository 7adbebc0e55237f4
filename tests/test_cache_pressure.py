"""The cost of evicting an engine's cached blocks (roles/scheduling/cache_pressure.py), by hand."""

from __future__ import annotations

import pytest

from roles.scheduling.cache_pressure import (ReuseShare, blocks_displaced, blocks_evicted,
                                             eviction_seconds, new_blocks)
from roles.scheduling.estimators import PolynomialPrefillEstimator


def test_reuse_share_is_held_over_routed_tokens_in_a_window():
    share = ReuseShare(window=2)
    assert share.share() == 0.0
    share.add(1000, 800)
    share.add(1000, 2000)           # more held than asked for counts as all of it
    assert share.share() == pytest.approx(1800 / 2000)
    share.add(2000, 0)              # the first leaves the window
    assert share.share() == pytest.approx(1000 / 3000)


def test_new_blocks_are_full_blocks_not_held():
    assert new_blocks(1250, 0, 100) == 12          # the partial last block is not cached
    assert new_blocks(1250, 1000, 100) == 2
    assert new_blocks(1250, 1250, 100) == 0
    assert new_blocks(99, 0, 100) == 0


def test_blocks_evicted_only_past_capacity_and_at_most_those_stored():
    assert blocks_evicted(20, 10, 5) == 0
    assert blocks_evicted(20, 18, 5) == 3
    assert blocks_evicted(20, 20, 5) == 5
    assert blocks_evicted(20, 40, 5) == 5          # an over-full report: each stored block evicts one


def test_copies_displace_a_block_each_even_into_room():
    assert blocks_displaced(20, 10, 5, 0) == 0     # unique blocks into room: free
    assert blocks_displaced(20, 10, 0, 4) == 4     # copies into room: one each
    assert blocks_displaced(20, 10, 5, 8) == 8 + 3  # the copies take the room first
    assert blocks_displaced(20, 20, 5, 8) == 13     # a full cache: every block stored


def test_eviction_seconds_price_evicted_tokens_at_the_margin():
    # 0.1 s fixed + 1 ms per token + 1e-6 s per token squared.
    est = PolynomialPrefillEstimator({"c0": 0.1, "n": 1e-3, "n2": 1e-6})
    # 3 blocks of 100 on a typical 1000-token prompt: f(1300) - f(1000)
    # = 0.3 + (1.69 - 1.0) = 0.99 s; half of it is asked for again.
    assert eviction_seconds(est, 3, 100, 0.5, 1000) == pytest.approx(0.495)
    assert eviction_seconds(est, 0, 100, 0.5, 1000) == 0.0
    assert eviction_seconds(est, 3, 100, 0.0, 1000) == 0.0
