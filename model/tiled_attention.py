"""Causal prefill attention at reduced precision whose rows do not depend
on the chunking: ``tiled_attention``.

A prompt may be computed whole, in chunks, or after a cached prefix; at
bfloat16 a different summation order moves a result by whole units of the
last place, so a position's attention output must come from the same
arithmetic every time, or greedy tokens could change with cache reuse.
Tiles of ``ATTENTION_TILE`` query positions aligned to absolute positions
give that: every row of a tile attends over the same key count (the tile's
end rounded up; keys past the prompt are zeros, masked), so a position's
keys, their blocking and the kernel are the same however its prompt was
split.  What remains is that a kernel's row must not depend on the other
query rows computed with it (a tile's first rows, or its last, may be
absent when a chunk starts or the prompt ends inside it).

Two kernels per tile: the CPU's fused flash kernel with the tile's mask
(~2x faster here: no score matrix written and read back), used where
``flash_tiles_invariant`` finds its rows independent on this machine at
one, two and all threads; else two matrix products and a softmax, whose
rows are independent by construction of the products.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import torch
import torch.nn.functional as F

from model.linear import probe_thread_counts, torch_threads

# Query rows per tile: fixed, so that a row's arithmetic is the same
# whichever chunk computes it.  Each tile is one kernel call over every key
# up to the tile's end, with an additive mask: larger tiles make fewer
# calls, while a decode step waiting for the thread waits at most one tile
# (a yield point falls between two); docs/bench.md has both measured.
ATTENTION_TILE = 256
# The CPU flash kernel splits a call's query rows into blocks of 32 (of 64
# for 192 rows or more) and computes a block of one row by another product
# whose sums round differently: a row alone in its block gets other bits
# than the same row among others.  No tile is computed with a row count
# that leaves one alone (``_flash_tiles``); the probe checks such counts.
LONE_ROW_BLOCK = 32

YieldPoint = Callable[[], None]


def tiled_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    start: int, yield_point: YieldPoint | None = None) -> torch.Tensor:
    """Causal attention of q [heads, n, hd] (positions [start, start + n))
    over keys/values [kv_heads, >= start + n, hd], in tiles of
    ``ATTENTION_TILE`` query positions aligned to absolute positions: a
    position's output is the same bits whether its prompt is computed
    whole, in chunks, or after a cached prefix.  ``yield_point`` is called
    between two tiles: what it runs on this thread must not touch this
    request's pages (a tile's inputs are its own copies and buffers)."""
    kernel = _flash_tiles if flash_tiles_invariant(q.dtype) else _product_tiles
    return kernel(q, keys, values, start, yield_point)


def _padded_kv(keys: torch.Tensor, values: torch.Tensor, end: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [0, end) copied into buffers of whole tiles, zeros past end."""
    kv_heads, _, hd = keys.shape
    padded = -(-end // ATTENTION_TILE) * ATTENTION_TILE
    k_pad = keys.new_zeros(kv_heads, padded, hd)
    k_pad[:, :end] = keys[:, :end]
    v_pad = values.new_zeros(kv_heads, padded, hd)
    v_pad[:, :end] = values[:, :end]
    return k_pad, v_pad


def _tiles(start: int, end: int):
    """(tile index, first row, end row) of each tile holding [start, end)."""
    tile = ATTENTION_TILE
    for t in range(start // tile, (end - 1) // tile + 1):
        yield t, max(t * tile, start), min((t + 1) * tile, end)


def _future(device: torch.device) -> torch.Tensor:
    """[tile, tile] True where a key of a tile's own square follows the query."""
    return torch.ones(ATTENTION_TILE, ATTENTION_TILE, dtype=torch.bool, device=device).triu_(1)


def _flash_tiles(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                 yield_point: YieldPoint | None) -> torch.Tensor:
    """Each tile by the fused kernel over keys [0, tile end) with an
    additive mask that is -inf only in the tile's own square above its
    diagonal.  A tile whose rows would leave one row alone in the kernel's
    last query block (``LONE_ROW_BLOCK``) is computed with its last row
    twice and the copy dropped."""
    heads, n, hd = q.shape
    end = start + n
    tile = ATTENTION_TILE
    k_pad, v_pad = _padded_kv(keys, values, end)
    out = q.new_empty(heads, n, hd)
    future = _future(q.device)
    # One mask buffer sized for the last (largest) tile and its extra row,
    # zero outside the square each tile sets and clears again.
    mask_buf = q.new_zeros((min(tile, n) + 1) * k_pad.shape[1])
    for t, a, b in _tiles(start, end):
        if yield_point is not None and a > start:
            yield_point()
        rows, seen = b - a, (t + 1) * tile
        lone = rows % LONE_ROW_BLOCK == 1
        mask = mask_buf[:(rows + lone) * seen].view(rows + lone, seen)
        own = mask[:, t * tile:]
        own[:rows].masked_fill_(future[a - t * tile:b - t * tile], float("-inf"))
        tile_q = q[None, :, a - start:b - start]
        if lone:   # the last row again, with its mask row
            own[rows].masked_fill_(future[b - 1 - t * tile], float("-inf"))
            tile_q = torch.cat([tile_q, tile_q[:, :, -1:]], dim=2)
        out[:, a - start:b - start] = F.scaled_dot_product_attention(
            tile_q, k_pad[None, :, :seen], v_pad[None, :, :seen],
            attn_mask=mask, enable_gqa=True)[0, :, :rows]
        own.zero_()
    return out


def _product_tiles(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                   yield_point: YieldPoint | None) -> torch.Tensor:
    """Each tile as scores (a product in the inputs' dtype), a float32-
    accumulated softmax, and a product with the values: matrix products
    whose rows do not depend on each other."""
    heads, n, hd = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    end = start + n
    tile = ATTENTION_TILE
    k_pad, v_pad = _padded_kv(keys, values, end)
    padded = k_pad.shape[1]
    k_t = k_pad.transpose(1, 2)
    # A kv head's `group` query heads share its keys: one product for all.
    qg = (q * hd ** -0.5).view(kv_heads, group, n, hd)
    out = q.new_empty(kv_heads, group, n, hd)
    future = _future(q.device)
    # Scores and probabilities of every tile in two buffers sized for the
    # last (largest) tile: megabytes allocated per tile went back to the OS
    # and were faulted in again, kernel time that slowed every process.
    largest = kv_heads * group * min(tile, n) * padded
    score_buf, prob_buf = q.new_empty(largest), q.new_empty(largest)
    for t, a, b in _tiles(start, end):
        if yield_point is not None and a > start:
            yield_point()
        rows, seen = b - a, (t + 1) * tile
        size = kv_heads * group * rows * seen
        scores = score_buf[:size].view(kv_heads, group * rows, seen)
        torch.bmm(qg[:, :, a - start:b - start].reshape(kv_heads, group * rows, hd),
                  k_t[:, :, :seen], out=scores)
        scores.view(kv_heads, group, rows, seen)[..., t * tile:].masked_fill_(
            future[a - t * tile:b - t * tile], float("-inf"))
        probs = torch.softmax(scores, -1, out=prob_buf[:size].view(kv_heads, group * rows, seen))
        out[:, :, a - start:b - start] = torch.bmm(probs, v_pad[:, :seen]).view(
            kv_heads, group, rows, hd)
    return out.view(heads, n, hd)


def probe_chunks(tile: int) -> tuple[tuple[int, int], ...]:
    """(start, end) of the probe's chunks of a prompt of 4 tiles and a part:
    the whole prompt first, then starts inside a tile and on its edge, ends
    inside one, single rows and a row alone in the kernel's last query
    block (``LONE_ROW_BLOCK``)."""
    n = 4 * tile + 44
    return ((0, n), (0, 1), (0, 37), (1, tile), (16, 3 * tile + 8), (tile, n),
            (tile + 5, 2 * tile + 3), (2 * tile, 2 * tile + 1),
            (3 * tile, 3 * tile + LONE_ROW_BLOCK + 1), (n - 50, n), (n - 1, n))


# (heads, kv_heads, head_dim) of the probe's models: grouped and not.
PROBE_HEADS = ((4, 2, 64), (8, 8, 32), (6, 2, 128))


@lru_cache(maxsize=None)
def flash_tiles_invariant(dtype: torch.dtype) -> bool:
    """Whether the fused kernel gives each tile row of ``dtype`` the same
    bits whatever other rows of its tile are computed with it, at each of
    ``probe_thread_counts``."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    gen = torch.Generator().manual_seed(0)
    try:
        chunks = probe_chunks(ATTENTION_TILE)
        n = chunks[0][1]
        for heads, kv_heads, hd in PROBE_HEADS:
            q = torch.randn(heads, n, hd, generator=gen).to(dtype)
            k = torch.randn(kv_heads, n, hd, generator=gen).to(dtype)
            v = torch.randn(kv_heads, n, hd, generator=gen).to(dtype)
            reference = None
            for count in probe_thread_counts():
                with torch_threads(count):
                    whole = _flash_tiles(q, k, v, 0, None)
                    if reference is None:
                        reference = whole
                    elif not torch.equal(whole, reference):
                        return False
                    for a, b in chunks[1:]:
                        if not torch.equal(_flash_tiles(q[:, a:b], k[:, :b], v[:, :b], a, None),
                                           reference[:, a:b]):
                            return False
        return True
    except RuntimeError:     # a torch whose CPU kernel lacks this dtype or masks
        return False
