"""Fault matrix, transfer row in one process: the peer restarted under the
same segment name, listening on new ports (a decode node restarted by
``mooncaked up``).  The first WRITE after the restart reaches the new
listener: a connect refused by the stale descriptor drops it, the slices
stop posting to the old address (each refusal would double the path's
back-off, up to ``nic_backoff_max_s``, past the request's deadline), and the
request, with nothing moved, is run once more against a fresh lookup.
(tests/test_faults_kill.py shows the same on a real cluster.)"""

from __future__ import annotations

from rdma.config import TransferConfig
from rdma.engine import TransferEngine
from rdma.types import WRITE, TransferRequest

SIZE = 256 << 10


def engine(name: str) -> TransferEngine:
    return TransferEngine(TransferConfig(transport="tcp", slice_bytes=64 << 10, request_timeout_s=10,
                                         nic_backoff_s=0.05, connect_timeout_s=1), name)


async def test_a_write_after_the_peer_restarted_elsewhere_lands_on_the_new_peer():
    current: dict = {}

    async def resolver(name: str):  # the conductor's lookup: the latest registration
        return current.get(name)

    src = bytearray(b"\x5a" * SIZE)
    async with engine("prefill") as sender:
        sender.set_resolver(resolver)
        region = sender.register_local_memory(src)
        write = [TransferRequest(WRITE, region.id, 0, SIZE, "decode", 0)]
        old_target = bytearray(SIZE)
        async with engine("decode") as old:
            old.register_local_memory(old_target)
            current["decode"] = old.segment_descriptor()
            await sender.transfer(write)  # raises TransferError naming a failure
        assert old_target == src
        # The peer is gone (its ports closed); a new one registers under its name.
        new_target = bytearray(SIZE)
        async with engine("decode") as new:
            new.register_local_memory(new_target)
            current["decode"] = new.segment_descriptor()
            src[:] = b"\xa5" * SIZE
            await sender.transfer(write)
        assert new_target == src
