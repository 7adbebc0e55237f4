"""The KV blocks a request takes at an engine (roles/scheduling/kv_room.py), by hand."""
from roles.scheduling.kv_room import blocks_for, shared_blocks


def test_blocks_for_rounds_up_and_needs_a_size():
    assert [blocks_for(n, 128) for n in (0, 1, 128, 129, 256)] == [0, 1, 1, 2, 2]
    assert blocks_for(500, 0) == 0


def test_shared_blocks_stop_at_the_first_miss():
    held = {1, 2, 3, 7}
    assert shared_blocks([1, 2, 3, 4, 7], held) == 3
    assert shared_blocks([9, 1], held) == 0
    assert shared_blocks([], held) == 0
