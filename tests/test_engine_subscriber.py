"""The subscriber over real ZMQ sockets on loopback, fed with recorded vLLM batches.

The publisher side (tests/fixtures/fake_publisher.py) speaks vLLM's protocol:
PUB frames [topic, seq, payload] and a ROUTER replay endpoint.  Waits poll a
condition under a generous deadline; nothing asserts on timing.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from fixtures.fake_publisher import FakePublisher, recorded
from roles.engines.engine_index import EngineIndex, Publisher
from roles.engines.events import decode_batch
from roles.engines.subscriber import Subscriber, SubscriberTiming

# Probes rarely, never stale, unless a test says otherwise.
QUIET = SubscriberTiming(probe_interval_s=3600, stale_after_s=3600)


async def until(cond, what: str, deadline_s: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not cond():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def final_keys(frames):
    """What an index fed ``frames`` in order holds (the reference)."""
    ref = EngineIndex()
    pub = Publisher("ref", "tcp://x:1", "model", 128)
    ref.add_publisher(pub)
    for f in frames:
        ref.apply(pub.key, decode_batch(f.payload))
    return ref.keys_of(pub.key)


@pytest.fixture()
async def rig():
    zctx = zmq.asyncio.Context()
    made = []

    async def make(replay=True, timing=QUIET):
        fake = FakePublisher(zctx, replay=replay)
        index = EngineIndex()
        pub = Publisher("vllm-1", fake.endpoint, "model", 128, replay_endpoint=fake.replay_endpoint)
        index.add_publisher(pub)
        sub = Subscriber(pub.key, index, zctx, timing)
        sub.start()
        made.append((fake, sub))
        await fake.wait_subscribed()
        return fake, sub, index, pub.key

    yield make
    for fake, sub in made:
        await sub.close()
        await fake.close()
    zctx.term()


async def test_in_order_stream(rig):
    _, runs = recorded()
    fake, sub, index, key = await rig()
    for f in runs[0]:
        await fake.send(f)
    await until(lambda: sub.expected == len(runs[0]), "all batches")
    assert index.keys_of(key) == final_keys(runs[0])
    assert (sub.gaps, sub.resyncs, sub.restarts, fake.replay_requests) == (0, 0, 0, [])


async def test_gap_is_healed_from_the_replay_endpoint(rig):
    _, runs = recorded()
    fake, sub, index, key = await rig()
    for f in runs[0]:
        await fake.send(f, drop=f.seq in (2, 3))
    await until(lambda: sub.expected == len(runs[0]), "all batches")
    assert index.keys_of(key) == final_keys(runs[0])
    assert (sub.gaps, sub.replayed, sub.resyncs) == (1, 2, 0)
    assert fake.replay_requests == [2]


async def test_gap_without_replay_resyncs(rig):
    _, runs = recorded()
    fake, sub, index, key = await rig(replay=False)
    for f in runs[0][:4]:
        await fake.send(f, drop=f.seq == 2)
    await until(lambda: sub.expected == 4, "batch 3")
    assert (sub.gaps, sub.resyncs) == (1, 1)
    # Forgotten on resync; batch 3 (removals only) adds nothing back.
    assert index.blocks_of(key) == 0
    await fake.send(runs[0][4])
    await until(lambda: sub.expected == 5, "batch 4")
    assert index.keys_of(key) == final_keys(runs[0][4:5])


async def test_engine_restart_clears_its_blocks(rig):
    meta, runs = recorded()
    fake, sub, index, key = await rig()
    for f in runs[0]:
        await fake.send(f)
    await until(lambda: sub.expected == len(runs[0]), "first run")
    fake.restart()
    await fake.send(runs[1][0])
    await until(lambda: sub.restarts == 1 and sub.expected == 1, "restart")
    assert index.keys_of(key) == final_keys(runs[1])
    assert index.match_tokens(index.publisher(key).context(), meta["prompts"]["a"])["vllm-1"].longest == 3


async def test_late_join_replays_history(rig):
    _, runs = recorded()
    fake, sub, index, key = await rig()
    for f in runs[0][:3]:
        await fake.send(f, drop=True)   # published before we subscribed
    for f in runs[0][3:]:
        await fake.send(f)
    await until(lambda: sub.expected == len(runs[0]), "all batches")
    assert fake.replay_requests == [0]
    assert index.keys_of(key) == final_keys(runs[0])


async def test_probe_heals_a_lost_tail_and_ignores_the_late_duplicate(rig):
    _, runs = recorded()
    fake, sub, index, key = await rig(timing=SubscriberTiming(probe_interval_s=0.05,
                                                              stale_after_s=3600))
    for f in runs[0][:2]:
        await fake.send(f)
    await fake.send(runs[0][2], drop=True)   # the last batch so far: no later seq reveals it
    await until(lambda: sub.expected == 3, "the probe to fetch batch 2")
    assert index.keys_of(key) == final_keys(runs[0][:3])
    await fake.send(runs[0][2])              # the same batch arriving late on SUB
    await fake.send(runs[0][3])
    await until(lambda: sub.expected == 4, "batch 3")
    assert (sub.restarts, sub.resyncs) == (0, 0)


async def test_probe_notices_a_restart_that_published_nothing(rig):
    _, runs = recorded()
    fake, sub, index, key = await rig(timing=SubscriberTiming(probe_interval_s=0.05,
                                                              stale_after_s=3600))
    for f in runs[0][:2]:
        await fake.send(f)
    await until(lambda: sub.expected == 2, "two batches")
    fake.restart()
    await until(lambda: sub.restarts == 1, "the probe to notice")
    assert index.blocks_of(key) == 0


async def test_silent_publisher_goes_stale_and_comes_back(rig):
    meta, runs = recorded()
    fake, sub, index, key = await rig(replay=False, timing=SubscriberTiming(
        probe_interval_s=0.05, stale_after_s=0.5))
    await fake.send(runs[0][0])
    ctx = index.publisher(key).context()
    await until(lambda: index.is_stale(key), "stale")
    # Blocks kept, but no match reports a stale engine.
    assert index.blocks_of(key) == 3
    assert index.match_tokens(ctx, meta["prompts"]["a"]) == {}
    await fake.send(runs[0][1])
    await until(lambda: not index.is_stale(key), "fresh again")
    assert index.match_tokens(ctx, meta["prompts"]["a"])["vllm-1"].longest == 3
