"""Block keys: a deterministic xxh3 hash chain over full blocks of token ids.

The key of block ``i`` (tokens ``[i*B, (i+1)*B)``, ``B`` = block size) is::

    key(-1) = 0
    key(i)  = xxh3_64(le_u64(key(i-1)) || le_u32(t_0) || ... || le_u32(t_{B-1}), seed)

where ``le_u64`` / ``le_u32`` are little-endian unsigned encodings, ``||`` is
byte concatenation and ``seed`` is ``store.hash_seed``.  Keys are unsigned
64-bit ints.  Because every key folds in its parent, equal keys mean equal
whole prefixes (up to hash collisions, which the shard guards against by
keeping each block's token ids).  Only full blocks get keys; a trailing
partial block is never cached.  Python's ``hash()`` is never used: the chain
is identical across processes, machines and Python versions.

Published traces (``hash_ids`` of 512-token blocks) are mapped into the same
key space by expanding each hash id into 512 deterministic token ids
(:func:`trace_token_ids`) and hashing those tokens like any prompt, so a
replayed request and the shard agree on keys whatever the block size.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from kvstore.config import DEFAULT_HASH_SEED

ROOT_PARENT = 0
TRACE_BLOCK_TOKENS = 512
_U32_MAX = (1 << 32) - 1
_U64_MASK = (1 << 64) - 1


def _token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes; rejects ids outside uint32."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token_ids must be one-dimensional; got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token_ids must be integers; got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _U32_MAX:
        raise ValueError("token_ids must be in 0..2**32-1")
    return arr.astype("<u4", copy=False).tobytes()


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """The byte encoding of token ids used by the chain (little-endian uint32)."""
    return _token_bytes(token_ids)


def block_keys(token_ids: Sequence[int] | np.ndarray, block_size: int,
               seed: int = DEFAULT_HASH_SEED, parent: int = ROOT_PARENT) -> list[int]:
    """Keys of the full blocks of ``token_ids``; a trailing partial block gets none.

    ``parent`` continues an existing chain (the key of the block just before
    ``token_ids[0]``), e.g. when a decode node seals a new block of output.
    """
    if not 1 <= block_size:
        raise ValueError(f"block_size must be positive; got {block_size}")
    if not 0 <= seed <= _U64_MASK:
        raise ValueError(f"seed must be in 0..2**64-1; got {seed}")
    if not 0 <= parent <= _U64_MASK:
        raise ValueError(f"parent must be in 0..2**64-1; got {parent}")
    data = memoryview(_token_bytes(token_ids))
    stride = 4 * block_size
    n_full = len(data) // stride
    digest = xxhash.xxh3_64_intdigest
    keys: list[int] = []
    prev = parent
    for i in range(n_full):
        prev = digest(prev.to_bytes(8, "little") + data[i * stride:(i + 1) * stride], seed=seed)
        keys.append(prev)
    return keys


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on a uint64 array (wrapping arithmetic)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def trace_token_ids(hash_ids: Sequence[int], input_length: int, vocab_size: int,
                    seed: int = DEFAULT_HASH_SEED, reserved: int = 0) -> np.ndarray:
    """Deterministic prompt tokens for a trace request (uint32 array of ``input_length``).

    Hash id ``h`` becomes the 512 tokens, for ``j`` in ``0..511``::

        t_j = reserved + splitmix64(((h * 512 + j) mod 2**64) XOR seed) mod (vocab_size - reserved)

    so requests that share leading hash ids share leading tokens (and keys).
    The last block is cut to ``input_length``; ``len(hash_ids)`` must be
    ``ceil(input_length / 512)`` as in the published traces.  ``reserved``
    keeps the lowest ids (special tokens) out of synthetic prompts.
    """
    n = len(hash_ids)
    if input_length < 0 or n != -(-input_length // TRACE_BLOCK_TOKENS):
        raise ValueError(f"hash_ids has {n} entries; input_length={input_length} needs "
                         f"ceil(input_length/512)={-(-max(input_length, 0) // TRACE_BLOCK_TOKENS)}")
    if not 0 <= reserved < vocab_size <= _U32_MAX + 1:
        raise ValueError(f"need 0 <= reserved < vocab_size <= 2**32; got reserved={reserved}, "
                         f"vocab_size={vocab_size}")
    ids = np.asarray(hash_ids, dtype=np.int64).reshape(-1)
    if ids.size and int(ids.min()) < 0:
        raise ValueError("hash_ids must be non-negative")
    pos = (ids.astype(np.uint64)[:, None] * np.uint64(TRACE_BLOCK_TOKENS)
           + np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint64)[None, :])
    mixed = _splitmix64(pos.reshape(-1) ^ np.uint64(seed))
    tokens = np.uint64(reserved) + mixed % np.uint64(vocab_size - reserved)
    return tokens[:input_length].astype(np.uint32)


def trace_block_keys(hash_ids: Sequence[int], input_length: int, block_size: int,
                     vocab_size: int, seed: int = DEFAULT_HASH_SEED, reserved: int = 0) -> list[int]:
    """Block keys of a trace request: ``block_keys(trace_token_ids(...))``."""
    tokens = trace_token_ids(hash_ids, input_length, vocab_size, seed, reserved)
    return block_keys(tokens, block_size, seed)


class BlockHasher:
    """The key chain bound to one (block_size, seed), as configured for a cluster."""

    def __init__(self, block_size: int, seed: int = DEFAULT_HASH_SEED) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive; got {block_size}")
        self.block_size = block_size
        self.seed = seed

    def keys(self, token_ids: Sequence[int] | np.ndarray, parent: int = ROOT_PARENT) -> list[int]:
        return block_keys(token_ids, self.block_size, self.seed, parent)

    def trace_keys(self, hash_ids: Sequence[int], input_length: int, vocab_size: int,
                   reserved: int = 0) -> list[int]:
        return trace_block_keys(hash_ids, input_length, self.block_size, vocab_size,
                                self.seed, reserved)
