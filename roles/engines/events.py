"""vLLM's KV-cache events as they travel: ZMQ frames carrying msgpack batches.

Mirrors ``vllm/distributed/kv_events.py`` of vLLM 0.32 (nothing of vLLM is
imported).  A publisher sends one three-frame message per batch::

    [topic (utf-8, usually empty), seq (8-byte big-endian u64), payload]

``seq`` counts batches from 0 in each publisher process, so a restarted
engine starts again at 0.  The payload is a msgpack ``KVEventBatch``, an
array ``[ts, events, data_parallel_rank]``; each event is a map tagged by
``"type"`` (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``).

Replay (the optional ROUTER endpoint): a DEALER sends ``[b"", start_seq]``
(8-byte big-endian) and receives ``[b"", topic, seq, payload]`` for every
buffered batch with ``seq >= start_seq``, then ``[b"", b"", END_SEQ, b""]``.

Block hashes are the engine's own (ints, or sha256 bytes when vLLM is told
so); we never interpret them beyond using them as names, because they depend
on the engine's hash function and seed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

# vLLM: ExternalBlockHash = bytes | int
EngineBlockHash = bytes | int

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Consecutive full blocks committed to a cache tier.

    ``token_ids`` covers all of them (``len(block_hashes) * block_size``);
    ``parent_block_hash`` names the block before the first (None at the root).
    """
    block_hashes: list[EngineBlockHash]
    parent_block_hash: EngineBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    # Per block: the extra inputs of its hash (LoRA, multimodal, cache_salt).
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[EngineBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class Frame(NamedTuple):
    """One published batch, still encoded (what replay buffers and fixtures hold)."""
    topic: bytes
    seq: int
    payload: bytes


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


class BadFrame(ValueError):
    """A message that is not a well-formed event batch."""


def decode_batch(payload: bytes) -> KVEventBatch:
    try:
        return _decoder.decode(payload)
    except msgspec.DecodeError as exc:  # ValidationError included: it names the field
        raise BadFrame(f"undecodable KV event batch: {exc}") from None


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def parse_frame(parts: list[bytes]) -> Frame:
    """``[topic, seq, payload]`` off a SUB socket (or a replay reply without its
    leading empty frame)."""
    if len(parts) != 3 or len(parts[1]) != 8:
        raise BadFrame(f"expected [topic, 8-byte seq, payload]; got {len(parts)} frames")
    return Frame(parts[0], int.from_bytes(parts[1], "big"), parts[2])


def frame_parts(frame: Frame) -> list[bytes]:
    return [frame.topic, frame.seq.to_bytes(8, "big"), frame.payload]
