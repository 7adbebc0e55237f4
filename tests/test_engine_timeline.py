"""An engine's next seconds played forward (roles/scheduling/engine_timeline.py), by hand."""
import pytest

from roles.scheduling.engine_timeline import Decoding, Queued, start_after_s


def test_without_a_cache_size_the_prefills_ahead_run_first_each_with_a_decode_step():
    # One output token each: nothing decodes, 0.2 + 0.3.
    assert start_after_s(None, [], [Queued(0.2, 5, 5, 1), Queued(0.3, 5, 5, 1)], 100,
                         step_s=0.01) == pytest.approx(0.5)
    # The first one decodes once its prefill ends: the second's step carries a decode.
    queued = [Queued(0.2, 5, 5, 4), Queued(0.3, 5, 5, 4)]
    assert start_after_s(None, [], queued, 100, step_s=0.01) == pytest.approx(0.51)
    # A request decodes from the start: each prefill step carries a decode step.
    assert start_after_s(None, [Decoding(3, 10)], queued, 100, step_s=0.01) == \
        pytest.approx(0.52)
    assert start_after_s(None, [], [], 100, step_s=0.01) == 0.0


def test_a_request_sharing_the_step_before_it_adds_its_work_and_no_decode_step():
    # The second is prefilled in the first's step: 0.2 + a decode step
    # (10 ms) for the step, + 0.05 of its own work.
    queued = [Queued(0.2, 5, 5, 4), Queued(0.05, 5, 5, 4, shares_step=True)]
    assert start_after_s(None, [Decoding(3, 10)], queued, 100, step_s=0.01) == \
        pytest.approx(0.26)
    # A cache of 20 blocks: the new request's 12 fit once the first of the
    # two (3 tokens left after their steps) ends, 2 decode steps later:
    # 0.2 + 0.01 (its step, with the decode), 0.05 (the second's work, in
    # the same step), then 2 x 0.01.
    assert start_after_s(20, [Decoding(3, 10)], queued, 12, step_s=0.01) == \
        pytest.approx(0.28)


def test_a_full_cache_waits_for_decoding_requests_to_end():
    decoding = [Decoding(30, 5), Decoding(10, 2), Decoding(20, 3)]
    # 60 of 64 held, 4 free: covers 4, not 10.  At 0.1 s a step: the
    # 10-block request ends after 2 steps (14 free), the 20-block one after
    # 3 (34), the 30-block one after 5 (64).
    assert start_after_s(64, decoding, [], 4, step_s=0.1) == 0.0
    assert start_after_s(64, decoding, [], 10, step_s=0.1) == pytest.approx(0.2)
    assert start_after_s(64, decoding, [], 20, step_s=0.1) == pytest.approx(0.3)
    assert start_after_s(64, decoding, [], 40, step_s=0.1) == pytest.approx(0.5)
    # More than the whole cache: it starts once nothing else runs.
    assert start_after_s(64, decoding, [], 100, step_s=0.1) == pytest.approx(0.5)
    assert decoding[0] == Decoding(30, 5)   # the inputs are not changed


def test_queued_prefills_slow_the_decodes_that_would_make_room():
    # 10 blocks.  X decodes holding 8 with 3 tokens left.  Queued: A (2
    # blocks, fits, 1.0 s of prefill, one output token), then B (6 blocks:
    # waits for X).  Step 0.01 s.
    # 0: A starts (10 held); B does not fit.  A's prefill with a decode
    # step: 1.01 s, X has 2 tokens left, A ends (1 token).  Nothing to
    # prefill, B does not fit: X decodes 2 steps, ends at 1.03.  B starts
    # (6 held) and the new request (2) fits: after B's 0.5 s prefill (no
    # decode beside it).  Decodes alone would have ended X at 0.03 s.
    decoding = [Decoding(8, 3)]
    queued = [Queued(1.0, 2, 2, 1), Queued(0.5, 6, 6, 1)]
    assert start_after_s(10, decoding, queued, 2, step_s=0.01) == pytest.approx(1.53)
    # The oldest waiting request holds back those behind it, even ones that fit.
    assert start_after_s(10, decoding, [Queued(0.5, 6, 6, 1)], 1, step_s=0.01) == \
        pytest.approx(0.03 + 0.5)


def test_a_started_request_decodes_and_holds_its_blocks():
    # 10 blocks, nothing running.  A (need 4, holds 6 once started, 0.2 s,
    # 3 tokens): starts, prefills 0.2 s, then decodes 2 more tokens holding
    # 6.  The new request needs 5: 6 + 5 > 10, so it waits for A's 2 steps.
    queued = [Queued(0.2, 4, 6, 3)]
    assert start_after_s(10, [], queued, 5, step_s=0.05) == pytest.approx(0.3)
    assert start_after_s(10, [], queued, 4, step_s=0.05) == pytest.approx(0.2)
