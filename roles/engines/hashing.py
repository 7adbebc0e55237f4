"""Mooncake's KV-events hashing standard (RFC #1527), for routers that query by hash.

With seed ``S`` (1337 unless told otherwise) and a block's tokens as
little-endian u32s concatenated (``token_bytes``)::

    local[i] = XXH3_64(token_bytes(block i), S)
    seq[0]   = local[0]
    seq[i]   = XXH3_64(le_u64(seq[i-1]) || le_u64(local[i]), S)

``seq[i]`` names the whole prefix up to block ``i``.  This is not our own
block-key chain (kvstore.keys folds the parent key and the tokens into one
hash); the engine index keeps both, so /query_by_hash answers in this space
while the scheduler works in ours.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash

from kvstore.keys import token_bytes

STANDARD_SEED = 1337


def standard_seq_hashes(token_ids: Sequence[int], block_size: int, seed: int = STANDARD_SEED,
                        parent: int | None = None) -> list[int]:
    """Rolling sequence hashes of the full blocks of ``token_ids``.

    ``parent`` is ``seq`` of the block just before ``token_ids[0]`` (None at the
    root); a trailing partial block gets no hash.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive; got {block_size}")
    data = memoryview(token_bytes(token_ids))
    stride = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    out: list[int] = []
    prev = parent
    for i in range(len(data) // stride):
        local = digest(data[i * stride:(i + 1) * stride], seed=seed)
        prev = local if prev is None else digest(
            prev.to_bytes(8, "little") + local.to_bytes(8, "little"), seed=seed)
        out.append(prev)
    return out
