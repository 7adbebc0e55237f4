"""When an engine's KV cache has room for a request (roles/scheduling/kv_room.py), by hand."""
import pytest

from roles.scheduling.kv_room import Holder, blocks_for, room_wait_s, shared_blocks


def test_blocks_for_rounds_up_and_needs_a_size():
    assert [blocks_for(n, 128) for n in (0, 1, 128, 129, 256)] == [0, 1, 1, 2, 2]
    assert blocks_for(500, 0) == 0


def test_no_wait_while_the_free_blocks_cover_the_need():
    # 64 blocks, 40 held: 24 free covers 24, not 25.
    holders = [Holder(30, 5.0), Holder(10, 2.0)]
    assert room_wait_s(64, holders, 24, now=1.0) == 0.0
    assert room_wait_s(64, holders, 0, now=1.0) == 0.0


def test_the_wait_ends_when_enough_holders_have_released():
    holders = [Holder(30, 5.0), Holder(10, 2.0), Holder(20, 3.0)]
    # 60 of 64 held, 4 free.  Releases in time order: at 2.0 +10 (14 free),
    # at 3.0 +20 (34), at 5.0 +30 (64).
    assert room_wait_s(64, holders, 10, now=1.0) == pytest.approx(1.0)   # 14 >= 10 at 2.0
    assert room_wait_s(64, holders, 20, now=1.0) == pytest.approx(2.0)   # 34 >= 20 at 3.0
    assert room_wait_s(64, holders, 40, now=1.0) == pytest.approx(4.0)   # 64 at 5.0
    # More than the whole cache: wait for every holder.
    assert room_wait_s(64, holders, 100, now=1.0) == pytest.approx(4.0)


def test_a_holder_past_its_release_is_taken_to_release_now():
    holders = [Holder(60, 0.5)]   # expected to finish at 0.5, still there at 1.0
    assert room_wait_s(64, holders, 10, now=1.0) == 0.0


def test_shared_blocks_stop_at_the_first_miss():
    held = {1, 2, 3, 7}
    assert shared_blocks([1, 2, 3, 4, 7], held) == 3
    assert shared_blocks([9, 1], held) == 0
    assert shared_blocks([], held) == 0
