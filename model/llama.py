"""The LLaMA forward pass, in plain torch functions over paged KV.

KV lives in ``kv_pages[num_pages, num_layers, 2, block_size, kv_heads,
head_dim]`` (the layout of kvstore/layout.py). The KV of token position
``pos`` of a request is in page ``block_table[pos // block_size]``, slot
``pos % block_size``. Attention writes the new tokens' K/V into their slots
first and then reads the whole context ``[0, end)`` back from the pages, so a
prefix that another node or the store put into pages is attended to in place.
A decode step may read a sequence's contiguous copy of the same KV instead
(``SeqKV``, model/decode_kv.py), still writing the pages as well.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from model.config import ModelConfig
from model.decode_attention import decode_attention
from model.decode_kv import SeqKV
from model.linear import PREFILL_ROWS, REDUCED_PRECISION, STEP_ROWS, linear
from model.tiled_attention import ATTENTION_TILE, tiled_attention  # noqa: F401 (re-exported)
from model.weights import LayerWeights

# Called once a layer's K/V of the tokens being computed is in the pages.
KVWrittenHook = Callable[[int], None]
# Called on the compute thread at points inside a layer where other work may
# run on that thread (a colocated node's waiting decode steps) without
# changing the layer's result.
YieldPoint = Callable[[], None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 whatever the compute dtype (as the reference does).
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    # `normed` is a new tensor (never x): scaled in place, one allocation less.
    return normed.mul_(weight)


class Rope:
    """Rotary position embedding (half-split layout), with llama3 scaling."""

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        dim = config.head_dim
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq = 1.0 / (config.rope_theta ** exponents)
        if config.rope_scaling is not None and \
                config.rope_scaling.get("rope_type", config.rope_scaling.get("type")) == "llama3":
            inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [len(positions), head_dim] for ``apply``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        # In float64, rounded once to the compute dtype: torch's float32
        # cos/sin can give an OpenMP thread's share of a call errors of
        # ~1e-4, enough to change a position's K bits at bfloat16 between
        # nodes and to move a float32 logit; in float64 such errors stay far
        # below either dtype's last bit.
        emb = torch.cat([freqs, freqs], dim=-1).double()
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [n, heads, head_dim]; cos/sin: [n, head_dim].

        x * cos + rotate_half(x) * sin, with rotate_half(x) = [-x2, x1], done
        as x * cos and two in-place multiply-adds on its halves: three passes
        over x instead of five (neg, cat, two products, sum) and no
        temporaries; a 2,500-token prefill of the benchmark model ran 3-7%
        faster."""
        half = x.shape[-1] // 2
        cos, sin = cos[:, None, :], sin[:, None, :]
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1.0)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        return out


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Long wavelengths (beyond the original context) are slowed down by
    # `factor`, short ones are kept, and the band between is interpolated
    # linearly in 1/wavelength.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_ctx = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, blended, scaled)


def mlp(x: torch.Tensor, w: LayerWeights, tile: int = PREFILL_ROWS) -> torch.Tensor:
    gate, up = linear(x, w.gate_up, tile=tile).chunk(2, dim=-1)
    # In place on the projection's own output (nothing else holds it): two
    # [n, intermediate] temporaries less.
    return linear(F.silu(gate, inplace=True).mul_(up), w.down, tile=tile)


def _qkv(x: torch.Tensor, w: LayerWeights, c: ModelConfig, cos: torch.Tensor,
         sin: torch.Tensor, tile: int = PREFILL_ROWS
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projections of n tokens: q [n, heads, hd], k and v [n, kv_heads, hd], RoPE applied."""
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    q, k, v = linear(x, w.qkv, w.qkv_bias, tile).split([q_size, kv_size, kv_size], dim=-1)
    n = x.shape[0]
    q = Rope.apply(q.view(n, c.num_heads, c.head_dim), cos, sin)
    k = Rope.apply(k.view(n, c.num_kv_heads, c.head_dim), cos, sin)
    return q, k, v.view(n, c.num_kv_heads, c.head_dim)


def write_kv(kv_pages: torch.Tensor, layer: int, pages: torch.Tensor, slots: torch.Tensor,
             k: torch.Tensor, v: torch.Tensor) -> None:
    """Store K/V of n tokens ([n, kv_heads, hd]) at (pages[i], slots[i])."""
    kv_pages[:, layer, 0][pages, slots] = k
    kv_pages[:, layer, 1][pages, slots] = v


def gather_kv(kv_pages: torch.Tensor, layer: int, block_table: torch.Tensor,
              length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of positions [0, length) of one request, each [kv_heads, length, hd]."""
    num_blocks = -(-length // kv_pages.shape[3])
    pages = block_table[:num_blocks]
    # One index_select per tensor, of whole [bs, kvh, hd] page slabs (each
    # contiguous in the page layout); the head-major order attention wants is
    # a transposed view of it.  Gathering through a head-major view of the
    # pages copied 256-byte rows, and advanced indexing (kv[pages, layer, 0])
    # copies element-wise: each made decode steps 1.3-3x slower, with the
    # same results bit for bit.
    kvh, hd = kv_pages.shape[4], kv_pages.shape[5]
    keys = torch.index_select(kv_pages[:, layer, 0], 0, pages)
    values = torch.index_select(kv_pages[:, layer, 1], 0, pages)
    return (keys.view(-1, kvh, hd)[:length].transpose(0, 1),
            values.view(-1, kvh, hd)[:length].transpose(0, 1))


# The CPU flash-attention kernel with its log-sum-exp output (a private aten
# op since torch 2.2; absent: the masked path below is used instead).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def chunk_mask(n: int, start: int, dtype: torch.dtype,
               device: torch.device | str) -> torch.Tensor | None:
    """What ``chunk_attention`` needs for a chunk of n tokens from ``start``:
    None for the first chunk (plain causal) and on CPU (split attention),
    else ``prefix_causal_mask``."""
    if start == 0 or (_FLASH_CPU is not None and torch.device(device).type == "cpu"):
        return None
    return prefix_causal_mask(n, start, dtype, device)


def chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int,
                    mask: torch.Tensor | None,
                    yield_point: YieldPoint | None = None) -> torch.Tensor:
    """Attention of a chunk's queries q [heads, n, hd] (positions [start,
    start + n)) over keys/values [kv_heads, start + n, hd]; [heads, n, hd].

    After the first chunk, on CPU (mask None): the prefix [0, start) with no
    mask and the chunk itself causally, merged by their log-sum-exps.  With
    an explicit bottom-right causal mask the kernel computes every (query,
    key) pair of the chunk's own square, the masked half too, and builds the
    mask: the split computes only what is seen; its attention calls were
    10-25% faster on 1-3k-token contexts, about 10% of a 3k-token prefill;
    the same result to float rounding (1e-7).  In bfloat16/float16:
    ``tiled_attention``, whose result does not depend on the chunking (it
    calls ``yield_point`` between two tiles)."""
    if q.dtype in REDUCED_PRECISION:
        return tiled_attention(q, keys, values, start, yield_point)
    if start == 0:
        return F.scaled_dot_product_attention(q[None], keys[None], values[None],
                                              is_causal=True, enable_gqa=True)[0]
    if mask is not None:
        return F.scaled_dot_product_attention(q[None], keys[None], values[None],
                                              attn_mask=mask, enable_gqa=True)[0]
    heads, n, hd = q.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # Prefix: no mask, so a kv head's `group` query heads fold into one head
    # of group x n rows (no copy of K/V per query head).
    out_p, lse_p = _FLASH_CPU(q.reshape(1, kv_heads, group * n, hd), keys[None, :, :start],
                              values[None, :, :start], 0.0, False)
    out_p, lse_p = out_p.reshape(heads, n, hd), lse_p.reshape(heads, n, 1)
    # The chunk's own keys, causally (a square: top-left alignment is right).
    k_c = keys[:, start:].repeat_interleave(group, 0)[None]
    v_c = values[:, start:].repeat_interleave(group, 0)[None]
    out_c, lse_c = _FLASH_CPU(q[None], k_c, v_c, 0.0, True)
    out_c, lse_c = out_c[0], lse_c[0][..., None]
    top = torch.maximum(lse_p, lse_c)
    w_p, w_c = torch.exp(lse_p - top), torch.exp(lse_c - top)
    return ((out_p * w_p + out_c * w_c) / (w_p + w_c)).to(q.dtype)


def prefix_causal_mask(n: int, start: int, dtype: torch.dtype,
                       device: torch.device | str) -> torch.Tensor:
    """Additive [n, start + n] mask: query i (position start + i) sees keys
    [0, start + i], i.e. causal aligned to the bottom-right corner. Built once
    per chunk and shared by all layers (building it per call costs as much as
    the attention over a short suffix)."""
    allowed = torch.ones(n, start + n, dtype=torch.bool, device=device).tril(diagonal=start)
    return torch.zeros(n, start + n, dtype=dtype, device=device).masked_fill_(
        ~allowed, float("-inf"))


def prefill_layer(x: torch.Tensor, w: LayerWeights, c: ModelConfig, layer: int,
                  kv_pages: torch.Tensor, block_table: torch.Tensor, start: int,
                  cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                  on_kv_written: KVWrittenHook | None,
                  yield_point: YieldPoint | None = None) -> torch.Tensor:
    """One decoder layer over tokens [start, start + n) of one request.

    x: [n, hidden] hidden states of those tokens. KV of [0, start) must already
    be in the request's pages; this writes [start, start + n) and attends
    each new token to every position up to and including itself. mask:
    ``chunk_mask(n, start)``.  ``yield_point``: called between attention
    tiles and before the MLP, points where other work on this thread
    changes nothing of this layer's result.
    """
    n = x.shape[0]
    end = start + n
    block_size = kv_pages.shape[3]
    q, k, v = _qkv(rms_norm(x, w.attn_norm, c.rms_eps), w, c, cos, sin)
    pos = torch.arange(start, end, device=x.device)
    write_kv(kv_pages, layer, block_table[pos // block_size], pos % block_size, k, v)
    if on_kv_written is not None:
        on_kv_written(layer)
    keys, values = gather_kv(kv_pages, layer, block_table, end)
    out = chunk_attention(q.transpose(0, 1), keys, values, start, mask,
                          yield_point)  # [heads, n, hd]
    x = x + linear(out.transpose(0, 1).reshape(n, -1), w.o)
    if yield_point is not None:
        yield_point()
    return x + mlp(rms_norm(x, w.mlp_norm, c.rms_eps), w)


def decode_layer(x: torch.Tensor, w: LayerWeights, c: ModelConfig, layer: int,
                 kv_pages: torch.Tensor, block_tables: Sequence[torch.Tensor],
                 ends: Sequence[int], token_pages: torch.Tensor, token_slots: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor,
                 mirrors: Sequence[SeqKV | None] | None = None) -> torch.Tensor:
    """One decoder layer for B requests, one new token each.

    x: [B, hidden]; ends[b]: the position of request b's new token;
    block_tables[b]: its pages (at least ends[b] // block_size + 1 of them);
    token_pages / token_slots: [B], the page and slot each new token's KV
    goes to (the same for every layer: the caller computes them once per
    step).  The
    projections and the MLP run batched; attention runs per request over
    exactly its own positions [0, positions[b]], gathered from its pages.
    Padding every request to the longest one (one batched attention) cost
    B x the longest context in copies and scores: with the mixed lengths of
    a continuous batch that was 4-5x slower on CPU, and a padded slot's
    stale bytes had to be zeroed first.

    mirrors[b], if given and not None: request b's contiguous KV
    (model/decode_kv.py), holding [0, ends[b]) already (``SeqKV.sync``);
    the new token's K/V goes into it as well as into the pages, and
    attention reads it instead of gathering the pages: the same values in
    the same [kv_heads, L, hd] shape, so the same result.
    """
    bsz = x.shape[0]
    q, k, v = _qkv(rms_norm(x, w.attn_norm, c.rms_eps), w, c, cos, sin, STEP_ROWS)
    write_kv(kv_pages, layer, token_pages, token_slots, k, v)
    # Each request's new K and V as one [2, kv_heads, hd] row: one copy into
    # its mirror instead of two (per request and layer, small ops dominate).
    new_kv = torch.stack((k, v), dim=1) if mirrors is not None else None
    outs = []
    for b in range(bsz):
        mirror = mirrors[b] if mirrors is not None else None
        if mirror is None:
            keys, values = gather_kv(kv_pages, layer, block_tables[b], ends[b] + 1)
        else:
            keys, values = mirror.append(layer, ends[b], new_kv[b])
        # A request's row is computed alone, so its bits do not depend on
        # the batch (the kernel: model/decode_attention.py).
        outs.append(decode_attention(q[b], keys, values))  # [heads, hd]
    out = torch.stack(outs)
    x = x + linear(out.reshape(bsz, -1), w.o, tile=STEP_ROWS)
    return x + mlp(rms_norm(x, w.mlp_norm, c.rms_eps), w, STEP_ROWS)


class VarlenSeq(NamedTuple):
    """One request inside a batched prefill: rows [offset, offset + n) of x are
    its tokens [start, start + n); its KV lives in the pages of block_table."""
    offset: int
    n: int
    start: int
    block_table: torch.Tensor
    mask: torch.Tensor | None  # chunk_mask(n, start)


def prefill_layer_varlen(x: torch.Tensor, w: LayerWeights, c: ModelConfig, layer: int,
                         kv_pages: torch.Tensor, seqs: list[VarlenSeq], cos: torch.Tensor,
                         sin: torch.Tensor,
                         on_kv_written: Callable[[int, int], None] | None,
                         yield_point: YieldPoint | None = None) -> torch.Tensor:
    """One decoder layer over several requests' tokens at once.

    The projections and the MLP run once over all rows (the batching win);
    KV writes and attention stay per request, each over its own pages.
    ``on_kv_written(seq_index, layer)`` fires once a request's KV of this
    layer is in its pages; ``yield_point`` as for ``prefill_layer``.
    """
    block_size = kv_pages.shape[3]
    q, k, v = _qkv(rms_norm(x, w.attn_norm, c.rms_eps), w, c, cos, sin)
    outs = []
    for i, s in enumerate(seqs):
        rows = slice(s.offset, s.offset + s.n)
        end = s.start + s.n
        pos = torch.arange(s.start, end, device=x.device)
        write_kv(kv_pages, layer, s.block_table[pos // block_size], pos % block_size, k[rows], v[rows])
        if on_kv_written is not None:
            on_kv_written(i, layer)
        keys, values = gather_kv(kv_pages, layer, s.block_table, end)
        out = chunk_attention(q[rows].transpose(0, 1), keys, values, s.start, s.mask,
                              yield_point)
        outs.append(out.transpose(0, 1).reshape(s.n, -1))
    x = x + linear(torch.cat(outs), w.o)
    if yield_point is not None:
        yield_point()
    return x + mlp(rms_norm(x, w.mlp_norm, c.rms_eps), w)
